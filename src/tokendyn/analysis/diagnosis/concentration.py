"""Concentration: the share of tokens in the top π_old bin ([.75, 1] by default) and the policy's entropy, over
training.

    top share = Σ_{k in last half} n_top,k / Σ_{k in last half} n_k    (binstats at the final hidden state: every
                                                                      probed token; the probed steps' later half)
    entropy ratio = mean H over the last quarter of logged steps / mean H over the first quarter   (metrics.parquet)

Intervals: the steps of the window resampled with replacement (for the ratio, each quarter on its own).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from tokendyn.analysis.diagnosis.context import RunContext, steps_interval
from tokendyn.analysis.diagnosis.finding import Finding, measured, not_measured
from tokendyn.analysis.diagnosis.thresholds import try_flag
from tokendyn.analysis.paired import percentile_interval
from tokendyn.vocab import FINAL_NORM

FAMILY = "concentration"
ENTROPY_COLUMNS = ("entropy", "actor/entropy")  # TRL's, verl's


def top_share_findings(ctx: RunContext) -> list[Finding]:
    name, title = "concentration.top_bin", "Concentration: share of tokens in the top bin"
    if not ctx.has("binstats"):
        return [not_measured(FAMILY, name, title, "no `binstats` records", threshold="top_bin_tokens")]
    bs = ctx.frame("binstats").filter(
        (pl.col("point") == FINAL_NORM) & (pl.col("quantity") == "norm") & (pl.col("bin") >= 0)
    )
    if not bs.height:
        return [not_measured(FAMILY, name, title, "no `binstats` rows at final_norm.out (not probed)",
                             threshold="top_bin_tokens")]  # fmt: skip
    top = bs["bin"].max()
    # each token once: a Lopti run records its tokens in both stages; keep each step's first stage
    first = bs.group_by("step").agg(pl.col("stage").min().alias("_s"))
    bs = bs.join(first, on="step").filter(pl.col("stage") == pl.col("_s"))
    per = (
        bs.group_by("step")
        .agg(pl.col("count").sum().alias("n"), pl.col("count").filter(pl.col("bin") == top).sum().alias("t"))
        .sort("step")
    )
    edges = bs.filter(pl.col("bin") == top).row(0, named=True)
    n, t = per["n"].to_numpy().astype(np.float64), per["t"].to_numpy().astype(np.float64)
    late = np.arange(len(n)) >= len(n) // 2
    nl, tl = n[late], t[late]
    est, lo, hi = steps_interval(
        nl, lambda i: float(tl[i].sum() / nl[i].sum()) if nl[i].sum() else float("nan")
    )
    over = [
        {"step": int(s), "top_share": float(b / a) if a else None}
        for s, a, b in zip(per["step"], n, t, strict=True)
    ]
    return [
        measured(
            FAMILY,
            name,
            f"Concentration: share of tokens in [{edges['bin_lo']:g}, {edges['bin_hi']:g}] (later half of training)",
            "top_bin_tokens",
            est,
            lo,
            hi,
            try_flag=try_flag("entropy", ctx.stack),
            details={
                "steps": int(late.sum()),
                "first_step_share": over[0]["top_share"],
                "over_training": over,
            },
        )
    ]


def entropy_ratio(first: np.ndarray, last: np.ndarray) -> float:
    """mean(last) / mean(first); NaN when the first quarter's mean is not positive."""
    m = float(np.mean(first)) if len(first) else float("nan")
    return float(np.mean(last)) / m if m > 0 else float("nan")


def entropy_findings(ctx: RunContext, n_boot: int = 1000, seed: int = 0) -> list[Finding]:
    name, title = "concentration.entropy", "Concentration: the policy's entropy, last quarter over first"
    if not ctx.has("metrics"):
        return [not_measured(FAMILY, name, title, "no metrics.parquet (the training log: TRL and the demo write it)",
                             threshold="entropy_ratio")]  # fmt: skip
    m = ctx.frame("metrics")
    col = next((c for c in ENTROPY_COLUMNS if c in m.columns), None)
    if col is None:
        return [
            not_measured(
                FAMILY, name, title, "the training log has no entropy column", threshold="entropy_ratio"
            )
        ]
    h = (
        m.filter(pl.col(col).is_not_null())
        .unique("step", keep="first")
        .sort("step")[col]
        .to_numpy()
        .astype(np.float64)
    )
    if len(h) < 4:
        return [not_measured(FAMILY, name, title, f"{len(h)} logged entropies: fewer than 4 (a quarter each way)",
                             threshold="entropy_ratio")]  # fmt: skip
    q = len(h) // 4
    first, last = h[:q], h[-q:]
    rng = np.random.default_rng(seed)
    draws = np.array(
        [entropy_ratio(first[rng.integers(0, q, q)], last[rng.integers(0, q, q)]) for _ in range(n_boot)]
    )
    lo, hi = percentile_interval(draws)
    return [
        measured(
            FAMILY,
            name,
            title,
            "entropy_ratio",
            entropy_ratio(first, last),
            lo,
            hi,
            try_flag=try_flag("entropy", ctx.stack),
            details={
                "first_quarter": float(first.mean()),
                "last_quarter": float(last.mean()),
                "logged_steps": len(h),
            },
        )
    ]


def concentration_findings(ctx: RunContext) -> list[Finding]:
    return [*top_share_findings(ctx), *entropy_findings(ctx)]
