"""Token dominance: the lowest π_old bin's share of the update against its share of the tokens, per stage, over the
probed steps.

From the `shares` records (group ``all``; the analysis sample), with steps k = 1..K and b = 0 the lowest bin:

    D = mean_k s_0,k / (Σ_k n_0,k / Σ_k n_k)      s_0,k = <g_0, g> / ||g||^2 (the projection share), n tokens

(1 = the bin carries its fair share of the update). Without `shares` records, from `binstats` at the final hidden
state (every probed token): the energy share e_0,k = Σ_t∈0 ||δ_t||² / Σ_t ||δ_t||² in place of s_0,k, marked as such.
Interval: the probed steps resampled with replacement (`context.steps_interval`).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from tokendyn.analysis.diagnosis.context import RunContext, steps_interval
from tokendyn.analysis.diagnosis.finding import Finding, measured, not_measured
from tokendyn.analysis.diagnosis.thresholds import try_flag
from tokendyn.vocab import ALL_PARAMETERS, FINAL_NORM, TRAIN

FAMILY = "dominance"


def dominance_ratio(share: np.ndarray, count: np.ndarray, total: np.ndarray) -> float:
    """D = mean_k share_k / (Σ_k count_k / Σ_k total_k); NaN when the bin has no token."""
    tokens = count.sum() / total.sum() if total.sum() > 0 else 0.0
    return float(np.mean(share) / tokens) if tokens > 0 else float("nan")


def _per_step(ctx: RunContext) -> tuple[pl.DataFrame, str]:
    """Per (stage, step): the lowest bin's update share, its tokens and every token; and what the share is."""
    if ctx.has("shares"):
        df = ctx.frame("shares").filter(pl.col("group") == ALL_PARAMETERS)
        low = df.filter(pl.col("bin") == df.filter(pl.col("bin") >= 0)["bin"].min())
        every = df.filter(pl.col("bin") == -1).select("stage", "step", pl.col("count").alias("total"))
        out = low.select("stage", "step", "bin_lo", "bin_hi", "share", "count").join(
            every, on=["stage", "step"]
        )
        return out.filter(pl.col("share").is_not_null()), "projection share <g_0, g> / ||g||^2 (`shares`)"
    if ctx.has("binstats"):
        bs = ctx.frame("binstats").filter(
            (pl.col("point") == FINAL_NORM) & (pl.col("quantity") == "norm") & (pl.col("bin") >= 0)
        )
        if bs.height:
            per = bs.group_by("stage", "step", "bin", "bin_lo", "bin_hi").agg(
                pl.col("count").sum(), pl.col("sumsq").sum()
            )
            tot = per.group_by("stage", "step").agg(
                pl.col("count").sum().alias("total"), pl.col("sumsq").sum().alias("e")
            )
            low = per.filter(pl.col("bin") == per["bin"].min()).join(tot, on=["stage", "step"])
            low = low.with_columns((pl.col("sumsq") / pl.col("e")).alias("share"))
            return (
                low.select("stage", "step", "bin_lo", "bin_hi", "share", "count", "total"),
                "energy share Σ||δ_t||² at the final hidden state (`binstats`; no `shares` records)",
            )
    return pl.DataFrame(), ""


def dominance_findings(ctx: RunContext) -> list[Finding]:
    """One finding per stage (``train`` first) from the module docstring's D."""
    frame, what = _per_step(ctx)
    if frame.height == 0:
        return [
            not_measured(
                FAMILY,
                "dominance",
                "Token dominance: the lowest bin's share of the update",
                "no `shares` records (the analyses were off) and no `binstats` at final_norm.out",
                try_flag=try_flag("measure_remedies", ctx.stack),
                threshold="dominance",
            )
        ]
    stages = sorted(frame["stage"].unique().to_list(), key=lambda s: (s != TRAIN, s))
    out = []
    for stage in stages:
        part = frame.filter(pl.col("stage") == stage).sort("step")
        lo_edge, hi_edge = part["bin_lo"][0], part["bin_hi"][0]
        label = f"[{lo_edge:g}, {hi_edge:g})"
        title = f"Token dominance ({stage}): {label}'s update share over its token share"
        share = part["share"].to_numpy().astype(np.float64)
        count = part["count"].to_numpy().astype(np.float64)
        total = part["total"].to_numpy().astype(np.float64)
        if count.sum() == 0:
            out.append(
                not_measured(FAMILY, f"dominance.{stage}", title, f"no token of {label} in stage {stage}")
            )
            continue
        est, lo, hi = steps_interval(
            share, lambda i, s=share, c=count, t=total: dominance_ratio(s[i], c[i], t[i])
        )
        over = [
            {
                "step": int(s),
                "token_share": float(c / t) if t else None,
                "update_share": float(v),
                "ratio": float(v / (c / t)) if c and t else None,
            }
            for s, v, c, t in zip(part["step"].to_list(), share, count, total, strict=True)
        ]
        out.append(
            measured(
                FAMILY,
                f"dominance.{stage}",
                title,
                "dominance",
                est,
                lo,
                hi,
                try_flag=try_flag("dominance", ctx.stack),
                details={
                    "bin": label,
                    "share_kind": what,
                    "update_share": float(share.mean()),
                    "token_share": float(count.sum() / total.sum()),
                    "steps": len(share),
                    "over_training": over,
                },
            )
        )
    return out
