"""The comparison's sweeps (`tokendyn.effects.axis`): per sweep value and bin of pi_old, what the update did, with 95 %
bootstrap intervals over (probed step, sequence), every value on the same resample (the pairing kept); and the
guidance drawn from them. Pure: numpy and polars over the `paired` records.

Per (sweep, value, mode, bin; bin -1: all tokens), sums over the drawn units:

    dpi         = sum dpi / count                     correct_pos = up_pos / (n_pos - tie_pos)      (A > 0)
    share       = sum s_t / steps                     correct_neg = down_neg / (n_neg - tie_neg)    (A < 0)
    dentropy    = sum dH_t / count                    kl          = sum KL(pi_base || pi_value)_t / count

On the c axis the base rule's rows stand for c = 0 when the sweep has no c = 0 of its own (it is that update).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from tokendyn.analysis.paired import percentile_interval

SWEEP_SUMS = ("count", "n_pos", "n_neg", "up_pos", "down_neg", "tie_pos", "tie_neg", "sum_dpi", "sum_share",
              "sum_dentropy", "sum_kl_ref")  # fmt: skip
# name -> (numerator column(s), denominator column(s)) of a ratio of sums; "steps": divided by the probed steps
STATS = {
    "dpi": (("sum_dpi",), ("count",)),
    "correct_pos": (("up_pos",), ("n_pos", "-tie_pos")),
    "correct_neg": (("down_neg",), ("n_neg", "-tie_neg")),
    "share": (("sum_share",), "steps"),
    "dentropy": (("sum_dentropy",), ("count",)),
    "kl": (("sum_kl_ref",), ("count",)),
}
GUIDANCE_RULE = (
    "c* = argmax over the swept c of the top pi_old bin's correct ratio of A > 0 tokens (rose / (rose + fell), ties "
    "apart; values tied at the peak: the one nearest 0, and `tied` counts them), every c's update made from the "
    "same states at equal ||dtheta||; its 95 % interval: the 2.5 and 97.5 "
    "percentiles of the argmax over bootstrap resamples of (probed step, sequence), every c on the same resample. "
    "c* < 0 with the interval below 0: taming low-pi tokens (Reweight, alpha = -c*) helps the top bin here; c* > 0 "
    "with the interval above 0: protecting them (Delta-log-p reweight) does; an interval holding 0: no direction is "
    "resolved at this size. The same rule gives eta* for Lopti."
)


def sweep_rows(paired: pl.DataFrame | pl.LazyFrame, sweep: str) -> pl.DataFrame:
    """The `paired` rows of one sweep ("c" or "eta") with a ``value`` column; for "c", the base rule's rows as c = 0
    unless the sweep has its own."""
    frame = paired.collect() if isinstance(paired, pl.LazyFrame) else paired
    if "sweep" not in frame.columns or frame.height == 0:
        return pl.DataFrame()
    rows = frame.filter(pl.col("sweep") == sweep).with_columns(pl.col("sweep_value").alias("value"))
    if rows.height and sweep == "c" and 0.0 not in rows["value"].to_list():
        base = frame.filter(pl.col("rule") == "base").with_columns(pl.lit(0.0).alias("value"))
        rows = pl.concat([rows, base], how="vertical_relaxed")
    return rows


def _unit_sums(rows: pl.DataFrame) -> pl.DataFrame:
    """Per (mode, value, bin, step, seq) sums, bin -1 added (all tokens)."""
    cols = [pl.col(c).cast(pl.Float64).fill_null(0.0).sum() for c in SWEEP_SUMS]
    keys = ["mode", "value", "step", "seq"]
    per_bin = rows.group_by([*keys, "bin"]).agg(cols)
    every = rows.group_by(keys).agg(cols).with_columns(pl.lit(-1, dtype=pl.Int32).alias("bin"))
    return pl.concat([per_bin.with_columns(pl.col("bin").cast(pl.Int32)), every.select(per_bin.columns)])


def _cube(
    units: pl.DataFrame, values: list[float], bins: list[int], keys: pl.DataFrame
) -> dict[str, np.ndarray]:
    """column -> array (unit, value, bin) of sums (0 where a unit has no token there)."""
    index = {(s, q): i for i, (s, q) in enumerate(keys.iter_rows())}
    vi, bi = {v: i for i, v in enumerate(values)}, {b: i for i, b in enumerate(bins)}
    out = {c: np.zeros((keys.height, len(values), len(bins))) for c in SWEEP_SUMS}
    for r in units.iter_rows(named=True):
        u, v, b = index[(r["step"], r["seq"])], vi[r["value"]], bi[r["bin"]]
        for c in SWEEP_SUMS:
            out[c][u, v, b] = r[c]
    return out


def _stat(name: str, w: np.ndarray, cube: dict[str, np.ndarray], steps: float) -> np.ndarray:
    """The ratio of sums ``name`` for each resample weight row of w (R, U): (R, values, bins)."""
    num_cols, den_cols = STATS[name]
    num = sum(np.einsum("ru,uvb->rvb", w, cube[c]) for c in num_cols)
    if den_cols == "steps":
        return num / steps
    den = sum(
        (-1 if c.startswith("-") else 1) * np.einsum("ru,uvb->rvb", w, cube[c.lstrip("-")]) for c in den_cols
    )
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def _resample(n_units: int, n_boot: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.multinomial(n_units, np.full(n_units, 1.0 / n_units), size=n_boot).astype(np.float64)


def _groups(rows: pl.DataFrame):
    """Per mode: (values, bins, unit keys, cube, steps) of one sweep's rows."""
    units = _unit_sums(rows)
    for (mode,), g in units.group_by(["mode"], maintain_order=True):
        values = sorted(g["value"].unique().to_list())
        bins = sorted(g["bin"].unique().to_list())
        keys = g.select("step", "seq").unique().sort("step", "seq")
        yield mode, values, bins, keys, _cube(g, values, bins, keys), float(keys["step"].n_unique())


