"""The shape of the sampler's mismatch per pi_old bin, from the `sampler` records: a histogram of log rho and the
ratio's tail at the importance-sampling correction's thresholds (bins of pi_old as `tokendyn.analysis.mismatch`:
[0, .25), [.25, .5), [.5, .75), [.75, 1], the last closed; bin -1 is every token).

Histogram (table ``mismatch_hist``). Fixed, symmetric edges of log rho = log pi_old - log mu (`LOG_RHO_EDGES`):

    +-{1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3}

which cut the line into 21 cells: the open outer cells (-inf, -3) and [3, +inf], the central [-1e-4, 1e-4), and
half-open [e_k, e_k+1) between. A token's cell is the number of finite edges at or below its log rho,

    cell(x) = #{k : e_k <= x}                 (0 = (-inf, -3), 20 = [3, +inf]; -inf and +inf are counted too)

so no token with a log rho is dropped; a token whose log rho is null or NaN has no cell and is counted in a row of
its own (cell, edge_lo and edge_hi null), present only where such tokens exist. Per bin b and cell k:

    count_bk = #{t in b : cell(log rho_t) = k},   share_bk = count_bk / n_b      (sum_k count_bk = n_b)

an empty bin keeps its cells with count 0 and share null (no tokens: no share).

Ratio tail (table ``mismatch_tail``). Per bin and threshold row, over the n_b tokens with a defined log rho, with
the row's bounds on rho = exp(log rho), rho_hi and rho_lo (either null: that side not counted):

    above_b = #{t in b : log rho_t > log rho_hi} / n_b     (rho > rho_hi; null where rho_hi is null)
    below_b = #{t in b : log rho_t < log rho_lo} / n_b     (rho < rho_lo; null where rho_lo is null)
    outside_b = above_b + below_b                          (the sides the row has)

compared in log space (the strict inequalities of TRL's mask, ``ratio > clip_max``, ``ratio < clip_min``, up to the
rounding of exp). The rows (`correction_thresholds`): always the fixed band tau = 1.1, symmetric (``source``
"fixed", rho_hi = 1.1, rho_lo = 1 / 1.1: the band of the ``mismatched`` table, |log rho| > log 1.1); and the run's
own correction as run.json's trainer config records it (TRL: ``use_vllm`` and ``vllm_importance_sampling_correction``
true), each bound on its own side, never folded: ``source`` "clip_max" with tau = rho_hi = C_max
(``vllm_importance_sampling_clip_max``, else the deprecated ``vllm_importance_sampling_cap``; below null), and
"clip_min" with tau = rho_lo = C_min (``vllm_importance_sampling_clip_min``; above null), absent where C_min is 0
(TRL's "no lower bound"). A run whose config records no threshold (no run.json config, a correction switched off, no
bound set) gets one row per bin with ``source`` "correction", tau and the shares null, and ``note`` saying why: never
a made-up threshold. ``mode`` is the recorded ``vllm_importance_sampling_mode``: in the sequence modes TRL applies C
to the sequence's summed log rho, so the token tail is where the mismatch sits, and the `mismatch` table's
``frac_seq_masked`` what the correction dropped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import polars as pl

from tokendyn.analysis.mismatch import EDGES, _bin_expr
from tokendyn.common import UsageError

_INNER = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)
LOG_RHO_EDGES = tuple(-x for x in reversed(_INNER)) + _INNER  # the finite edges, ascending
N_CELLS = len(LOG_RHO_EDGES) + 1
FIXED_TAU = 1.1  # the band of the `mismatched` table (|log rho| > log 1.1)
CLIP_MAX = ("vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap")
CLIP_MIN = "vllm_importance_sampling_clip_min"


def cell_of(x: float | None, edges: Sequence[float] = LOG_RHO_EDGES) -> int | None:
    """cell(x) = #{k : e_k <= x}, the histogram cell of log rho x (0: below the first edge; len(edges): at or
    above the last); None for a null or NaN x."""
    if x is None or x != x:
        return None
    return sum(1 for e in edges if e <= x)


def cell_edges(k: int, edges: Sequence[float] = LOG_RHO_EDGES) -> tuple[float, float]:
    """(edge_lo, edge_hi) of cell k: (-inf, e_0), [e_k-1, e_k), ..., [e_last, +inf]."""
    lo = -math.inf if k == 0 else float(edges[k - 1])
    hi = math.inf if k == len(edges) else float(edges[k])
    return lo, hi


def cell_label(lo: float | None, hi: float | None) -> str:
    """A cell as text: "(-inf, -3)", "[-3, -1)", ..., "[3, +inf]"; "undefined" for the null / NaN row."""
    if lo is None or hi is None:
        return "undefined"
    left = "(-inf" if lo == -math.inf else f"[{lo:g}"
    return f"{left}, {'+inf]' if hi == math.inf else f'{hi:g})'}"


def _cell_expr(x: pl.Expr, edges: Sequence[float]) -> pl.Expr:
    """`cell_of` as a polars expression (null for a null or NaN x)."""
    count = pl.sum_horizontal([(x >= e).cast(pl.Int32) for e in edges])
    return pl.when(x.is_null() | x.is_nan()).then(None).otherwise(count).cast(pl.Int32)


def _binned(sampler: pl.LazyFrame | pl.DataFrame, edges: Sequence[float]) -> pl.DataFrame:
    df = sampler.collect() if isinstance(sampler, pl.LazyFrame) else sampler
    if df.height == 0:
        return df
    return df.with_columns(_bin_expr(pl.col("logp_old").exp(), edges).alias("bin"))


def _bins(df: pl.DataFrame, edges: Sequence[float]):
    """(b, lo, hi, rows of bin b) for b = -1 (every token), 0, ..., K - 1."""
    for b in range(-1, len(edges) - 1):
        lo, hi = (edges[0], edges[-1]) if b < 0 else (edges[b], edges[b + 1])
        yield b, float(lo), float(hi), (df if b < 0 else df.filter(pl.col("bin") == b))


def mismatch_hist(
    sampler: pl.LazyFrame | pl.DataFrame,
    edges: Sequence[float] = EDGES,
    log_rho_edges: Sequence[float] = LOG_RHO_EDGES,
) -> pl.DataFrame:
    """One row per (pi_old bin, cell): bin, bin_lo, bin_hi, cell, edge_lo, edge_hi, count, share (module docstring);
    empty when there are no records."""
    df = _binned(sampler, edges)
    if df.height == 0:
        return pl.DataFrame()
    df = df.with_columns(_cell_expr(pl.col("log_rho"), log_rho_edges).alias("cell"))
    rows = []
    for b, lo, hi, group in _bins(df, edges):
        n = group.height
        counts = dict(group.group_by("cell").len().iter_rows())
        for k in range(len(log_rho_edges) + 1):
            e_lo, e_hi = cell_edges(k, log_rho_edges)
            c = counts.get(k, 0)
            rows.append((b, lo, hi, k, e_lo, e_hi, c, c / n if n else None))
        if counts.get(None):
            rows.append((b, lo, hi, None, None, None, counts[None], counts[None] / n))
    schema = {"bin": pl.Int32, "bin_lo": pl.Float64, "bin_hi": pl.Float64, "cell": pl.Int32,
              "edge_lo": pl.Float64, "edge_hi": pl.Float64, "count": pl.Int64, "share": pl.Float64}  # fmt: skip
    return pl.DataFrame(rows, schema=schema, orient="row")


def _bound(config: Mapping, key: str, zero: bool = False) -> float | None:
    """A recorded threshold: a finite number > 0 (>= 0 where ``zero``: 0 is TRL's "no lower bound"), or None where
    unset; anything else a one-line `UsageError` naming the field."""
    value = config.get(key)
    if value is None:
        return None
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero):
        need = ">= 0 (0: no lower bound)" if zero else "> 0"
        raise UsageError(f"run.json config: {key} must be a finite number {need} or null, got {value!r}")
    return float(value)


def _row(source: str, tau, rho_hi, rho_lo, mode, note: str, log_lo: float | None = None) -> dict:
    """A threshold row; log_hi, log_lo: the bounds in log space (log_lo given for the fixed band: -log 1.1 exactly,
    which log(1 / 1.1) misses by an ulp)."""
    log_hi = math.log(rho_hi) if rho_hi is not None else None
    log_lo = log_lo if log_lo is not None else (math.log(rho_lo) if rho_lo is not None else None)
    return {"source": source, "tau": tau, "rho_hi": rho_hi, "rho_lo": rho_lo, "log_hi": log_hi, "log_lo": log_lo,
            "mode": mode, "note": note}  # fmt: skip


def correction_thresholds(config: Mapping | None) -> list[dict]:
    """The rows of the tail (module docstring): [{source, tau, rho_hi, rho_lo, log_hi, log_lo, mode, note}], the
    fixed band first
    (rho_hi = 1.1, rho_lo = 1 / 1.1); the correction's as recorded in the trainer config ``config`` (run.json's),
    clip_max with rho_hi = C_max, clip_min with rho_lo = C_min (none for C_min = 0), else one row with tau null and a
    note."""
    band = "the fixed band |log rho| > log 1.1"
    rows = [_row("fixed", FIXED_TAU, FIXED_TAU, 1.0 / FIXED_TAU, None, band, log_lo=-math.log(FIXED_TAU))]
    config = config or {}
    if not isinstance(config, Mapping):
        raise UsageError(f"run.json config: must be a mapping, got {type(config).__name__}")
    mode = config.get("vllm_importance_sampling_mode")
    if mode is not None and not isinstance(mode, str):
        raise UsageError(f"run.json config: vllm_importance_sampling_mode must be a string, got {mode!r}")

    def missing(note: str) -> list[dict]:
        return [*rows, _row("correction", None, None, None, mode, note)]

    if "vllm_importance_sampling_correction" not in config:
        return missing("no correction threshold recorded (run.json holds no TRL importance-sampling config)")
    if not (config.get("use_vllm") and config.get("vllm_importance_sampling_correction")):
        return missing("the correction is off (use_vllm or vllm_importance_sampling_correction false)")
    c_max = next((v for v in (_bound(config, k) for k in CLIP_MAX) if v is not None), None)
    c_min = _bound(config, CLIP_MIN, zero=True)
    if c_max is None and not c_min:
        why = "clip_max and clip_min unset" if c_min is None else "clip_max unset, clip_min 0: no lower bound"
        return missing(f"no correction threshold recorded ({why})")
    if c_max is not None:
        rows.append(
            _row("clip_max", c_max, c_max, None, mode, f"the correction's clip_max {c_max:g}: rho > C_max")
        )
    if c_min:
        rows.append(
            _row("clip_min", c_min, None, c_min, mode, f"the correction's clip_min {c_min:g}: rho < C_min")
        )
    return rows


def tail_shares(
    log_rho: pl.Series, log_hi: float | None, log_lo: float | None
) -> tuple[int, float | None, float | None]:
    """(n, above, below) over the n tokens with a defined log rho: above = #{log rho > log_hi} / n (rho > rho_hi),
    below = #{log rho < log_lo} / n (rho < rho_lo); a side whose bound is None is None, both None for n = 0."""
    x = log_rho.drop_nulls().drop_nans()
    n = x.len()
    if n == 0:
        return 0, None, None
    above = float((x > log_hi).sum()) / n if log_hi is not None else None
    below = float((x < log_lo).sum()) / n if log_lo is not None else None
    return n, above, below


