"""Tables over the records: the per-bin table, the per-layer bound report, the exact-check summary.

All merges are exact over ranks and micro-batches: counts and sums add, min/max take min/max, histograms add.
"""

from __future__ import annotations

import polars as pl

from tokendyn.vocab import FULL_UPDATES

QUANTILES = (0.1, 0.5, 0.9)


def _safe_div(num: pl.Expr, den: pl.Expr) -> pl.Expr:
    return pl.when(den > 0).then(num / den).otherwise(None)


def merge_binstats(binstats: pl.LazyFrame, keys: list[str]) -> pl.LazyFrame:
    """Sum count / sum / sumsq and take min / max over everything not in keys (+ bin, quantity)."""
    return binstats.group_by([*keys, "point_index", "bin", "quantity"]).agg(
        pl.col("bin_lo").min(),
        pl.col("bin_hi").max(),
        pl.col("count").sum(),
        pl.col("sum").sum(),
        pl.col("sumsq").sum(),
        pl.col("min").min(),
        pl.col("max").max(),
        pl.col("nonfinite").sum(),
    )


def hist_quantiles(hist: pl.LazyFrame, keys: list[str], quantity: str, qs=QUANTILES) -> pl.LazyFrame:
    """Quantiles from the merged log histogram, log-linear inside a cell (linear in the [0, lo) cell).

    q-quantile: the first cell where the cumulative count reaches q * total; frac = the position inside it."""
    h = (
        hist.filter(pl.col("quantity") == quantity)
        .group_by([*keys, "cell"])
        .agg(pl.col("count").sum(), pl.col("lo").first(), pl.col("hi").first())
        .sort([*keys, "cell"])
        .with_columns(
            cum=pl.col("count").cum_sum().over(keys),
            total=pl.col("count").sum().over(keys),
        )
    )
    out = None
    for q in qs:
        name = f"{quantity}_p{round(q * 100):02d}"
        target = pl.lit(q) * pl.col("total")
        frac = ((target - (pl.col("cum") - pl.col("count"))) / pl.col("count")).clip(0.0, 1.0)
        value = (
            pl.when(pl.col("lo") <= 0)
            .then(pl.col("hi") * frac)
            .when(pl.col("hi").is_infinite())
            .then(pl.col("lo"))
            .otherwise(pl.col("lo") * (pl.col("hi") / pl.col("lo")).pow(frac))
        )
        part = (
            h.filter(pl.col("cum") >= target)
            .with_columns(value.alias(name))
            .group_by(keys)
            .agg(pl.col(name).sort_by("cell").first())
        )
        out = part if out is None else out.join(part, on=keys, how="full", coalesce=True)
    return out


def bin_table(binstats: pl.LazyFrame, hist: pl.LazyFrame, by_step: bool = False) -> pl.DataFrame:
    """Per (stage[, step], point, bin): tokens, share of tokens, norm mean / std / min / max / quantiles,
    mean ||delta|| / |w|, and the bound ratio's mean / min / max. Empty bins give nulls, never errors."""
    keys = ["stage", *(["step"] if by_step else []), "point"]
    merged = merge_binstats(binstats, keys)

    def part(quantity: str, prefix: str, with_std: bool) -> pl.LazyFrame:
        cols = [
            *keys,
            "point_index",
            "bin",
            _safe_div(pl.col("sum"), pl.col("count")).alias(f"{prefix}_mean"),
            pl.col("min").alias(f"{prefix}_min"),
            pl.col("max").alias(f"{prefix}_max"),
        ]
        if with_std:
            var = _safe_div(pl.col("sumsq"), pl.col("count")) - _safe_div(pl.col("sum"), pl.col("count")).pow(
                2
            )
            cols.append(var.clip(lower_bound=0.0).sqrt().alias(f"{prefix}_std"))
        return merged.filter(pl.col("quantity") == quantity).select(cols)

    base = merged.filter(pl.col("quantity") == "norm").select(
        *keys,
        "point_index",
        "bin",
        "bin_lo",
        "bin_hi",
        pl.col("count").alias("tokens"),
        pl.col("nonfinite"),
    )
    share = _safe_div(pl.col("tokens"), pl.col("tokens").sum().over(keys)).alias("share")
    on = [*keys, "point_index", "bin"]
    table = (
        base.with_columns(share)
        .join(part("norm", "norm", True), on=on, how="left")
        .join(hist_quantiles(hist, [*keys, "bin"], "norm"), on=[*keys, "bin"], how="left")
        .join(part("norm_per_w", "norm_per_w", False).select(*on, "norm_per_w_mean"), on=on, how="left")
        .join(part("ratio", "ratio", False), on=on, how="left")
        .with_columns(  # interpolation inside a cell may step past the exact extremes
            [
                pl.col(f"norm_p{round(q * 100):02d}").clip(pl.col("norm_min"), pl.col("norm_max"))
                for q in QUANTILES
            ]
        )
        .sort([*keys[:-1], "point_index", "bin"])
    )
    order = [
        *keys,
        "bin",
        "bin_lo",
        "bin_hi",
        "tokens",
        "share",
        "norm_mean",
        "norm_std",
        "norm_min",
        *[f"norm_p{round(q * 100):02d}" for q in QUANTILES],
        "norm_max",
        "norm_per_w_mean",
        "ratio_mean",
        "ratio_min",
        "ratio_max",
        "nonfinite",
    ]
    return table.select(order).collect()


