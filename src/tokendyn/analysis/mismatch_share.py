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

A token is matched to its rules' rows by (step, stage, seq, pos) and a unit is (step, stage, seq). A unit with no rows
under a rule is unknown there, not 0: the rule's ``mismatched_share`` is null when some unit lacks it
(``units_without_rule``), and ``minus_base`` null when some unit lacks the rule or the base rule
(``units_without_base``). Records written before `token_view_rules` carried its stage take the view's stage at the
step (one stage a step; more is a one-line `UsageError`).
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from tokendyn.analysis.paired import percentile_interval
from tokendyn.common import UsageError

TAU = math.log(1.1)
UNIT = ["step", "stage", "seq"]


def rules_with_stage(view: pl.DataFrame, rules: pl.DataFrame) -> pl.DataFrame:
    """``rules`` with the stage of each row: its own, else (records written without it) the view's stage at the
    step, which must then be one stage a step."""
    if "stage" in rules.columns and rules["stage"].null_count() == 0:
        return rules
    stages = view.select("step", "stage").unique()
    if stages["step"].n_unique() != stages.height:
        raise UsageError(
            "token_view_rules: no stage column and the view holds several stages at a step; "
            "re-record the run with this version"
        )
    return rules.drop("stage", strict=False).join(stages, on="step", how="left")


def mismatched_share_table(
    view: pl.LazyFrame | pl.DataFrame,
    view_rules: pl.LazyFrame | pl.DataFrame,
    *,
    tau: float = TAU,
    n_boot: int = 1000,
    seed: int = 0,
) -> pl.DataFrame:
    """One row per (rule, mode): steps, units, tokens, mismatched tokens, token_fraction, mismatched_share and
    minus_base with _lo / _hi bounds, units_without_rule and units_without_base (module docstring). Empty where the
    view has no log rho."""
    view = view.collect() if isinstance(view, pl.LazyFrame) else view
    rules = view_rules.collect() if isinstance(view_rules, pl.LazyFrame) else view_rules
    if "log_rho" not in view.columns or view.height == 0 or rules.height == 0:
        return pl.DataFrame()
    tokens = view.filter(pl.col("log_rho").is_not_null()).select(
        *UNIT, "pos", (pl.col("log_rho").abs() > tau).alias("mismatched")
    )
    if tokens.height == 0:
        return pl.DataFrame()
    rules = rules_with_stage(view, rules)
    joined = rules.join(tokens, on=[*UNIT, "pos"], how="inner")
    units = tokens.select(UNIT).unique().sort(UNIT)
    steps, n = units["step"].n_unique(), units.height
    rng = np.random.default_rng(seed)
    w = rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(np.float64)
    per_unit = tokens.group_by(UNIT).agg(pl.len().alias("n"), pl.col("mismatched").sum().alias("m"))
    counts = units.join(per_unit, on=UNIT, how="left").fill_null(0)
    n_tok, n_mis = counts["n"].to_numpy().astype(np.float64), counts["m"].to_numpy().astype(np.float64)

    def carried(rule: str, mode: str) -> tuple[np.ndarray, int]:
        """Per unit, the rule's share at its mismatched tokens; and the units with no row of the rule."""
        mine = joined.filter(pl.col("rule") == rule, pl.col("mode") == mode)
        missing = units.join(mine.select(UNIT).unique(), on=UNIT, how="anti").height
        part = mine.filter(pl.col("mismatched")).group_by(UNIT).agg(pl.col("share").fill_null(0.0).sum())
        return units.join(part, on=UNIT, how="left").fill_null(0.0)["share"].to_numpy(), missing

    def point(draws: np.ndarray, value: float, known: bool) -> tuple:
        return (value, *percentile_interval(draws)) if known else (None, None, None)

    rows = []
    for (rule, mode), _ in joined.group_by("rule", "mode", maintain_order=True):
        share, without_rule = carried(rule, mode)
        base, without_base = carried("base", mode)
        diff = share - base
        row = {
            "rule": rule,
            "mode": mode,
            "steps": steps,
            "units": n,
            "tokens": int(n_tok.sum()),
            "mismatched": int(n_mis.sum()),
            "token_fraction": float(n_mis.sum() / n_tok.sum()),
            "units_without_rule": without_rule,
            "units_without_base": without_base,
        }
        row["token_fraction_lo"], row["token_fraction_hi"] = percentile_interval((w @ n_mis) / (w @ n_tok))
        row["mismatched_share"], row["mismatched_share_lo"], row["mismatched_share_hi"] = point(
            w @ share / steps, float(share.sum() / steps), not without_rule
        )
        row["minus_base"], row["minus_base_lo"], row["minus_base_hi"] = point(
            w @ diff / steps, float(diff.sum() / steps), not (without_rule or without_base)
        )
        rows.append(row)
    return pl.DataFrame(rows, infer_schema_length=None).sort("mode", "rule")
