"""The share of each rule's update carried by the tokens the sampler mismatched: from the token view's tokens
(`token_view`: log rho per token, TRL + vLLM) and the paired comparison at those tokens (`token_view_rules`: each
token's share of each rule's update from the same state).

A token is *mismatched* when |log rho| > tau, the sampler's ratio outside [1/e^tau, e^tau] (default tau = log 1.1: the
[0.9, 1.1] band trl#6789 counts). Per rule and mode, with S the probed steps and s_t the token's share of the rule's
update:

    mismatched_share = Σ_{mismatched tokens} s_t / S       (the update they carry)
    token_fraction   = mismatched tokens / tokens           (how many they are)

over the view's tokens (the shares of a step sum to 1 over the analysed sample; the view is its first sequences).
Intervals: the (step, seq) units resampled with replacement (seeded), 2.5 % and 97.5 % quantiles, the rules resampled
together, as `tokendyn.analysis.paired.paired_summary`; ``minus_base`` is the rule's share minus the base rule's on the
same resample.
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from tokendyn.analysis.paired import percentile_interval

TAU = math.log(1.1)


def mismatched_share_table(
    view: pl.LazyFrame | pl.DataFrame,
    view_rules: pl.LazyFrame | pl.DataFrame,
    *,
    tau: float = TAU,
    n_boot: int = 1000,
    seed: int = 0,
) -> pl.DataFrame:
    """One row per (rule, mode): steps, units, tokens, mismatched tokens, token_fraction, mismatched_share and
    minus_base with _lo / _hi bounds (module docstring). Empty where the view has no log rho."""
    view = view.collect() if isinstance(view, pl.LazyFrame) else view
    rules = view_rules.collect() if isinstance(view_rules, pl.LazyFrame) else view_rules
    if "log_rho" not in view.columns or view.height == 0 or rules.height == 0:
        return pl.DataFrame()
    tokens = view.filter(pl.col("log_rho").is_not_null()).select(
        "step", "seq", "pos", (pl.col("log_rho").abs() > tau).alias("mismatched")
    )
    if tokens.height == 0:
        return pl.DataFrame()
    joined = rules.join(tokens, on=["step", "seq", "pos"], how="inner")
    units = tokens.select("step", "seq").unique().sort("step", "seq")
    steps, n = units["step"].n_unique(), units.height
    rng = np.random.default_rng(seed)
    w = rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(np.float64)
    per_unit = tokens.group_by("step", "seq").agg(pl.len().alias("n"), pl.col("mismatched").sum().alias("m"))
    counts = units.join(per_unit, on=["step", "seq"], how="left").fill_null(0)
    n_tok, n_mis = counts["n"].to_numpy().astype(np.float64), counts["m"].to_numpy().astype(np.float64)

    def carried(rule: str, mode: str) -> np.ndarray:
        part = (
            joined.filter(pl.col("rule") == rule, pl.col("mode") == mode, pl.col("mismatched"))
            .group_by("step", "seq")
            .agg(pl.col("share").fill_null(0.0).sum())
        )
        return units.join(part, on=["step", "seq"], how="left").fill_null(0.0)["share"].to_numpy()

    rows = []
    for (rule, mode), _ in joined.group_by("rule", "mode", maintain_order=True):
        share = carried(rule, mode)
        base = carried("base", mode)
        row = {
            "rule": rule,
            "mode": mode,
            "steps": steps,
            "units": n,
            "tokens": int(n_tok.sum()),
            "mismatched": int(n_mis.sum()),
            "token_fraction": float(n_mis.sum() / n_tok.sum()),
            "mismatched_share": float(share.sum() / steps),
            "minus_base": float((share - base).sum() / steps),
        }
        row["token_fraction_lo"], row["token_fraction_hi"] = percentile_interval((w @ n_mis) / (w @ n_tok))
        row["mismatched_share_lo"], row["mismatched_share_hi"] = percentile_interval(w @ share / steps)
        row["minus_base_lo"], row["minus_base_hi"] = percentile_interval(w @ (share - base) / steps)
        rows.append(row)
    return pl.DataFrame(rows).sort("mode", "rule")
