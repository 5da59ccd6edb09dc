"""The record statistics of the study (`tokendyn.analysis.study`): per-bin token shares, update shares, gradient
norms and correct ratios, read as units (the probed steps of each seed's run) with their two-level bootstrap
intervals."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from tokendyn.analysis.bootstrap import N_BOOT, bootstrap_units
from tokendyn.vocab import ALL_PARAMETERS, FULL_UPDATES, TRAIN


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
