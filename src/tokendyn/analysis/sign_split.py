"""The sampler's mismatch and the update's share split by the sign of the advantage, per pi_old bin ([0, .25),
[.25, .5), [.5, .75), [.75, 1], the last closed; bin -1 is every token). The sign of a token's advantage A:

    sign(A) = "pos" if A > 0,  "neg" if A < 0,  "zero" if A = 0,  null if A is null or NaN (not recorded)

Mismatch by sign (table ``mismatch_sign``), from the `sampler` records joined to the probe's `tokens` records: the
`sampler` rows carry no advantage, the `tokens` rows (the probe's bounded token sample, one row per sampled token
and probe point) do. The join is an inner join on the exact keys (step, stage, rank, micro, row, pos), the `tokens`
rows taken once per key (their advantage is the same at every point; two different advantages at one key are a
`UsageError`); a sampler token outside the sample is unmatched: counted, never given an advantage. The bin is the
sampler row's own (pi_old = exp logp_old). Per bin b and sign s, over the matched tokens:

    count_bs        = #{t in b matched : sign(A_t) = s}
    mean_log_rho_bs = mean log rho_t                      (null where count_bs = 0)
    abs_mean_bs     = mean |log rho_t|                    (null where count_bs = 0)

and per bin: ``sampler_tokens`` (the bin's sampler rows), ``matched`` and ``unmatched`` = sampler_tokens - matched.
Every bin has the three signs (count 0 where none), and a null-sign row where matched tokens carry no advantage.
Without `tokens` records every count is 0 and every statistic null, with the sampler tokens all unmatched.

Update share by sign (table ``update_sign``), from the `token_shares` records (s_t = <grad l_t, g> / ||g||^2, each
sampled token's exact share of the update, with its own bin and advantage) and the `shares` records (the bin's token
count, group "all"). A unit u is one (step, stage) with `token_shares` rows. The sum is exact only where the sample
holds every token of the bin: bin b is complete in u when its `token_shares` rows (0 where none) number the
`shares` count of (u, b) (a missing count: unknown, not complete). Per stage, bin and sign, with U the units:

    share_bs = (1 / |U|) sum_u sum_{t in b, sign(A_t) = s} s_t      (the mean over units of the exact sums)

null unless b is complete in every unit (``complete_units`` = ``units``) and no s_t is null; bin -1 sums every bin and needs all of
them complete. (sum_b sum_s share_bs = 1 where every bin is complete: the shares of a unit sum to 1.) A run without
`token_shares` records has no table; one without `shares` records has every share null (completeness unknown).
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from tokendyn.analysis.mismatch import EDGES, _bin_expr
from tokendyn.common import UsageError

KEYS = ("step", "stage", "rank", "micro", "row", "pos")
SIGNS = ("pos", "neg", "zero")
UNIT = ("step", "stage")


def sign_of(a: float | None) -> str | None:
    """ "pos" for A > 0, "neg" for A < 0, "zero" for A = 0, None for a null or NaN A."""
    if a is None or a != a:
        return None
    return "pos" if a > 0 else "neg" if a < 0 else "zero"


def _sign_expr(a: pl.Expr) -> pl.Expr:
    """`sign_of` as a polars expression."""
    return (
        pl.when(a.is_null() | a.is_nan()).then(None)
        .when(a > 0).then(pl.lit("pos")).when(a < 0).then(pl.lit("neg")).otherwise(pl.lit("zero"))
    )  # fmt: skip


def _df(frame) -> pl.DataFrame:
    if frame is None:
        return pl.DataFrame()
    return frame.collect() if isinstance(frame, pl.LazyFrame) else frame


def advantages(tokens: pl.LazyFrame | pl.DataFrame | None) -> pl.DataFrame:
    """The `tokens` rows once per key (KEYS, advantage): a key's advantage is the first non-null over its probe
    points (null only where every point's is); a key with two different advantages is a `UsageError`."""
    df = _df(tokens)
    if df.height == 0:
        return pl.DataFrame(schema={**{k: pl.Int64 for k in KEYS}, "stage": pl.Utf8, "advantage": pl.Float64})
    per_key = df.group_by(KEYS).agg(
        pl.col("advantage").drop_nulls().first(), pl.col("advantage").drop_nulls().n_unique().alias("_n")
    )
    bad = per_key.filter(pl.col("_n") > 1)
    if bad.height:
        r = bad.row(0, named=True)
        raise UsageError(
            f"tokens records: advantage differs between points at step {r['step']}, stage {r['stage']!r}, rank "
            f"{r['rank']}, micro {r['micro']}, row {r['row']}, pos {r['pos']}"
        )
    return per_key.drop("_n")


def mismatch_by_sign(
    sampler: pl.LazyFrame | pl.DataFrame,
    tokens: pl.LazyFrame | pl.DataFrame | None,
    edges: Sequence[float] = EDGES,
) -> pl.DataFrame:
    """One row per (bin, sign): bin, bin_lo, bin_hi, sign, count, mean_log_rho, abs_mean, sampler_tokens, matched,
    unmatched (module docstring); empty when there are no sampler records."""
    df = _df(sampler)
    if df.height == 0:
        return pl.DataFrame()
    df = df.with_columns(_bin_expr(pl.col("logp_old").exp(), edges).alias("bin"))
    adv = advantages(tokens)
    keys = list(KEYS)
    joined = df.join(
        adv.select(*keys, "advantage").cast({k: df.schema[k] for k in keys}), on=keys, how="inner"
    )
    joined = joined.with_columns(_sign_expr(pl.col("advantage")).alias("sign"))
    rows = []
    for b in range(-1, len(edges) - 1):
        lo, hi = (edges[0], edges[-1]) if b < 0 else (edges[b], edges[b + 1])
        mine = joined if b < 0 else joined.filter(pl.col("bin") == b)
        n_sampler = df.height if b < 0 else df.filter(pl.col("bin") == b).height
        present = set(mine["sign"].to_list())
        for s in (*SIGNS, *([None] if None in present else [])):
            part = mine.filter(pl.col("sign").is_null() if s is None else pl.col("sign") == s)
            n = part.height
            rows.append({"bin": b, "bin_lo": float(lo), "bin_hi": float(hi), "sign": s, "count": n,
                         "mean_log_rho": part["log_rho"].mean() if n else None,
                         "abs_mean": part["log_rho"].abs().mean() if n else None,
                         "sampler_tokens": n_sampler, "matched": mine.height,
                         "unmatched": n_sampler - mine.height})  # fmt: skip
    schema = {"bin": pl.Int32, "bin_lo": pl.Float64, "bin_hi": pl.Float64, "sign": pl.Utf8, "count": pl.Int64,
              "mean_log_rho": pl.Float64, "abs_mean": pl.Float64, "sampler_tokens": pl.Int64, "matched": pl.Int64,
              "unmatched": pl.Int64}  # fmt: skip
    return pl.DataFrame(rows, schema=schema)


def _completeness(ts: pl.DataFrame, shares: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(per (step, stage, bin) of every unit x every bin: complete, the bins' edges). Complete: the unit's
    `token_shares` rows in the bin (0 where none) number the `shares` count of the bin (null there: unknown, false)."""
    unit = list(UNIT)
    bins = ts.select("bin", "bin_lo", "bin_hi")
    counts = pl.DataFrame(schema={**{k: ts.schema[k] for k in unit}, "bin": pl.Int32, "count": pl.Int64})
    if shares.height:
        all_group = shares.filter((pl.col("group") == "all") & (pl.col("bin") >= 0))
        bins = pl.concat([bins, all_group.select("bin", "bin_lo", "bin_hi")], how="vertical_relaxed")
        counts = all_group.select(*unit, pl.col("bin").cast(pl.Int32), "count").unique([*unit, "bin"])
    edges = bins.unique("bin").sort("bin")
    grid = ts.select(unit).unique().join(edges.select(pl.col("bin").cast(pl.Int32)), how="cross")
    sampled = ts.group_by(*unit, pl.col("bin").cast(pl.Int32)).agg(pl.len().alias("sampled"))
    grid = grid.join(sampled, on=[*unit, "bin"], how="left").join(counts, on=[*unit, "bin"], how="left")
    complete = (pl.col("sampled").fill_null(0) == pl.col("count")).fill_null(False)
    return grid.with_columns(complete.alias("complete")), edges


def update_share_by_sign(
    token_shares: pl.LazyFrame | pl.DataFrame | None, shares: pl.LazyFrame | pl.DataFrame | None
) -> pl.DataFrame:
    """One row per (stage, bin, sign): stage, bin, bin_lo, bin_hi, sign, units, complete_units, tokens, share
    (module docstring); empty when there are no `token_shares` records."""
    ts = _df(token_shares)
    if ts.height == 0:
        return pl.DataFrame()
    unit = list(UNIT)
    ts = ts.with_columns(_sign_expr(pl.col("advantage")).alias("sign"))
    grid, edges = _completeness(ts, _df(shares))
    rows = []
    for stage in sorted(ts["stage"].unique().to_list()):
        mine, done = ts.filter(pl.col("stage") == stage), grid.filter(pl.col("stage") == stage)
        n_units = mine.select(unit).unique().height
        bins = [(-1, float(edges["bin_lo"].min()), float(edges["bin_hi"].max())), *edges.rows()]
        for b, lo, hi in bins:
            in_b = mine if b < 0 else mine.filter(pl.col("bin") == b)
            per_unit = done if b < 0 else done.filter(pl.col("bin") == b)
            whole = per_unit.group_by(unit).agg(pl.col("complete").all()).filter(pl.col("complete")).height
            signs = set(in_b["sign"].to_list())
            for s in (*SIGNS, *([None] if None in signs else [])):
                part = in_b.filter(pl.col("sign").is_null() if s is None else pl.col("sign") == s)
                exact = whole == n_units and part["share"].null_count() == 0
                rows.append({"stage": stage, "bin": b, "bin_lo": float(lo), "bin_hi": float(hi), "sign": s,
                             "units": n_units, "complete_units": whole, "tokens": part.height,
                             "share": float(part["share"].sum()) / n_units if exact else None})  # fmt: skip
    schema = {"stage": pl.Utf8, "bin": pl.Int32, "bin_lo": pl.Float64, "bin_hi": pl.Float64, "sign": pl.Utf8,
              "units": pl.Int64, "complete_units": pl.Int64, "tokens": pl.Int64, "share": pl.Float64}  # fmt: skip
    return pl.DataFrame(rows, schema=schema)