def sweep_summary(
    paired: pl.DataFrame | pl.LazyFrame, sweep: str = "c", *, n_boot: int = 1000, seed: int = 0
) -> pl.DataFrame:
    """One row per (mode, value, bin): tokens, units, and each of `STATS` with its _lo / _hi bootstrap bounds."""
    rows = sweep_rows(paired, sweep)
    if not rows.height:
        return pl.DataFrame()
    edges = rows.select("bin", "bin_lo", "bin_hi").unique("bin")
    out = []
    for mode, values, bins, keys, cube, steps in _groups(rows):
        w = _resample(keys.height, n_boot, seed)
        ones = np.ones((1, keys.height))
        point = {name: _stat(name, ones, cube, steps)[0] for name in STATS}
        draws = {name: _stat(name, w, cube, steps) for name in STATS}
        for j, v in enumerate(values):
            for k, b in enumerate(bins):
                row = {"sweep": sweep, "mode": mode, "value": v, "bin": b,
                       "tokens": int(cube["count"][:, j, k].sum()), "units": keys.height}  # fmt: skip
                for name in STATS:
                    row[name] = float(point[name][j, k])
                    row[f"{name}_lo"], row[f"{name}_hi"] = percentile_interval(draws[name][:, j, k])
                out.append(row)
    return pl.DataFrame(out).join(edges, on="bin", how="left").sort("mode", "value", "bin")


def best_value(values: list[float], stat: np.ndarray, prefer: float | None = None) -> float:
    """The value at which ``stat`` (one per value) peaks; NaN entries skipped; NaN when every entry is NaN. Ties: the
    tied value nearest ``prefer`` (the c axis: 0, GRPO itself, so that a statistic every value ties on points no
    way, instead of at the most negative c: on SmolLM2-135M the top bin's correct ratio was the same at every c of
    the sweep), else the first in ascending value."""
    stat = np.asarray(stat, dtype=np.float64)
    if not np.isfinite(stat).any():
        return float("nan")
    top = np.flatnonzero(stat == np.nanmax(stat))
    if prefer is None:
        return float(values[int(top[0])])
    return float(values[int(top[np.argmin(np.abs(np.asarray(values, dtype=np.float64)[top] - prefer))])])


def guidance(
    paired: pl.DataFrame | pl.LazyFrame,
    sweep: str = "c",
    *,
    statistic: str = "correct_pos",
    n_boot: int = 1000,
    seed: int = 0,
) -> pl.DataFrame:
    """`GUIDANCE_RULE`, one row per mode: the value where the top bin's ``statistic`` peaks (``best``), its 95 %
    interval over the resamples' argmax, how many swept values tie at that peak (``tied``: all of them, and the
    statistic tells no value from another), the peak and the statistic at the sweep's value nearest 0 (GRPO on the c
    axis), each with its interval, and the swept values."""
    rows = sweep_rows(paired, sweep)
    if not rows.height:
        return pl.DataFrame()
    out = []
    for mode, values, bins, keys, cube, steps in _groups(rows):
        top = len(bins) - 1  # bins sorted, -1 first: the last is the top bin of pi_old
        w = _resample(keys.height, n_boot, seed)
        point = _stat(statistic, np.ones((1, keys.height)), cube, steps)[0][:, top]
        draws = _stat(statistic, w, cube, steps)[:, :, top]
        prefer = 0.0 if sweep == "c" else None  # (ties on the c axis: toward GRPO, no direction)
        best = best_value(values, point, prefer)
        argmax = np.array([best_value(values, d, prefer) for d in draws])
        zero = int(np.argmin(np.abs(np.asarray(values))))
        peak = np.nanmax(draws, axis=1) if np.isfinite(draws).any() else np.full(len(draws), np.nan)
        lo, hi = percentile_interval(argmax)
        peak_lo, peak_hi = percentile_interval(peak)
        at_lo, at_hi = percentile_interval(draws[:, zero])
        best_point = float(np.nanmax(point)) if np.isfinite(point).any() else None
        out.append({
            "sweep": sweep, "mode": mode, "statistic": f"{statistic}, top bin", "bin": bins[top], "best": best,
            "best_lo": lo, "best_hi": hi,
            "tied": 0 if best_point is None else int(np.sum(point == best_point)), "peak": best_point,
            "peak_lo": peak_lo, "peak_hi": peak_hi, "at": values[zero],
            "at_value": float(point[zero]), "at_value_lo": at_lo, "at_value_hi": at_hi,
            "values": ",".join(f"{v:g}" for v in values),
            "units": keys.height,
        })  # fmt: skip
    return pl.DataFrame(out)
