"""The study's numbers with 95 % intervals: accuracy per puzzle size, per-bin token shares, update shares,
gradient norms and corrected correct ratios of several methods over several seeds, and the table of what
reproduces. Pure: numpy and polars over evaluation tables and record files, no torch.

Intervals are percentile bootstraps (B resamples, level 1 - a):

- accuracy: outcomes x[s, j] in {0, 1} of seed s (rows) on held-out puzzle j (columns, the same puzzles for
  every seed). A resample draws seeds S* and puzzles J* independently with replacement and takes
  theta* = mean_{s in S*, j in J*} x[s, j]; the interval is [q_{a/2}, q_{1-a/2}] of the theta*. A paired
  difference between two methods is the same bootstrap on d[s, j] = x_m[s, j] - x_ref[s, j].
- record statistics (shares, norms, correct ratios): units are the probed steps of each seed's run. A resample
  draws seeds with replacement, then, within each drawn seed, its steps with replacement (two levels), and
  recomputes the statistic from the drawn units (a ratio of sums for correct ratios, a mean otherwise).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from tokendyn.vocab import ALL_PARAMETERS, FULL_UPDATES, TRAIN

LEVEL = 0.95
N_BOOT = 2000


def _percentiles(samples: np.ndarray, level: float) -> tuple[float, float]:
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(samples, [a, 1.0 - a])
    return float(lo), float(hi)


def bootstrap_two_way(
    x: np.ndarray, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, lo, hi) of the matrix x[s, j] (rows: seeds, columns: puzzles): theta = mean_{s,j} x[s, j]; each of
    ``n_boot`` resamples draws rows S* and columns J* independently with replacement, theta* = mean of
    x[S*][:, J*]; [lo, hi] = the (1-level)/2 and (1+level)/2 quantiles of theta*. A constant matrix gives the
    exact interval [c, c]. NaN entries (a puzzle size a seed did not evaluate) are not allowed."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.size == 0:
        raise ValueError(f"x: must be a non-empty 2-d array (seeds x puzzles), got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("x: must be finite (every seed evaluated on every puzzle)")
    rng = np.random.default_rng(seed)
    s, p = x.shape
    theta = np.empty(n_boot)
    chunk = max(1, 2_000_000 // max(1, s * p))
    for start in range(0, n_boot, chunk):
        b = min(chunk, n_boot - start)
        rows = rng.integers(0, s, (b, s))
        cols = rng.integers(0, p, (b, p))
        theta[start : start + b] = x[rows[:, :, None], cols[:, None, :]].mean(axis=(1, 2))
    return (float(x.mean()), *_percentiles(theta, level))


def bootstrap_units(
    groups: Sequence[np.ndarray],
    statistic: Callable[[np.ndarray], float],
    n_boot: int = N_BOOT,
    level: float = LEVEL,
    seed: int = 0,
    min_units: int = 1,
) -> tuple[float, float, float]:
    """(estimate, lo, hi) of ``statistic(unit indices)`` where ``groups[s]`` holds the unit indices (probed steps)
    of seed s: each resample draws seeds with replacement, then each drawn seed's units with replacement, and
    evaluates the statistic on the concatenated indices; percentile interval as in ``bootstrap_two_way``. A
    statistic that is NaN on a resample (no decided token drawn) is left out of the quantiles. Fewer than
    ``min_units`` units in all: no interval (NaN bounds)."""
    groups = [np.asarray(g, dtype=np.int64) for g in groups if len(g)]
    if not groups:
        return (float("nan"), float("nan"), float("nan"))
    est = float(statistic(np.concatenate(groups)))
    if sum(len(g) for g in groups) < min_units:  # one unit: resampling it gives a point, not an interval
        return (est, float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    theta = np.empty(n_boot)
    for b in range(n_boot):
        picked = [groups[i] for i in rng.integers(0, len(groups), len(groups))]
        idx = np.concatenate([g[rng.integers(0, len(g), len(g))] for g in picked])
        theta[b] = statistic(idx)
    theta = theta[np.isfinite(theta)]
    if theta.size == 0:
        return (est, float("nan"), float("nan"))
    return (est, *_percentiles(theta, level))


# ---------------------------------------------------------------- accuracy


def outcome_matrix(
    evals: pl.DataFrame, method: str, mode: str, people: Sequence[int] | None = None
) -> np.ndarray:
    """x[s, j] = 1 if seed s solved puzzle j (columns: (people, puzzle) in sorted order) for one method and mode."""
    df = evals.filter((pl.col("method") == method) & (pl.col("mode") == mode))
    if people is not None:
        df = df.filter(pl.col("people").is_in(list(people)))
    if df.height == 0:
        return np.zeros((0, 0))
    wide = df.sort("people", "puzzle").pivot(on="seed", index=["people", "puzzle"], values="correct")
    seeds = sorted(c for c in wide.columns if c not in ("people", "puzzle"))
    return wide.select(seeds).to_numpy().astype(np.float64).T


def accuracy_table(evals: pl.DataFrame, n_boot: int = N_BOOT) -> pl.DataFrame:
    """Per method, mode and puzzle size (and "all" sizes pooled): accuracy with its two-way 95 % interval."""
    rows = []
    for (method, mode), _ in evals.group_by("method", "mode", maintain_order=True):
        sizes = sorted(
            evals.filter((pl.col("method") == method) & (pl.col("mode") == mode))["people"].unique()
        )
        for people in [*[[k] for k in sizes], *([sizes] if len(sizes) > 1 else [])]:
            x = outcome_matrix(evals, method, mode, people)
            if x.size == 0 or not np.isfinite(x).all():
                continue
            mean, lo, hi = bootstrap_two_way(x, n_boot)
            rows.append(
                {
                    "method": method,
                    "mode": mode,
                    "people": str(people[0]) if len(people) == 1 else "all",
                    "seeds": x.shape[0],
                    "puzzles": x.shape[1],
                    "accuracy": mean,
                    "lo": lo,
                    "hi": hi,
                }
            )
    return pl.DataFrame(rows)


def paired_difference(
    evals: pl.DataFrame, method: str, reference: str, mode: str, n_boot: int = N_BOOT
) -> tuple[float, float, float]:
    """Accuracy of ``method`` minus ``reference`` over every size, paired by seed and puzzle, with its interval."""
    a, b = outcome_matrix(evals, method, mode), outcome_matrix(evals, reference, mode)
    if a.size == 0 or a.shape != b.shape:
        return (float("nan"), float("nan"), float("nan"))
    return bootstrap_two_way(a - b, n_boot)


# ---------------------------------------------------------------- record statistics


@dataclass(frozen=True)
class Unit:
    """Per-step values of one run: a (steps x bins) array and the seed each step belongs to."""

    seeds: np.ndarray  # (U,)
    values: dict[str, np.ndarray]  # name -> (U, bins)
    bins: list[tuple[float, float]]

    def groups(self) -> list[np.ndarray]:
        return [np.flatnonzero(self.seeds == s) for s in np.unique(self.seeds)]


def _units(frames: Sequence[tuple[int, pl.DataFrame]], columns: Sequence[str]) -> Unit | None:
    """Stack per-(step, bin) frames of several seeds into per-step arrays; missing cells are NaN."""
    parts = [(seed, df) for seed, df in frames if df.height]
    if not parts:
        return None
    bins = pl.concat([df.select("bin", "bin_lo", "bin_hi") for _, df in parts]).unique("bin").sort("bin")
    nb = bins.height
    seeds, values = [], {c: [] for c in columns}
    for seed, df in parts:
        for _step, g in df.sort("step").group_by("step", maintain_order=True):
            seeds.append(seed)
            for c in columns:
                row = np.full(nb, np.nan)
                for b, v in zip(g["bin"].to_list(), g[c].to_list(), strict=True):
                    row[bins["bin"].to_list().index(b)] = np.nan if v is None else v
                values[c].append(row)
    return Unit(
        np.asarray(seeds),
        {c: np.vstack(v) for c, v in values.items()},
        list(zip(bins["bin_lo"].to_list(), bins["bin_hi"].to_list(), strict=True)),
    )


def per_bin_interval(
    unit: Unit, statistic: Callable[[dict[str, np.ndarray]], np.ndarray], n_boot: int = N_BOOT
) -> list[tuple[float, float, float]]:
    """(estimate, lo, hi) per bin of a vector statistic of the drawn units' arrays."""
    groups = unit.groups()
    out = []
    for k in range(len(unit.bins)):
        out.append(
            bootstrap_units(
                groups, lambda idx, k=k: statistic({c: v[idx] for c, v in unit.values.items()})[k], n_boot
            )
        )
    return out


