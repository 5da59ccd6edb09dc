"""The paired comparison's table: per rule, mode and bin of pi_old, what the rule's update did from the same state,
and its difference from the base rule's, with 95 % bootstrap intervals over (probed step, sequence).

From the `paired` records (`tokendyn.effects.compare.paired_frame`), for the tokens of a bin (bin -1: all tokens):

    dpi         = sum dpi / count                                   (mean change of pi per token)
    diff        = sum (dpi(rule) - dpi(base)) / count                (the paired difference per token)
    correct     = (up_pos + down_neg) / (n_pos + n_neg - tie_pos - tie_neg)   (pooled correct ratio, ties apart)
    correct_diff = correct(rule) - correct(base)                    (on the same tokens)
    share       = sum s_t / number of probed steps                   (the bin's part of the rule's update)

Intervals: the units (step, sequence) are resampled with replacement ``n_boot`` times (seeded), each statistic a
ratio of sums recomputed on the resample; the 2.5 % and 97.5 % quantiles. The rule and the base are resampled
together (paired).
"""

from __future__ import annotations

import numpy as np
import polars as pl

COUNTS = ("count", "n_pos", "n_neg", "up_pos", "down_neg", "tie_pos", "tie_neg")
SUMS = ("sum_dpi", "sum_diff", "sum_share")


def _units(frame: pl.DataFrame) -> pl.DataFrame:
    """Per (rule, mode, bin, step, seq) sums, with the all-token bin -1 added."""
    cols = [pl.col(c).sum() for c in COUNTS] + [pl.col(c).fill_null(0.0).sum() for c in SUMS]
    keys = ["rule", "mode", "step", "seq"]
    per_bin = frame.group_by([*keys, "bin"]).agg(cols)
    every = frame.group_by(keys).agg(cols).with_columns(pl.lit(-1, dtype=pl.Int32).alias("bin"))
    return pl.concat([per_bin, every.select(per_bin.columns)])


def _rule_units(group: pl.DataFrame, unit_keys: pl.DataFrame, rule: str) -> pl.DataFrame:
    """One rule's sums on every unit (0 where the rule had no token of the bin in that unit)."""
    part = group.filter(pl.col("rule") == rule).drop("rule", "mode", "bin")
    return unit_keys.join(part, on=["step", "seq"], how="left").fill_null(0)


def _ratio(w: np.ndarray, num: np.ndarray, den: np.ndarray) -> np.ndarray:
    n, d = w @ num, w @ den
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(d > 0, n / np.where(d > 0, d, 1.0), np.nan)


def percentile_interval(draws: np.ndarray) -> tuple[float, float]:
    """The 2.5 and 97.5 percentiles of the finite bootstrap draws (NaN, NaN when none is finite)."""
    ok = draws[np.isfinite(draws)]
    if ok.size == 0:
        return float("nan"), float("nan")
    lo, hi = np.quantile(ok, [0.025, 0.975])
    return float(lo), float(hi)


def paired_summary(
    paired: pl.LazyFrame | pl.DataFrame, *, reference: str = "base", n_boot: int = 1000, seed: int = 0
) -> pl.DataFrame:
    """One row per (rule, mode, bin): tokens, steps, units, and dpi, diff, correct, correct_diff, share each with
    its _lo / _hi bootstrap bounds (module docstring); bin -1 is all tokens. The sweeps' points are left out."""
    frame = paired.collect() if isinstance(paired, pl.LazyFrame) else paired
    if "sweep" in frame.columns:  # the sweeps' points have their own table (`tokendyn.analysis.sweep`)
        frame = frame.filter(pl.col("sweep").is_null())
    if frame.height == 0:
        return pl.DataFrame()
    units = _units(frame)
    bins = frame.select("bin", "bin_lo", "bin_hi").unique("bin")
    rng = np.random.default_rng(seed)
    rows = []
    # (in sorted order: the groups draw their resamples from one generator in turn, so the intervals are the same
    # from one call to the next; `_units`' group_by returns its rows in an order that varies)
    for (mode, b), group in units.sort("mode", "bin").group_by(["mode", "bin"], maintain_order=True):
        unit_keys = group.select("step", "seq").unique().sort("step", "seq")
        n_units = unit_keys.height
        w = rng.multinomial(n_units, np.full(n_units, 1.0 / n_units), size=n_boot).astype(np.float64)
        steps = unit_keys["step"].n_unique()

        ref = _rule_units(group, unit_keys, reference)
        ref_num = (ref["up_pos"] + ref["down_neg"]).to_numpy().astype(np.float64)
        ref_den = (
            (ref["n_pos"] + ref["n_neg"] - ref["tie_pos"] - ref["tie_neg"]).to_numpy().astype(np.float64)
        )
        for rule in group["rule"].unique(maintain_order=True):
            t = _rule_units(group, unit_keys, rule)
            count = t["count"].to_numpy().astype(np.float64)
            num = (t["up_pos"] + t["down_neg"]).to_numpy().astype(np.float64)
            den = (t["n_pos"] + t["n_neg"] - t["tie_pos"] - t["tie_neg"]).to_numpy().astype(np.float64)
            ones = np.ones((1, n_units))
            stats = {
                "dpi": (t["sum_dpi"].to_numpy(), count),
                "diff": (t["sum_diff"].to_numpy(), count),
                "correct": (num, den),
            }
            row = {
                "rule": rule,
                "mode": mode,
                "bin": b,
                "tokens": int(count.sum()),
                "steps": steps,
                "units": n_units,
            }
            for name, (nu, de) in stats.items():
                row[name] = float(_ratio(ones, nu, de)[0])
                row[f"{name}_lo"], row[f"{name}_hi"] = percentile_interval(_ratio(w, nu, de))
            cd = _ratio(w, num, den) - _ratio(w, ref_num, ref_den)
            row["correct_diff"] = float(_ratio(ones, num, den)[0] - _ratio(ones, ref_num, ref_den)[0])
            row["correct_diff_lo"], row["correct_diff_hi"] = percentile_interval(cd)
            share = t["sum_share"].to_numpy().astype(np.float64)
            row["share"] = float(share.sum() / steps)
            row["share_lo"], row["share_hi"] = percentile_interval(w @ share / steps)
            rows.append(row)
    out = pl.DataFrame(rows).join(bins, on="bin", how="left")
    order = {r: i for i, r in enumerate(frame["rule"].unique(maintain_order=True))}
    return out.sort(
        pl.col("rule").replace_strict(order, return_dtype=pl.Int32), "mode", "bin"
    ).select("rule", "mode", "bin", "bin_lo", "bin_hi", *[c for c in out.columns if c not in (
        "rule", "mode", "bin", "bin_lo", "bin_hi")])  # fmt: skip
