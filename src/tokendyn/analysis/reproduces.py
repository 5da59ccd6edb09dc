"""What reproduces (`tokendyn.analysis.study`): the paper's claims, each a statistic > 0 when the claim holds, and
the verdict of its bootstrap interval (`VERDICT_RULE`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import polars as pl

from tokendyn.analysis.accuracy import paired_difference
from tokendyn.analysis.bootstrap import N_BOOT, bootstrap_units
from tokendyn.analysis.study_units import PAIRED_RULES, Unit, correct_stat, mean_stat, token_share_stat

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
    paper: float  # the paper's value of that statistic (docs/paper.md)
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
