"""The sampler's mismatch per probability bin, from the `sampler` records (one row per token of a probed micro-batch:
log pi_old, log mu, the weight the loss applied).

Per bin, binned once by pi_old and once by mu (binning on one side alone regresses to the mean: a token whose mu was
under-estimated lands in a low mu bin and shows a positive log rho for that reason alone):

    log rho_t            = log pi_old(o_t) - log mu(o_t)
    mean_log_rho         = mean_t log rho_t                      (signed: a bias of the sampler, not only noise)
    abs_p50, p95, p99    = quantiles of |log rho_t|              (linear interpolation)
    envelope             = max_t |log rho_t| / (1 - pi_old(o_t)) (the (1 - pi) law of the mismatch, DVP
                                                                  arXiv 2512.23087: |d log p_a| <= 2 ||delta||_inf
                                                                  (1 - p_a); null where pi_old = 1)
    mean_weight          = mean applied weight (how much the correction rescales the bin's gradient)
    frac_masked          = share of tokens whose applied weight is 0
    frac_seq_masked      = share of tokens whose whole sequence the correction zeroed
                           (the last three over the tokens whose weight is known; null where none is: the offline
                           probe's records, whose rollouts carried no weights)

A truncated or penalised sampler (top_p < 1, top_k > 0, min_p > 0, a penalty: the `sampler` records' ``log_kept``
and ``log_rho_precision``, `tokendyn.hooks.kept_mass`) splits the total log rho into the processing's shift and the
precision part, over the tokens where ``log_kept`` is recorded (``kept_count`` of them; all null where none is):

    mean_log_kept        = mean_t log S_t                        (<= 0; the truncation's part is -mean log S)
    mean_log_rho_prec    = mean_t log rho_precision_t            (= log rho - log S + the penalty's own change)
    abs_mean_prec        = mean_t |log rho_precision_t|

The statistics above stay those of the total log rho: the value TRL 1.16's correction exponentiates
(``importance_sampling_ratio`` = exp of old_per_token_logps - sampling_per_token_logps, the processed log-probs,
summed over the sequence in the sequence modes), so ``mean_weight`` and the masks are what the total did.

Bin ``-1`` is every token. The edges are the paper's fixed intervals unless given; the last bin is closed.
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

EDGES = (0.0, 0.25, 0.5, 0.75, 1.0)
SIDES = {"pi_old": "logp_old", "mu": "logp_sampler"}
PRECISION = ("mean_log_kept", "mean_log_rho_prec", "abs_mean_prec")  # the truncation split (module docstring)


def _bin_expr(prob: pl.Expr, edges: Sequence[float]) -> pl.Expr:
    """Index b of [edges[b], edges[b + 1]) holding ``prob``; the last interval closed."""
    expr = pl.lit(len(edges) - 2, dtype=pl.Int32)
    for b in range(len(edges) - 2, 0, -1):
        expr = pl.when(prob < edges[b]).then(pl.lit(b - 1, dtype=pl.Int32)).otherwise(expr)
    return expr


def _stats(group: pl.DataFrame) -> dict:
    a = group["abs_log_rho"]
    env = group["env"].drop_nulls()
    w, m = group["is_weight"].drop_nulls(), group["seq_masked"].drop_nulls()  # null: not recorded (offline)
    n = group.height
    return {
        "count": n,
        "mean_log_rho": group["log_rho"].mean(),
        "abs_mean": a.mean(),
        "abs_p50": a.quantile(0.5, "linear"),
        "abs_p95": a.quantile(0.95, "linear"),
        "abs_p99": a.quantile(0.99, "linear"),
        "abs_max": a.max(),
        "envelope": env.max() if env.len() else None,
        "mean_weight": w.mean() if w.len() else None,
        "frac_masked": float((w == 0.0).sum()) / w.len() if w.len() else None,
        "frac_seq_masked": float(m.sum()) / m.len() if m.len() else None,
        **_precision(group),
    }


def _precision(group: pl.DataFrame) -> dict:
    """The truncation split of the module docstring over the rows with ``log_kept`` (all null without any)."""
    if "log_kept" not in group.columns or "log_rho_precision" not in group.columns:
        kept = group.clear()
    else:
        kept = group.filter(pl.col("log_kept").is_not_null() & pl.col("log_rho_precision").is_not_null())
    n = kept.height
    return {
        "kept_count": n,
        "mean_log_kept": kept["log_kept"].mean() if n else None,
        "mean_log_rho_prec": kept["log_rho_precision"].mean() if n else None,
        "abs_mean_prec": kept["log_rho_precision"].abs().mean() if n else None,
    }


def mismatch_table(sampler: pl.LazyFrame | pl.DataFrame, edges: Sequence[float] = EDGES) -> pl.DataFrame:
    """One row per (side, bin) with the statistics of the module docstring; empty when there are no records."""
    df = sampler.collect() if isinstance(sampler, pl.LazyFrame) else sampler
    if df.height == 0:
        return pl.DataFrame()
    one_minus = 1.0 - pl.col("logp_old").exp()
    df = df.with_columns(
        pl.col("log_rho").abs().alias("abs_log_rho"),
        pl.when(one_minus > 0).then(pl.col("log_rho").abs() / one_minus).otherwise(None).alias("env"),
    )
    rows = []
    for side, column in SIDES.items():
        binned = df.with_columns(_bin_expr(pl.col(column).exp(), edges).alias("bin"))
        for b in range(-1, len(edges) - 1):
            group = binned if b < 0 else binned.filter(pl.col("bin") == b)
            if group.height == 0:
                continue
            lo, hi = (edges[0], edges[-1]) if b < 0 else (edges[b], edges[b + 1])
            rows.append({"side": side, "bin": b, "bin_lo": float(lo), "bin_hi": float(hi), **_stats(group)})
    table = pl.DataFrame(rows, infer_schema_length=None).with_columns(
        pl.col("kept_count").cast(pl.Int64), *(pl.col(c).cast(pl.Float64) for c in PRECISION)
    )
    total = df.height
    return table.with_columns((pl.col("count") / total).alias("token_share"))
