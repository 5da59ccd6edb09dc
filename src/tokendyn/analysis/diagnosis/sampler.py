"""The sampler: its mismatch per π_old bin against the run's own noise floor, the (1 − π) slope, the share of tokens
the correction's mask zeroed (and, with the paired rule ``no_correction``, the update it removed), and truncated
sampling. The statistics are `tokendyn.analysis.mismatch_seeds`' (mean |log ρ| per bin and the slope, intervals
over the probed steps: one seed), `tokendyn.analysis.mismatch`'s (the floor's table) and
`tokendyn.analysis.masked`'s (the removed share); this module only judges them.

    masked share = Σ_k #{t : weight_t = 0} / Σ_k #tokens       (k: probed steps; interval: the steps resampled)
"""

from __future__ import annotations

import numpy as np
import polars as pl

from tokendyn.analysis.diagnosis.context import RunContext, steps_interval
from tokendyn.analysis.diagnosis.finding import Finding, finite, measured, not_measured
from tokendyn.analysis.diagnosis.thresholds import FLOOR_FACTOR, THRESHOLDS, try_flag
from tokendyn.analysis.masked import masked_share_table
from tokendyn.analysis.mismatch import mismatch_table
from tokendyn.analysis.mismatch_seeds import mismatch_over_seeds, slope_over_seeds