def token_share_stat(v: dict[str, np.ndarray]) -> np.ndarray:
    """Share of sampled tokens per bin: sum_steps count_b / sum_steps count."""
    c = np.nan_to_num(v["count"])
    tot = c.sum()
    return c.sum(0) / tot if tot > 0 else np.full(c.shape[1], np.nan)


def mean_stat(name: str) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    """Mean over the drawn steps of a per-step quantity (NaN steps skipped)."""

    def stat(v: dict[str, np.ndarray]) -> np.ndarray:
        x = v[name]
        with np.errstate(invalid="ignore"):
            n = np.isfinite(x).sum(0)
            return np.where(n > 0, np.nansum(x, 0) / np.maximum(n, 1), np.nan)

    return stat


def correct_stat(v: dict[str, np.ndarray]) -> np.ndarray:
    """Corrected correct ratio of A > 0 tokens per bin: sum rose / sum (rose + fell), ties left out."""
    up, dec = np.nansum(v["up_pos"], 0), np.nansum(v["d_pos"], 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(dec > 0, up / np.maximum(dec, 1), np.nan)


# the stage of the whole loss in `shares` records and the full update in `prob_change` records (a Lopti run also
# writes per-stage rows; these select the rows that compare across methods)
WHOLE_LOSS_STAGE = TRAIN
FULL_UPDATE_STAGES = FULL_UPDATES


def shares_frame(lf: pl.LazyFrame) -> pl.DataFrame:
    """Per (step, bin): sampled-token count, update share s_b, ||g_b|| / ||g|| and ||g_b|| (all parameters)."""
    return (
        lf.filter(
            (pl.col("group") == ALL_PARAMETERS) & (pl.col("bin") >= 0) & (pl.col("stage") == WHOLE_LOSS_STAGE)
        )
        .select(
            "step",
            "bin",
            "bin_lo",
            "bin_hi",
            pl.col("count").cast(pl.Float64),
            pl.col("share"),
            (pl.col("grad_norm") / pl.col("total_norm")).alias("norm_ratio"),
            pl.col("grad_norm"),
        )
        .collect()
    )


def correct_frame(lf: pl.LazyFrame, update: str = "counterfactual") -> pl.DataFrame:
    """Per (step, bin): A > 0 tokens that rose (up_pos), were decided (d_pos = n_pos - ties), and the ties."""
    ties = pl.col("tie_pos").fill_null(0)
    return (
        lf.filter(
            (pl.col("update") == update)
            & pl.col("update_stage").is_in(list(FULL_UPDATE_STAGES))
            & (pl.col("source_bin") == -1)
            & (pl.col("bin") >= 0)
        )
        .group_by("step", "bin", "bin_lo", "bin_hi")
        .agg(
            (
                (pl.col("correct_pos").fill_nan(0).fill_null(0) * (pl.col("n_pos") - ties)).round(0).sum()
            ).alias("up_pos"),
            (pl.col("n_pos") - ties).sum().cast(pl.Float64).alias("d_pos"),
            ties.sum().cast(pl.Float64).alias("ties"),
            pl.col("n_pos").sum().cast(pl.Float64).alias("n_pos"),
        )
        .collect()
    )


PAIRED_RULES = (
    "base",
    "reweight",
    "lopti",
)  # the rules the study's GRPO runs compare (`tokendyn.effects.compare`)
PAIRED_MODE = "equal_norm"


def paired_correct_frame(lf: pl.LazyFrame) -> pl.DataFrame:
    """Per (step, bin) of the `paired` records (equal_norm): for each rule r, A > 0 tokens that rose (up_pos_r)
    and were decided (d_pos_r = n_pos - ties), summed over the analysed sequences: the same tokens for every rule."""
    frame = lf.filter((pl.col("mode") == PAIRED_MODE) & (pl.col("bin") >= 0)).collect()
    if frame.height == 0:
        return frame
    wide = None
    for rule in PAIRED_RULES:
        part = (
            frame.filter(pl.col("rule") == rule)
            .group_by("step", "bin", "bin_lo", "bin_hi")
            .agg(
                pl.col("up_pos").sum().cast(pl.Float64).alias(f"up_pos_{rule}"),
                (pl.col("n_pos") - pl.col("tie_pos")).sum().cast(pl.Float64).alias(f"d_pos_{rule}"),
            )
        )
        wide = (
            part
            if wide is None
            else wide.join(part, on=["step", "bin", "bin_lo", "bin_hi"], how="full", coalesce=True)
        )
    return wide


def isolation_frame(lf: pl.LazyFrame) -> pl.DataFrame:
    """Per step: mean |delta pi| of the top-bin tokens after an update with only the lowest (low_to_top) or only
    the highest (high_to_top) source bin (the paper's Fig. 1e/f); first update stage of a Lopti run skipped."""
    df = lf.filter(
        (pl.col("target_bin") >= 0) & (pl.col("count") > 0) & (pl.col("source_bin") >= 0)
    ).collect()
    if df.height == 0:
        return pl.DataFrame()
    lo_src, hi_src = df["source_bin"].min(), df["source_bin"].max()
    top = df["target_bin"].max()
    df = df.filter(pl.col("target_bin") == top)
    out = df.group_by("step").agg(
        pl.col("mean_abs").filter(pl.col("source_bin") == lo_src).mean().alias("low_to_top"),
        pl.col("mean_abs").filter(pl.col("source_bin") == hi_src).mean().alias("high_to_top"),
    )
    return out.with_columns(pl.lit(0).alias("bin"), pl.lit(0.0).alias("bin_lo"), pl.lit(1.0).alias("bin_hi"))


def bound_frame(lf: pl.LazyFrame) -> pl.DataFrame:
    """Per step: the mean over probed inner layers of spearman(||delta_l|| / |w|, 1 - pi) of each token's own
    ("direct") gradient, the quantity of the paper's Fig. 2a proportionality (its bound is per token); steps without
    direct gradients are left out."""
    df = lf.filter(
        pl.col("point").str.starts_with("layers.") & pl.col("direct_spearman").is_finite()
    ).collect()
    if df.height == 0:
        return pl.DataFrame()
    return (
        df.group_by("step")
        .agg(pl.col("direct_spearman").mean().alias("spearman"))
        .with_columns(pl.lit(0).alias("bin"), pl.lit(0.0).alias("bin_lo"), pl.lit(1.0).alias("bin_hi"))
    )


def bin_label(lo: float, hi: float) -> str:
    return f"[{lo:g}, {hi:g}{']' if hi >= 1 else ')'}"


def method_bins_table(units: dict[str, dict[str, Unit | None]], n_boot: int = N_BOOT) -> pl.DataFrame:
    """Per method and bin: token share, update share s_b, ||g_b||/||g|| and the corrected correct ratio (A > 0,
    counterfactual full update) each with its interval, and the ties over the tokens."""
    rows = []
    for method, u in units.items():
        sh, cr = u.get("shares"), u.get("correct")
        bins = (sh or cr).bins if (sh or cr) else []
        stats = {}
        if sh is not None:
            stats["token_share"] = per_bin_interval(sh, token_share_stat, n_boot)
            stats["update_share"] = per_bin_interval(sh, mean_stat("share"), n_boot)
            stats["norm_ratio"] = per_bin_interval(sh, mean_stat("norm_ratio"), n_boot)
        if cr is not None:
            stats["correct_pos"] = per_bin_interval(cr, correct_stat, n_boot)
        for k, (lo, hi) in enumerate(bins):
            row = {"method": method, "bin": k, "pi_old": bin_label(lo, hi)}
            for name, vals in stats.items():
                row[name], row[f"{name}_lo"], row[f"{name}_hi"] = vals[k] if k < len(vals) else (None,) * 3
            if cr is not None and k < cr.values["ties"].shape[1]:
                row["ties"] = int(np.nansum(cr.values["ties"][:, k]))
                row["n_pos"] = int(np.nansum(cr.values["n_pos"][:, k]))
            rows.append(row)
    return pl.DataFrame(rows)


def load_units(run_dirs_by_seed: dict[int, str]) -> dict[str, Unit | None]:
    """The per-step arrays of one method's runs (seed -> run directory)."""
    from tokendyn.analysis.load import load

    def frames(kind: str, fn) -> list[tuple[int, pl.DataFrame]]:
        out = []
        for seed, d in run_dirs_by_seed.items():
            try:
                out.append((seed, fn(load(d, kind))))
            except (FileNotFoundError, ValueError):
                continue
        return out

    return {
        "shares": _units(frames("shares", shares_frame), ["count", "share", "norm_ratio", "grad_norm"]),
        "correct": _units(frames("prob_change", correct_frame), ["up_pos", "d_pos", "ties", "n_pos"]),
        "isolation": _units(frames("influence", isolation_frame), ["low_to_top", "high_to_top"]),
        "bound": _units(frames("bound", bound_frame), ["spearman"]),
        "paired": _units(
            frames("paired", paired_correct_frame),
            [f"{k}_{r}" for r in PAIRED_RULES for k in ("up_pos", "d_pos")],
        ),
    }


# ---------------------------------------------------------------- what reproduces

REPRODUCED, NOT_REPRODUCED, EXCLUDED, NOT_RESOLVED, NO_DATA = (
    "reproduced",
    "not reproduced",
    "paper's effect excluded; sign not resolved",
    "not resolved at this size",
    "no data",
)
VERDICT_RULE = (
    "Each claim is a statistic that is > 0 when the paper's claim holds. With its 95 % bootstrap interval [lo, hi]: "
    "reproduced if lo > 0 (it excludes 0 in the paper's direction); not reproduced if hi < 0 (the interval excludes "
    "the claim, on the other side); paper's effect excluded, sign not resolved if it holds 0 but lies wholly below "
    "the paper's value; not resolved at this size only if it holds both 0 and the paper's value (or the paper gives "
    "none); no data if the records lack it or hold fewer than two probed steps with data (one step resamples to a "
    "point, not an interval)."
)


def verdict(lo: float | None, hi: float | None, paper: float | None = None) -> str:
    """The rule of VERDICT_RULE (``paper``: the paper's value of the statistic, > 0; None when it gives none)."""
    if lo is None or hi is None or not np.isfinite(lo) or not np.isfinite(hi):
        return NO_DATA
    if lo > 0:
        return REPRODUCED
    if hi < 0:
        return NOT_REPRODUCED
    if paper is not None and np.isfinite(paper) and hi < paper:
        return EXCLUDED
    return NOT_RESOLVED


@dataclass(frozen=True)
class Claim:
    phenomenon: str
    statistic: str  # what is > 0 when the claim holds
    paper: float  # the paper's value of that statistic (PAPER.md)
    paper_note: str


PAPER_SHARES = (0.1922, 0.1015, 0.1009, 0.6054)  # Fig. 1a
PAPER_NORMS = (0.71, 0.36, 0.24, 0.15)  # Fig. 1d
PAPER_CORRECT = {  # Fig. 2b (v1) / ICLR Fig. 3, A > 0 tokens
    "grpo": (0.530, 0.514, 0.501, 0.497),
    "reweight": (0.520, 0.525, 0.530, 0.526),
    "lopti": (0.524, 0.517, 0.512, 0.534),
}
PAPER_ACCURACY_3B = {"grpo": 0.39, "reweight": 0.53, "lopti": 0.54}  # Fig. 3 table, mean over 3..7 people

CLAIMS = (
    Claim("Fig. 1a shape: most sampled tokens in [.75, 1]", "share[.75,1] - max(other shares)",
          PAPER_SHARES[3] - max(PAPER_SHARES[:3]), "60.5 % vs 19.2 %"),
    Claim("Fig. 1a shape: [0, .25) the second largest (U shape)", "share[0,.25) - max(share[.25,.5), share[.5,.75))",
          PAPER_SHARES[0] - max(PAPER_SHARES[1:3]), "19.2 % vs 10.2 %"),
    Claim("Fig. 1d ordering: ||g_b|| falls with pi", "min over adjacent bins of ||g_b|| - ||g_b+1|| (/||g||)",
          min(a - b for a, b in zip(PAPER_NORMS[:-1], PAPER_NORMS[1:], strict=True)), "0.71 / 0.36 / 0.24 / 0.15"),
    Claim("Fig. 1e/1f: updating the low bin moves top-bin tokens more than updating the top bin",
          "mean |dpi| of [.75,1] tokens: low-bin update - top-bin update", 0.03, "~0.05 vs ~0.02 (read off)"),
    Claim("Fig. 2a: ||delta_l|| / |w| grows with 1 - pi (inner layers)", "spearman(||delta_l||/|w|, 1 - pi), own gradient",
          float("nan"), "a bound (Prop. 4.2), no number"),
    Claim("Fig. 2b: GRPO's correct ratio falls with pi", "correct[0,.25) - correct[.75,1] (GRPO, A > 0)",
          PAPER_CORRECT["grpo"][0] - PAPER_CORRECT["grpo"][3], "0.530 vs 0.497"),
    Claim("Fig. 2b: GRPO's top-bin correct ratio below 0.5", "0.5 - correct[.75,1] (GRPO, A > 0)",
          0.5 - PAPER_CORRECT["grpo"][3], "0.497"),
    Claim("Fig. 2b: Reweight raises the top-bin correct ratio", "correct[.75,1]: Reweight - GRPO",
          PAPER_CORRECT["reweight"][3] - PAPER_CORRECT["grpo"][3], "0.526 vs 0.497"),
    Claim("Fig. 2b: Lopti raises the top-bin correct ratio", "correct[.75,1]: Lopti - GRPO",
          PAPER_CORRECT["lopti"][3] - PAPER_CORRECT["grpo"][3], "0.534 vs 0.497"),
    Claim("Fig. 2b (paired): Reweight raises the top-bin correct ratio, same state",
          "correct[.75,1]: Reweight - GRPO update from GRPO's states, equal ||dtheta||", PAPER_CORRECT["reweight"][3]
          - PAPER_CORRECT["grpo"][3], "0.526 vs 0.497 (across runs)"),
    Claim("Fig. 2b (paired): Lopti raises the top-bin correct ratio, same state",
          "correct[.75,1]: Lopti - GRPO update from GRPO's states, equal ||dtheta||", PAPER_CORRECT["lopti"][3]
          - PAPER_CORRECT["grpo"][3], "0.534 vs 0.497 (across runs)"),
    Claim("Fig. 3: Reweight beats GRPO on K&K accuracy", "accuracy (greedy, sizes pooled): Reweight - GRPO",
          PAPER_ACCURACY_3B["reweight"] - PAPER_ACCURACY_3B["grpo"], "3B: 0.53 vs 0.39"),
    Claim("Fig. 3: Lopti beats GRPO on K&K accuracy", "accuracy (greedy, sizes pooled): Lopti - GRPO",
          PAPER_ACCURACY_3B["lopti"] - PAPER_ACCURACY_3B["grpo"], "3B: 0.54 vs 0.39"),
)  # fmt: skip


MIN_UNITS = 2  # a verdict needs at least two probed steps with data (one step resamples to a point)


def _with_data(u: Unit) -> list[np.ndarray]:
    """Each seed's units that hold data: decided A > 0 tokens for correct-ratio units, tokens for share units,
    a finite value otherwise."""
    v = u.values
    if "d_pos" in v or "a_d_pos" in v:
        ok = sum(np.nansum(v[k], 1) for k in ("d_pos", "a_d_pos", "b_d_pos") if k in v) > 0
    elif "count" in v:
        ok = np.nansum(v["count"], 1) > 0
    else:
        ok = np.all([np.isfinite(x).any(1) for x in v.values()], axis=0)
    return [g[ok[g]] for g in u.groups()]


def _two_method_units(a: Unit, b: Unit) -> Unit:
    """Units of two runs side by side (method b's seeds offset so that the bootstrap draws each run's steps)."""
    off = int(a.seeds.max()) + 1 if a.seeds.size else 0
    return Unit(
        np.concatenate([a.seeds, b.seeds + off]),
        {
            **{f"a_{c}": np.vstack([v, np.full_like(b.values[c], np.nan)]) for c, v in a.values.items()},
            **{f"b_{c}": np.vstack([np.full_like(a.values[c], np.nan), v]) for c, v in b.values.items()},
        },
        a.bins,
    )


def _top_correct_difference(a: Unit, b: Unit, n_boot: int) -> tuple[float, float, float]:
    """correct[top] of b minus a, resampling each method's seeds and steps."""
    return _correct_difference(a, b, n_boot, len(a.bins) - 1)


def _correct_difference(a: Unit, b: Unit, n_boot: int, k: int) -> tuple[float, float, float]:
    """correct[bin k] of b minus a, resampling each method's seeds and steps."""
    both = _two_method_units(a, b)
    if min(sum(len(g) for g in _with_data(u)) for u in (a, b)) < MIN_UNITS:  # each side needs an interval
        return (float("nan"), float("nan"), float("nan"))

    def stat(idx: np.ndarray) -> float:
        v = {c: x[idx] for c, x in both.values.items()}
        ca = correct_stat({"up_pos": v["a_up_pos"], "d_pos": v["a_d_pos"]})[k]
        cb = correct_stat({"up_pos": v["b_up_pos"], "d_pos": v["b_d_pos"]})[k]
        return cb - ca

    return bootstrap_units(_with_data(both), stat, n_boot, min_units=MIN_UNITS)


def _unit_stat(
    u: Unit | None, stat: Callable[[dict[str, np.ndarray]], float], n_boot: int
) -> tuple[float, float, float]:
    """stat of the per-step arrays of ``u`` with its bootstrap interval over (seed, probed step)."""
    if u is None:
        return (float("nan"),) * 3
    return bootstrap_units(
        _with_data(u), lambda idx: stat({c: x[idx] for c, x in u.values.items()}), n_boot, min_units=MIN_UNITS
    )


def _paired_correct(rule: str, b: int) -> Callable[[dict[str, np.ndarray]], float]:
    """correct[b] of ``rule``'s update minus the base rule's, on the same tokens (the `paired` units)."""

    def stat(v: dict[str, np.ndarray]) -> float:
        ours = correct_stat({"up_pos": v[f"up_pos_{rule}"], "d_pos": v[f"d_pos_{rule}"]})[b]
        base = correct_stat({"up_pos": v["up_pos_base"], "d_pos": v["d_pos_base"]})[b]
        return float(ours - base)

    return stat


def _sign(lo: float, hi: float) -> str:
    """Where the interval lies: "> 0", "< 0", "holds 0", or "no data"."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return NO_DATA
    return "> 0" if lo > 0 else "< 0" if hi < 0 else "holds 0"


def paired_bins_table(units: dict[str, dict[str, Unit | None]], n_boot: int = N_BOOT) -> pl.DataFrame:
    """Per remedy and bin of pi_old: the correct ratio (A > 0, ties apart) of the remedy's update minus GRPO's
    from the same GRPO states at equal ||dtheta|| (paired: the `paired` records of the GRPO runs, intervals over
    seeds and probed steps), beside the same difference across separate runs (the remedy's runs minus GRPO's,
    each method's seeds and steps resampled)."""
    grpo = units.get("grpo", {})
    pr, cr = grpo.get("paired"), grpo.get("correct")
    if pr is None:
        return pl.DataFrame()
    rows = []
    for rule in (r for r in PAIRED_RULES if r != "base"):
        other = units.get(rule, {}).get("correct")
        for b, (lo_edge, hi_edge) in enumerate(pr.bins):
            est, lo, hi = _unit_stat(pr, _paired_correct(rule, b), n_boot)
            a_est, a_lo, a_hi = (
                _correct_difference(cr, other, n_boot, b)
                if cr is not None and other is not None
                else (float("nan"),) * 3
            )
            rows.append(
                {"rule": rule, "bin": b, "pi_old": f"[{lo_edge:g}, {hi_edge:g}{']' if hi_edge >= 1 else ')'}",
                 "paired": est, "paired_lo": lo, "paired_hi": hi, "paired_sign": _sign(lo, hi),
                 "across_runs": a_est, "across_lo": a_lo, "across_hi": a_hi, "across_sign": _sign(a_lo, a_hi)}
            )  # fmt: skip
    return pl.DataFrame(rows).with_columns(
        [pl.when(pl.col(c).is_nan()).then(None).otherwise(pl.col(c)).alias(c)
         for c in ("paired", "paired_lo", "paired_hi", "across_runs", "across_lo", "across_hi")]
    )  # fmt: skip


def reproduces_table(
    evals: pl.DataFrame | None, units: dict[str, dict[str, Unit | None]], n_boot: int = N_BOOT
) -> pl.DataFrame:
    """One row per claim of CLAIMS: the paper's value, ours with its 95 % interval, and the verdict (VERDICT_RULE).
    Record statistics of Fig. 1 and 2 come from the GRPO runs; method comparisons pair each method with GRPO."""
    nan3 = (float("nan"),) * 3
    grpo = units.get("grpo", {})
    ours: list[tuple[float, float, float]] = []

    def unit_stat(
        u: Unit | None, stat: Callable[[dict[str, np.ndarray]], float]
    ) -> tuple[float, float, float]:
        return _unit_stat(u, stat, n_boot)

    sh, cr = grpo.get("shares"), grpo.get("correct")

    def shape_top(v):
        s = token_share_stat(v)
        return s[-1] - np.max(s[:-1])

    def shape_u(v):
        s = token_share_stat(v)
        return s[0] - np.max(s[1:-1]) if len(s) > 2 else np.nan

    def norm_order(v):
        n = mean_stat("norm_ratio")(v)
        return float(np.min(n[:-1] - n[1:]))

    ours.append(unit_stat(sh, shape_top))
    ours.append(unit_stat(sh, shape_u))
    ours.append(unit_stat(sh, norm_order))
    iso = grpo.get("isolation")
    ours.append(
        unit_stat(
            iso, lambda v: float(np.nanmean(v["low_to_top"][:, 0]) - np.nanmean(v["high_to_top"][:, 0]))
        )
    )
    bd = grpo.get("bound")
    ours.append(unit_stat(bd, lambda v: float(np.nanmean(v["spearman"][:, 0]))))
    ours.append(unit_stat(cr, lambda v: float(correct_stat(v)[0] - correct_stat(v)[-1])))
    ours.append(unit_stat(cr, lambda v: float(0.5 - correct_stat(v)[-1])))
    for m in ("reweight", "lopti"):
        other = units.get(m, {}).get("correct")
        ours.append(
            _top_correct_difference(cr, other, n_boot) if cr is not None and other is not None else nan3
        )
    pr = grpo.get("paired")
    for m in ("reweight", "lopti"):
        ours.append(unit_stat(pr, _paired_correct(m, -1)))
    for m in ("reweight", "lopti"):
        has = evals is not None and evals.height and {m, "grpo"} <= set(evals["method"].unique().to_list())
        ours.append(paired_difference(evals, m, "grpo", "greedy", n_boot) if has else nan3)
    rows = []
    for claim, (est, lo, hi) in zip(CLAIMS, ours, strict=True):
        rows.append(
            {
                "phenomenon": claim.phenomenon,
                "statistic (> 0 if the claim holds)": claim.statistic,
                "paper": None if not np.isfinite(claim.paper) else round(claim.paper, 4),
                "paper_note": claim.paper_note,
                "ours": None if not np.isfinite(est) else est,
                "lo": None if not np.isfinite(lo) else lo,
                "hi": None if not np.isfinite(hi) else hi,
                "verdict": verdict(lo, hi, claim.paper),
            }
        )
    return pl.DataFrame(rows)


def markdown(df: pl.DataFrame, digits: int = 3) -> str:
    """A GitHub markdown table of df (floats rounded)."""

    def fmt(v) -> str:
        if v is None:
            return "–"
        if isinstance(v, float):
            if v != v:
                return "nan"
            return f"{v:.{digits}g}" if 0 < abs(v) < 10**-digits else f"{v:.{digits}f}"
        return str(v)

    def cell(v) -> str:
        return fmt(v).replace("|", "\\|")  # a pipe inside a cell (||g_b||) would split the column

    head = "| " + " | ".join(cell(c) for c in df.columns) + " |"
    sep = "|" + "|".join("---" for _ in df.columns) + "|"
    body = ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.iter_rows()]
    return "\n".join([head, sep, *body])