def bound_report(bound: pl.LazyFrame, binstats: pl.LazyFrame, tokens: pl.LazyFrame) -> pl.DataFrame:
    """Per (stage, point): the envelope C_l = min ratio, D_l = max ratio of ||delta_l|| / (|w| (1 - pi)), its mean,
    the rank correlation of ||delta_l|| / |w| with (1 - pi) (per micro-batch, token-weighted mean / min; and pooled
    over the token sample), and the same for the "direct" per-token gradient. `unreached`: scored tokens whose
    gradient at this point the backward never delivered (an error of the run, never a zero: see `unreached`)."""
    keys = ["stage", "point"]
    env = bound.group_by([*keys, "point_index"]).agg(
        pl.col("n").sum().alias("n"),
        pl.col("ratio_min").min().alias("C"),
        pl.col("ratio_max").max().alias("D"),
        _safe_div(
            (pl.col("spearman") * pl.col("n")).sum(),
            pl.col("n").filter(pl.col("spearman").is_not_null()).sum(),
        ).alias("spearman_mean"),
        pl.col("spearman").min().alias("spearman_min"),
        pl.col("nonfinite").sum(),
        pl.col("unreached").fill_null(0).sum(),
        pl.col("direct_n").sum(),
        pl.col("direct_ratio_min").min().alias("C_direct"),
        pl.col("direct_ratio_max").max().alias("D_direct"),
    )
    ratio_mean = (
        merge_binstats(binstats, keys)
        .filter(pl.col("quantity") == "ratio")
        .group_by(keys)
        .agg(_safe_div(pl.col("sum").sum(), pl.col("count").sum()).alias("ratio_mean"))
    )
    omp = 1.0 - pl.col("pi")
    pooled = tokens.group_by(keys).agg(
        pl.corr(
            (pl.col("norm") / pl.col("w").abs()).filter(pl.col("w") != 0),
            omp.filter(pl.col("w") != 0),
            method="spearman",
        ).alias("spearman_sample"),
        pl.corr(
            (pl.col("direct_ratio") * omp).filter(pl.col("direct_ratio").is_not_null()),
            omp.filter(pl.col("direct_ratio").is_not_null()),
            method="spearman",
        ).alias("spearman_direct"),
    )
    out = (
        env.join(ratio_mean, on=keys, how="left")
        .join(pooled, on=keys, how="left")
        .sort(["stage", "point_index"])
        .select(
            keys
            + [
                "n",
                "C",
                "ratio_mean",
                "D",
                "spearman_mean",
                "spearman_min",
                "spearman_sample",
                "direct_n",
                "C_direct",
                "D_direct",
                "spearman_direct",
                "nonfinite",
                "unreached",
            ]
        )
    )
    return out.collect()


def checks_summary(checks: pl.LazyFrame) -> pl.DataFrame:
    """Per stage: the exact checks that must hold for every token, over all micro-batches, with their token counts
    and violations. LM-head identity: grad at the head input = W^T (pi - e_o) w / T, its error on the scale
    |w| sigma_max / T (which does not shrink as pi -> 1), violated beyond the tolerance; logits bound: ||dl/dz|| /
    (|w|(1 - pi)) in [sqrt(V/(V-1)), sqrt(2)]; head bound: ||delta|| / (|w|(1 - pi)) <= sqrt(2) sigma_max / T."""
    return (
        checks.group_by("stage")
        .agg(
            pl.col("step").n_unique().alias("steps"),
            pl.len().alias("micro_batches"),
            pl.col("identity_n").sum(),
            pl.col("identity_max_scaled_err").max(),
            pl.col("identity_violations").fill_null(0).sum(),
            pl.col("n_checked").sum(),
            pl.col("logits_lo").min(),
            pl.col("logits_ratio_min").min(),
            pl.col("logits_ratio_max").max(),
            pl.col("logits_hi").max(),
            pl.col("logits_violations").sum(),
            pl.col("head_n").sum(),
            pl.col("head_ratio_max").max(),
            pl.col("head_bound").min(),
            pl.col("head_violations").sum(),
            pl.col("tolerance").max(),
            pl.col("tolerance_rel").max(),
            pl.col("grad_dtype").unique().sort().str.join(",").alias("grad_dtype"),
            pl.col("head_dtype").drop_nulls().unique().sort().str.join(",").alias("head_dtype"),
        )
        .sort("stage")
        .collect()
    )