FAMILY = "sampler"
NO_SAMPLER = (
    "no `sampler` records: the rollouts carried no sampler log-probs (TRL: --use_vllm true; verl: "
    "actor_rollout_ref.rollout.calculate_log_probs=True; tokendyn probe: a sampler_logp column)"
)
# TRL's sampling filters and their off values (GRPOConfig)
FILTERS = {"top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0}


def _label(lo: float, hi: float) -> str:
    return f"[{lo:g}, {hi:g}{']' if hi >= 1.0 else ')'}"


def _floor(ctx: RunContext) -> dict[int, float]:
    """The run's own floor per bin (mean |log ρ| of the trainer against itself), when it recorded one."""
    if not ctx.has("floor"):
        return {}
    table = mismatch_table(ctx.frame("floor"))
    if not table.height:
        return {}
    table = table.filter(pl.col("side") == "pi_old")
    return dict(zip(table["bin"].to_list(), table["abs_mean"].to_list(), strict=True))


def mismatch_findings(ctx: RunContext) -> list[Finding]:
    """One finding per π_old bin (mean |log ρ| against the floor) and the slope on 1 − π_old."""
    df = ctx.sampler
    if df.height == 0:
        return [not_measured(FAMILY, "sampler.mismatch", "Sampler mismatch per bin", NO_SAMPLER,
                             threshold="mismatch")]  # fmt: skip
    table = mismatch_over_seeds({0: df})
    floor = _floor(ctx)
    base = THRESHOLDS["mismatch"].watch
    dtype = (
        (ctx.run.meta.get("sampler") or {}).get("dtype")
        if isinstance(ctx.run.meta.get("sampler"), dict)
        else None
    )
    out = []
    for row in table.filter(pl.col("bin") >= 0).iter_rows(named=True):
        label = _label(row["bin_lo"], row["bin_hi"])
        fl = floor.get(row["bin"])
        watch = max(base, FLOOR_FACTOR * fl) if finite(fl) else None
        ref = {"floor": fl, "floor_source": "the run's `floor` records" if fl is not None else
               "not recorded (TRL: --probe_floor true); the float32 engine's level stands in"}  # fmt: skip
        if finite(fl) and fl > 0 and finite(row["abs_mean"]):
            ref["times_floor"] = row["abs_mean"] / fl
        out.append(
            measured(
                FAMILY,
                f"sampler.mismatch.bin{row['bin']}",
                f"Sampler mismatch in {label}: mean |log rho| against the floor",
                "mismatch",
                row["abs_mean"],
                row["abs_mean_lo"],
                row["abs_mean_hi"],
                try_flag=try_flag("sampler_dtype", ctx.stack),
                watch=watch,
                details={
                    "tokens": row["count"],
                    "steps": row["steps"],
                    "mean_log_rho": row["mean_log_rho"],
                    "abs_p99": row["abs_p99"],
                    "envelope": row["envelope"],
                    "sampler_dtype": dtype,
                },
                **ref,
            )
        )
    slope, lo, hi = slope_over_seeds({0: df})
    out.append(
        measured(
            FAMILY,
            "sampler.slope",
            "Sampler mismatch per unit of (1 - pi_old): the least-squares slope",
            "slope",
            slope,
            lo,
            hi,
            try_flag=try_flag("sampler_dtype", ctx.stack),
            details={"tokens": int(df.height)},
        )
    )
    return out


def masked_findings(ctx: RunContext) -> list[Finding]:
    """The share of tokens the correction zeroed (interval over probed steps) and, with the paired rule
    ``no_correction``, the share of the update it removed (`tokendyn.analysis.masked`)."""
    df = ctx.sampler
    if df.height == 0:
        return [not_measured(FAMILY, "sampler.masked", "Correction's mask: tokens zeroed", NO_SAMPLER,
                             threshold="masked")]  # fmt: skip
    per = (
        df.group_by("step")
        .agg(
            pl.len().alias("n"),
            (pl.col("is_weight") == 0.0).sum().alias("m"),
            pl.col("seq_masked").sum().alias("s"),
        )
        .sort("step")
    )
    n, m = per["n"].to_numpy().astype(np.float64), per["m"].to_numpy().astype(np.float64)
    est, lo, hi = steps_interval(n, lambda i: float(m[i].sum() / n[i].sum()))
    corrected = ctx.config.get("vllm_importance_sampling_correction")
    out = [
        measured(
            FAMILY,
            "sampler.masked",
            "Correction's mask: share of tokens whose importance weight is 0",
            "masked",
            est,
            lo,
            hi,
            try_flag=try_flag("correction", ctx.stack),
            details={
                "tokens": int(n.sum()),
                "masked": int(m.sum()),
                "in_masked_sequences": int(per["s"].sum()),
                "correction": corrected,
                "mode": ctx.config.get("vllm_importance_sampling_mode"),
            },
        )
    ]
    table = masked_share_table(ctx.paired) if ctx.paired.height else pl.DataFrame()
    if table.height:
        row = table.filter((pl.col("bin") == -1) & (pl.col("mode") == table["mode"].min())).row(0, named=True)
        per_bin = table.filter((pl.col("bin") >= 0) & (pl.col("mode") == row["mode"]))
        out.append(
            measured(
                FAMILY,
                "sampler.masked_update",
                "Correction's mask: share of the uncorrected update it removes (paired rule no_correction)",
                "masked_update",
                row["removed"],
                row["removed_lo"],
                row["removed_hi"],
                try_flag=try_flag("correction", ctx.stack),
                details={
                    "mode": row["mode"],
                    "masked_units": row["masked_units"],
                    "units": row["units"],
                    "per_bin": dict(zip(per_bin["bin"].to_list(), per_bin["removed"].to_list(), strict=True)),
                },
            )
        )
    else:
        out.append(
            not_measured(
                FAMILY,
                "sampler.masked_update",
                "Correction's mask: share of the uncorrected update it removes",
                "no `paired` records with the rule no_correction (TRL: --probe_compare_rules no_correction ...)",
                threshold="masked_update",
            )
        )
    return out


def truncation_findings(ctx: RunContext) -> list[Finding]:
    """Sampling filters on (from the run's config): each one renormalises the engine's log-prob."""
    name, title = "sampler.truncation", "Truncated sampling: top-p / top-k / min-p / repetition penalty"
    cfg = ctx.config
    known = {k: cfg[k] for k in FILTERS if k in cfg}
    if not known:
        return [not_measured(FAMILY, name, title, "the run's config names none of top_p, top_k, min_p, "
                             "repetition_penalty (verl and offline runs do not record them)", threshold="truncation")]  # fmt: skip
    on = {
        k: v for k, v in known.items() if v not in (FILTERS[k], None) and not (k == "top_k" and v in (-1, 0))
    }
    return [
        measured(
            FAMILY,
            name,
            title,
            "truncation",
            float(len(on)),
            try_flag=try_flag("truncation", ctx.stack),
            details={"filters": known, "on": on},
        )
    ]


def sampler_findings(ctx: RunContext) -> list[Finding]:
    return [*mismatch_findings(ctx), *masked_findings(ctx), *truncation_findings(ctx)]
