"""What the sampler correction's mask removes from each bin's update: from the paired comparison's rule
``no_correction`` (the run's loss without TRL's importance weights, from the same states as the run's own loss, the
``base`` rule; `tokendyn.effects.compare`).

A unit is one analysed sequence of one probed step (step, seq). A unit is *masked* when the correction dropped it:
its tokens carry no update under the base rule (Σ_bins |Σ s_t| = 0) and some under ``no_correction``. Per mode and
bin of pi_old, with S the probed steps:

    removed  = Σ_{masked units} Σ_{tokens of the bin} s_t(no_correction) / S
               (the part of the uncorrected update, in the bin, that the masked sequences carried)
    of_bin   = removed / (Σ_{all units} Σ_{tokens of the bin} s_t(no_correction) / S)
               (the fraction of the bin's own share that the mask removes)

s_t is the token's share of its rule's update (`sum_share` of the `paired` records; Σ over all tokens = 1 per step);
bin -1 is every token. Intervals: the units resampled with replacement (seeded), 2.5 % and 97.5 % quantiles, as
`tokendyn.analysis.paired.paired_summary`. A sequence with no signal (every advantage 0) carries nothing under
either rule and is not masked. A unit with no rows under the base rule is unknown, not masked: it is left out of
every sum above and counted in ``excluded_units`` (`unpaired_units`).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from tokendyn.analysis.paired import percentile_interval

RULE, REFERENCE = "no_correction", "base"
_STATS = ("removed", "removed_lo", "removed_hi", "of_bin", "of_bin_lo", "of_bin_hi")


def masked_units(paired: pl.DataFrame, mode: str) -> pl.DataFrame:
    """(step, seq) of the units the correction masked in ``mode`` (module docstring)."""
    per = (
        paired.filter(pl.col("mode") == mode, pl.col("rule").is_in([RULE, REFERENCE]))
        .group_by("rule", "step", "seq")
        .agg(pl.col("sum_share").fill_null(0.0).abs().sum().alias("carried"))
    )
    base = per.filter(pl.col("rule") == REFERENCE).select("step", "seq", pl.col("carried").alias("base"))
    rule = per.filter(pl.col("rule") == RULE).select("step", "seq", pl.col("carried").alias("rule"))
    both = rule.join(base, on=["step", "seq"], how="inner")  # no base rows: unknown (`unpaired_units`)
    return both.filter((pl.col("base") == 0) & (pl.col("rule") > 0)).select("step", "seq").sort("step", "seq")


def unpaired_units(paired: pl.DataFrame, mode: str) -> pl.DataFrame:
    """(step, seq) of the units with rows under ``no_correction`` and none under the base rule in ``mode``: whether
    the correction masked them is unknown."""
    sel = paired.filter(pl.col("mode") == mode)
    units = [sel.filter(pl.col("rule") == r).select("step", "seq").unique() for r in (RULE, REFERENCE)]
    return units[0].join(units[1], on=["step", "seq"], how="anti").sort("step", "seq")


def masked_share_table(
    paired: pl.LazyFrame | pl.DataFrame, *, n_boot: int = 1000, seed: int = 0
) -> pl.DataFrame:
    """One row per (mode, bin): steps, units, masked_units, tokens_masked, removed and of_bin with their _lo / _hi
    bootstrap bounds, and excluded_units (no base rows; module docstring). Empty without the ``no_correction`` rule;
    a mode whose every unit lacks the base rule gives null statistics."""
    frame = paired.collect() if isinstance(paired, pl.LazyFrame) else paired
    if "sweep" in frame.columns:
        frame = frame.filter(pl.col("sweep").is_null())
    if frame.height == 0 or RULE not in set(frame["rule"].unique()):
        return pl.DataFrame()
    rng = np.random.default_rng(seed)
    bins = frame.select("bin", "bin_lo", "bin_hi").unique("bin")
    bin_ids = [-1, *sorted(bins["bin"].to_list())]
    rows = []
    for mode in sorted(frame["mode"].unique()):
        unpaired = unpaired_units(frame, mode)
        sel = frame.filter(pl.col("mode") == mode, pl.col("rule") == RULE).join(
            unpaired, on=["step", "seq"], how="anti"
        )
        units = sel.select("step", "seq").unique().sort("step", "seq")
        if units.height == 0:  # nothing paired: unknown
            unknown = dict.fromkeys(("steps", "masked_units", "tokens_masked", *_STATS))
            rows += [{"mode": mode, "bin": b, "units": 0, "excluded_units": unpaired.height, **unknown}
                     for b in bin_ids]  # fmt: skip
            continue
        masked = masked_units(frame, mode).with_columns(pl.lit(True).alias("masked"))
        units = units.join(masked, on=["step", "seq"], how="left").with_columns(
            pl.col("masked").fill_null(False)
        )
        steps, n = units["step"].n_unique(), units.height
        w = rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(np.float64)
        is_masked = units["masked"].to_numpy().astype(np.float64)
        per_bin = sel.group_by("step", "seq", "bin").agg(
            pl.col("sum_share").fill_null(0.0).sum().alias("share"), pl.col("count").sum()
        )
        every = per_bin.group_by("step", "seq").agg(pl.col("share").sum(), pl.col("count").sum())
        every = every.with_columns(pl.lit(-1, dtype=per_bin["bin"].dtype).alias("bin"))
        for b, part in (
            pl.concat([per_bin, every.select(per_bin.columns)])
            .sort("bin")
            .group_by("bin", maintain_order=True)
        ):
            t = units.join(part.drop("bin"), on=["step", "seq"], how="left").fill_null(0)
            share, count = t["share"].to_numpy().astype(np.float64), t["count"].to_numpy()
            removed, whole = w @ (share * is_masked) / steps, w @ share / steps
            row = {
                "mode": mode,
                "bin": b[0],
                "steps": steps,
                "units": n,
                "masked_units": int(is_masked.sum()),
                "excluded_units": unpaired.height,
                "tokens_masked": int((count * is_masked).sum()),
                "removed": float((share * is_masked).sum() / steps),
            }
            row["removed_lo"], row["removed_hi"] = percentile_interval(removed)
            total = float(share.sum())
            row["of_bin"] = row["removed"] * steps / total if total else float("nan")
            with np.errstate(invalid="ignore", divide="ignore"):
                row["of_bin_lo"], row["of_bin_hi"] = percentile_interval(removed / whole)
            rows.append(row)
    out = pl.DataFrame(rows, infer_schema_length=None).join(bins, on="bin", how="left")
    first = ["mode", "bin", "bin_lo", "bin_hi"]
    return out.select(*first, *[c for c in out.columns if c not in first]).sort("mode", "bin")