def checks_violations(summary: pl.DataFrame) -> int:
    """Total violations of the must-hold checks in a `checks_summary` table."""
    cols = ("identity_violations", "logits_violations", "head_violations")
    return sum(int(summary[c].fill_null(0).sum()) for c in cols if c in summary.columns)


DIAGNOSTICS_NOTE = (
    "Unscaled relative errors of the identities (diagnostics, not checks): the gradient itself shrinks like 1 - pi "
    "while its float32 rounding does not, so they grow like eps / (1 - pi) as pi -> 1 and are large for tokens whose "
    "pi rounds to 1; the must-hold identity error is the scaled one."
)


def checks_diagnostics(checks: pl.LazyFrame) -> pl.DataFrame:
    """Per stage: the unscaled relative errors of the LM-head and logits identities (`DIAGNOSTICS_NOTE`)."""
    return (
        checks.group_by("stage")
        .agg(
            pl.col("identity_n").sum(),
            pl.col("identity_max_rel_err").max(),
            pl.col("identity_mean_rel_err").mean(),
            pl.col("identity_logits_max_rel_err").max(),
        )
        .sort("stage")
        .collect()
    )


CORRECT_COLUMNS = ("n_pos", "tie_pos", "correct_pos", "n_neg", "tie_neg", "correct_neg", "correct_pooled")


def correct_summary(prob_change: pl.LazyFrame) -> pl.DataFrame:
    """Per kind of update (counterfactual, real), step size and bin of pi_old (-1: all tokens), over the steps of the
    full update (update_stage "train", or Lopti's "lopti"): the correct ratios from the summed counts, ties apart:
    A > 0: rose / (rose + fell); A < 0: fell / (rose + fell); pooled; with n and the ties of each sign."""
    pc = prob_change.filter(pl.col("update_stage").is_in(FULL_UPDATES) & (pl.col("source_bin") == -1))
    pc = pc.with_columns(pl.col("tie_pos").fill_null(0), pl.col("tie_neg").fill_null(0)).with_columns(
        (pl.col("n_pos") - pl.col("tie_pos")).alias("d_pos"),
        (pl.col("n_neg") - pl.col("tie_neg")).alias("d_neg"),
    )
    pc = pc.with_columns(
        (pl.col("correct_pos").fill_nan(0).fill_null(0) * pl.col("d_pos")).round(0).alias("up_pos"),
        (pl.col("correct_neg").fill_nan(0).fill_null(0) * pl.col("d_neg")).round(0).alias("down_neg"),
    )

    def ratio(num: pl.Expr, den: pl.Expr) -> pl.Expr:
        return pl.when(den > 0).then(num / den).otherwise(None)

    out = (
        pc.group_by("update", "lr", "bin")
        .agg(
            pl.col("update_stage").first(),
            pl.col("step").n_unique().alias("steps"),
            pl.col("bin_lo").first(),
            pl.col("bin_hi").first(),
            pl.col("n_pos").sum(),
            pl.col("tie_pos").sum(),
            pl.col("up_pos").sum(),
            pl.col("d_pos").sum(),
            pl.col("n_neg").sum(),
            pl.col("tie_neg").sum(),
            pl.col("down_neg").sum(),
            pl.col("d_neg").sum(),
        )
        .with_columns(
            ratio(pl.col("up_pos"), pl.col("d_pos")).alias("correct_pos"),
            ratio(pl.col("down_neg"), pl.col("d_neg")).alias("correct_neg"),
            ratio(pl.col("up_pos") + pl.col("down_neg"), pl.col("d_pos") + pl.col("d_neg")).alias(
                "correct_pooled"
            ),
        )
        .select(
            "update",
            "update_stage",
            "lr",
            "steps",
            "bin",
            "bin_lo",
            "bin_hi",
            *CORRECT_COLUMNS,
        )
        .sort("update", "lr", "bin", nulls_last=True)
    )
    return out.collect()


def unreached(bound: pl.DataFrame) -> list[str]:
    """The errors of a bound report: one line per (stage, point) whose gradient never arrived for scored tokens
    (e.g. a probe attached inside a reentrant activation checkpoint before its fix); empty when there are none."""
    bad = bound.filter(pl.col("unreached") > 0)
    return [
        f"stage {r['stage']}: {r['point']} recorded nothing for {r['unreached']} scored tokens"
        for r in bad.iter_rows(named=True)
    ]
