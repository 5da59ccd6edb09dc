"""The bound: its violations and how close the envelope comes, from the `checks` records (`checks_summary`: every
stage and micro-batch pooled) and the `bound` records (the inner layers' empirical envelope).

    violations = Σ identity_violations + logits_violations + head_violations       (must be 0)
    logits closeness = max ||dl/dz|| / (|w| (1 - pi)) / sqrt(2)                     (<= 1)
    head closeness   = max ||δ|| / (|w| (1 - pi)) / (sqrt(2) sigma_max(W) / T)      (<= 1)

Maxima over every checked token: no interval (an extreme is not resampled).
"""

from __future__ import annotations

import polars as pl

from tokendyn.analysis.diagnosis.context import RunContext
from tokendyn.analysis.diagnosis.finding import Finding, measured, not_measured
from tokendyn.analysis.tables import bound_report, checks_summary, checks_violations

FAMILY = "bound"
HOW = (
    "the probe at the LM head: final_norm.out among the probed points (the default), --probe_check_tokens > 0"
)


def _num(df: pl.DataFrame, col: str, how: str):
    if col not in df.columns:
        return None
    s = df[col].drop_nulls()
    if not s.len():
        return None
    return float(s.max() if how == "max" else s.min())


def bound_findings(ctx: RunContext) -> list[Finding]:
    """Violations (act on any), the logits' and the head's closeness (informational), the inner layers' envelope."""
    if not ctx.has("checks"):
        return [
            not_measured(
                FAMILY,
                "bound.violations",
                "The (1 - pi) bound: violations",
                f"no `checks` records ({HOW})",
                threshold="bound_violations",
            )  # fmt: skip
        ]
    summary = checks_summary(ctx.run["checks"])
    checked = int(summary["n_checked"].fill_null(0).sum()) + int(summary["head_n"].fill_null(0).sum())
    if checked == 0:
        return [
            not_measured(
                FAMILY,
                "bound.violations",
                "The (1 - pi) bound: violations",
                "the `checks` records hold no checked token (every micro-batch skipped by the budget)",
                threshold="bound_violations",
            )  # fmt: skip
        ]
    per = {
        c: int(summary[c].fill_null(0).sum())
        for c in ("identity_violations", "logits_violations", "head_violations")
    }
    out = [
        measured(
            FAMILY,
            "bound.violations",
            "The (1 - pi) bound: tokens outside it (LM-head identity, logits, head)",
            "bound_violations",
            float(checks_violations(summary)),
            details={
                **per,
                "tokens_checked": int(summary["n_checked"].fill_null(0).sum()),
                "head_tokens": int(summary["head_n"].fill_null(0).sum()),
            },
        )
    ]
    lr_max, lr_min = _num(summary, "logits_ratio_max", "max"), _num(summary, "logits_ratio_min", "min")
    hi, lo = _num(summary, "logits_hi", "max"), _num(summary, "logits_lo", "min")
    if lr_max is not None and hi:
        out.append(
            measured(
                FAMILY,
                "bound.logits",
                "The bound at the logits: how close the largest ratio comes to sqrt(2)",
                "envelope",
                lr_max / hi,
                details={"ratio_min": lr_min, "ratio_max": lr_max, "lower_bound": lo, "upper_bound": hi},
            )
        )
    head_max, head_bound = _num(summary, "head_ratio_max", "max"), _num(summary, "head_bound", "min")
    if head_max is not None and head_bound:
        out.append(
            measured(
                FAMILY,
                "bound.head",
                "The bound at the LM head's input: largest ratio over sqrt(2) sigma_max(W) / T",
                "envelope",
                head_max / head_bound,
                details={"ratio_max": head_max, "bound": head_bound},
            )
        )
    if ctx.has("bound"):
        rep = bound_report(ctx.run["bound"], ctx.run["binstats"], ctx.run["tokens"])
        if rep.height:
            out.append(
                measured(
                    FAMILY,
                    "bound.inner",
                    "Inner layers: rank correlation of ||δ_l|| / |w| with 1 - pi (lowest over the probed points)",
                    "envelope",
                    _num(rep, "spearman_mean", "min"),
                    details={
                        "C_min": _num(rep, "C", "min"),
                        "D_max": _num(rep, "D", "max"),
                        "spearman_min": _num(rep, "spearman_min", "min"),
                        "points": rep.height,
                        "value_is": "the lowest token-weighted mean Spearman correlation of any probed point (1: the "
                        "(1 - pi) law orders the tokens exactly)",
                    },
                )
            )
    return out