def mismatch_tail(
    sampler: pl.LazyFrame | pl.DataFrame, config: Mapping | None = None, edges: Sequence[float] = EDGES
) -> pl.DataFrame:
    """One row per (pi_old bin, threshold): bin, bin_lo, bin_hi, source, mode, tau, rho_hi, rho_lo, count, above,
    below, outside, note (module docstring); empty when there are no records."""
    df = _binned(sampler, edges)
    if df.height == 0:
        return pl.DataFrame()
    thresholds = correction_thresholds(config)
    rows = []
    for b, lo, hi, group in _bins(df, edges):
        for th in thresholds:
            bounds = th["log_hi"], th["log_lo"]
            n, above, below = tail_shares(group["log_rho"], *bounds) if th["tau"] else (None, None, None)
            sides = [v for v in (above, below) if v is not None]
            rows.append({"bin": b, "bin_lo": lo, "bin_hi": hi, "source": th["source"], "mode": th["mode"],
                         "tau": th["tau"], "rho_hi": th["rho_hi"], "rho_lo": th["rho_lo"], "count": n,
                         "above": above, "below": below, "outside": sum(sides) if sides else None,
                         "note": th["note"]})  # fmt: skip
    schema = {"bin": pl.Int32, "bin_lo": pl.Float64, "bin_hi": pl.Float64, "source": pl.Utf8, "mode": pl.Utf8,
              "tau": pl.Float64, "rho_hi": pl.Float64, "rho_lo": pl.Float64, "count": pl.Int64,
              "above": pl.Float64, "below": pl.Float64, "outside": pl.Float64, "note": pl.Utf8}  # fmt: skip
    return pl.DataFrame(rows, schema=schema)
