"""The remedies: what Reweight and Lopti would do from this run's own states, from the paired comparison (`paired`
records, `--probe_compare_rules`). Per rule r, with units u = (probed step, analysed sequence), S the probed steps and
s_t the token's share of its rule's own update:

    Δ_r = Σ_u (Σ_{t in u, bin 0} s_t(r) − Σ_{t in u, bin 0} s_t(base)) / S

the change of the lowest bin's share of the update (< 0: the rule lowers the low tokens' dominance), with the units
resampled with replacement (seeded; the two rules drawn together). Verdict: fine when the interval holds 0 (from these
states the rule changes nothing resolvable); watch when it resolvably lowers the share; act when it does and the
run's dominance says act. The top bin's correct ratio change (`tokendyn.analysis.paired.paired_summary`) is beside it.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from tokendyn.analysis.diagnosis.context import RunContext
from tokendyn.analysis.diagnosis.finding import ACT, FINE, WATCH, Finding, finite, measured, not_measured
from tokendyn.analysis.diagnosis.thresholds import try_flag
from tokendyn.analysis.paired import paired_summary, percentile_interval

FAMILY = "remedies"
RULES = {"reweight": "remedy_reweight", "lopti": "remedy_lopti"}
MODES = ("equal_norm", "optimizer")


def share_change(paired: pl.DataFrame, rule: str, mode: str, b: int, n_boot: int = 1000, seed: int = 0):
    """(Δ_r, lo, hi, units) of the module docstring for bin ``b`` (None when the rule or the base has no row)."""
    sel = paired.filter((pl.col("mode") == mode) & pl.col("rule").is_in([rule, "base"]))
    if "diverged" in sel.columns:
        sel = sel.filter(~pl.col("diverged").fill_null(False))
    if set(sel["rule"].unique().to_list()) != {rule, "base"}:
        return None
    units = sel.select("step", "seq").unique().sort("step", "seq")
    per = (
        sel.filter(pl.col("bin") == b)
        .group_by("rule", "step", "seq")
        .agg(pl.col("sum_share").fill_null(0.0).sum())
    )

    def col(r: str) -> np.ndarray:
        part = per.filter(pl.col("rule") == r).drop("rule")
        return units.join(part, on=["step", "seq"], how="left").fill_null(0.0)["sum_share"].to_numpy()

    d = col(rule) - col("base")
    steps, n = units["step"].n_unique(), units.height
    w = np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(np.float64)
    lo, hi = percentile_interval(w @ d / steps)
    return float(d.sum() / steps), lo, hi, n


def remedy_findings(ctx: RunContext, dominance_verdict: str | None) -> list[Finding]:
    title = "Remedies from this run's states: {rule}'s change of the lowest bin's update share"
    paired = ctx.paired
    if paired.height == 0:
        return [
            not_measured(
                FAMILY,
                "remedies",
                title.format(rule="Reweight / Lopti"),
                "no `paired` records (the paired comparison did not run)",
                try_flag=try_flag("measure_remedies", ctx.stack),
                threshold="remedy",
            )  # fmt: skip
        ]
    if "sweep" in paired.columns:
        paired = paired.filter(pl.col("sweep").is_null())
    mode = next((m for m in MODES if m in set(paired["mode"].to_list())), None)
    low = int(paired.filter(pl.col("bin") >= 0)["bin"].min())
    top = int(paired["bin"].max())
    summary = paired_summary(paired)
    out = []
    for rule, key in RULES.items():
        name = f"remedies.{rule}"
        got = share_change(paired, rule, mode, low) if mode else None
        if got is None:
            out.append(not_measured(FAMILY, name, title.format(rule=rule), f"the paired comparison has no rule {rule}",
                                    try_flag=try_flag("measure_remedies", ctx.stack), threshold="remedy"))  # fmt: skip
            continue
        est, lo, hi, units = got
        top_row = summary.filter((pl.col("rule") == rule) & (pl.col("mode") == mode) & (pl.col("bin") == top))
        f = measured(
            FAMILY,
            name,
            title.format(rule=rule),
            "remedy",
            est,
            lo,
            hi,
            details={
                "mode": mode,
                "units": units,
                "top_bin_correct_diff": top_row["correct_diff"][0] if top_row.height else None,
                "top_bin_correct_diff_interval": [
                    top_row["correct_diff_lo"][0],
                    top_row["correct_diff_hi"][0],
                ]
                if top_row.height
                else None,
                "dominance_verdict": dominance_verdict,
                "run_uses_it": _uses(ctx.config, rule),
            },
        )
        lowers = finite(hi) and hi < 0
        f.verdict = (
            (ACT if dominance_verdict == ACT else WATCH) if lowers and not _uses(ctx.config, rule) else FINE
        )
        f.try_flag = try_flag(key, ctx.stack) if f.verdict != FINE else None
        if lowers and _uses(ctx.config, rule):
            f.reason = "the run already uses this rule"
        out.append(f)
    return out


def _uses(config: dict, rule: str) -> bool:
    if rule == "reweight":
        return bool(config.get("advantage_reweight_alpha") or config.get("reweight_alpha"))
    return config.get("lopti_eta") is not None or config.get("lopti_quantile") is not None
