"""The report's tables, one function each, from the records of several runs (a ``run`` column first)."""

from __future__ import annotations

import polars as pl

from tokendyn.analysis.tables import (
    CORRECT_COLUMNS,
    bin_table,
    bound_report,
    checks_diagnostics,
    checks_summary,
)
from tokendyn.figures.data import MissingRecords, Records, bin_label, run_order
from tokendyn.figures.dynamics import pooled_change
from tokendyn.figures.training import accuracy_table


def _per_run(records: Records, kinds: tuple[str, ...], fn) -> pl.DataFrame:
    """fn(*lazy frames of one run without its run column) for each run having kinds[0], stacked with a run column."""
    first = records.get(kinds[0])
    if first is None:
        raise MissingRecords(kinds[0], kinds[:1])
    out = []
    for run in run_order(first):
        frames = []
        for k in kinds:
            df = records.get(k)
            part = df.filter(pl.col("run") == run).drop("run") if df is not None else None
            if part is None or not part.height:
                from tokendyn.records import SCHEMAS

                part = pl.DataFrame(schema=SCHEMAS[k])
            frames.append(part.lazy())
        res = fn(*frames)
        if res.height:
            out.append(res.with_columns(pl.lit(run).alias("run")).select("run", pl.exclude("run")))
    return pl.concat(out, how="diagonal_relaxed") if out else pl.DataFrame()


def _interval(df: pl.DataFrame) -> pl.DataFrame:
    """Add a readable ``interval`` column from bin_lo / bin_hi."""
    return df.with_columns(
        pl.struct("bin_lo", "bin_hi")
        .map_elements(lambda s: bin_label(s["bin_lo"], s["bin_hi"], s["bin_hi"] >= 1.0), return_dtype=pl.Utf8)
        .alias("interval")
    )


def bound_table(records: Records) -> pl.DataFrame:
    """Per run, stage and probe point: the envelope C..D of ||delta|| / (|w|(1 - pi)), its mean, and the rank
    correlations (`tokendyn.analysis.bound_report`)."""
    if records.get("bound") is None:
        raise MissingRecords("bound report", ["bound"])
    return _per_run(records, ("bound", "binstats", "tokens"), bound_report)


def bin_stats_table(records: Records, point: str | None = "final_norm.out") -> pl.DataFrame:
    """Per run, stage and bin at one probe point (default the final norm): tokens, share, per-token ||dL/dh||
    mean / std / quantiles, mean ||delta|| / |w| and the bound ratio (`tokendyn.analysis.bin_table`)."""
    if records.get("binstats") is None:
        raise MissingRecords("per-bin statistics", ["binstats"])
    table = _per_run(records, ("binstats", "hist"), lambda b, h: bin_table(b, h))
    points = table.get_column("point").unique().to_list()
    if point not in points:
        point = sorted(points)[-1]
    keep = [c for c in table.columns if c not in ("point", "nonfinite")]
    return _interval(table.filter(pl.col("point") == point)).select(
        "run", "stage", "interval", *[c for c in keep if c not in ("run", "stage", "bin", "bin_lo", "bin_hi")]
    )


def checks_table(records: Records) -> pl.DataFrame:
    """Per run and stage: the exact LM-head and logits checks that must hold (scaled errors, token counts,
    violations)."""
    if records.get("checks") is None:
        raise MissingRecords("exact checks", ["checks"])
    return _per_run(records, ("checks",), checks_summary)


def diagnostics_table(records: Records) -> pl.DataFrame:
    """Per run and stage: the unscaled identity errors (`tokendyn.analysis.tables.DIAGNOSTICS_NOTE`)."""
    if records.get("checks") is None:
        raise MissingRecords("identity diagnostics", ["checks"])
    return _per_run(records, ("checks",), checks_diagnostics)


def shares_table(records: Records) -> pl.DataFrame:
    """Per run, stage and bin (all parameters): tokens, ||g_b|| and the projection share s_b (means over the
    recorded steps), the per-token JVP share sum when recorded, and ||g|| of all tokens. Stage "train" is the whole
    loss; a Lopti run adds its stages "low" / "high": each stage loss's gradient at the start of the stage."""
    sh = records.get("shares")
    if sh is None:
        raise MissingRecords("update shares", ["shares"])
    sh = sh.filter(pl.col("group") == "all")
    total = (
        sh.filter(pl.col("bin") < 0)
        .group_by("run", "stage")
        .agg(pl.col("grad_norm").mean().alias("norm_all"))
    )
    per = (
        sh.filter(pl.col("bin") >= 0)
        .group_by("run", "stage", "bin")
        .agg(
            pl.col("bin_lo").mean(),
            pl.col("bin_hi").mean(),
            pl.col("step").n_unique().alias("steps"),
            pl.col("count").sum().alias("tokens"),
            pl.col("grad_norm").mean().alias("norm_b"),
            pl.col("share").mean().alias("share_b"),
            pl.col("jvp_share").mean().alias("jvp_share_b"),
        )
        .with_columns((pl.col("tokens") / pl.col("tokens").sum().over("run", "stage")).alias("token_share"))
        .join(total, on=["run", "stage"], how="left")
    )
    order = {r: i for i, r in enumerate(run_order(per))}
    stage_rank = {"train": 0, "low": 1, "high": 2}  # the whole loss, then Lopti's stages
    per = per.with_columns(
        pl.col("run").replace_strict(order, return_dtype=pl.Int32).alias("_o"),
        pl.col("stage").replace_strict(stage_rank, default=3, return_dtype=pl.Int32).alias("_s"),
    )
    return (
        _interval(per)
        .sort("_o", "_s", "stage", "bin")
        .select(
            "run",
            "stage",
            "interval",
            "steps",
            "tokens",
            "token_share",
            "share_b",
            "norm_b",
            "norm_all",
            "jvp_share_b",
        )  # fmt: skip
    )


def correct_table(records: Records) -> pl.DataFrame:
    """Per run, kind of update (counterfactual, real) and bin (and all tokens): the correct ratios after the full
    update (A>0: rose / (rose + fell), A<0: fell / (rose + fell), pooled) with their token and tie counts, and the
    mean |delta pi|."""
    pc = records.get("prob_change")
    if pc is None:
        raise MissingRecords("correct ratios", ["prob_change"])
    kinds = sorted(pc.get_column("update").unique().to_list())  # counterfactual first, then real
    pooled = pl.concat(
        [pooled_change(pc, k).filter(pl.col("update") == k) for k in kinds], how="diagonal_relaxed"
    )
    order = {r: i for i, r in enumerate(run_order(pooled))}
    pooled = pooled.with_columns(pl.col("run").replace_strict(order, return_dtype=pl.Int32).alias("_o"))
    return (
        _interval(pooled)
        .with_columns(
            pl.when(pl.col("bin") < 0)
            .then(pl.lit("all tokens"))
            .otherwise(pl.col("interval"))
            .alias("interval")
        )
        .sort("_o", "update", "bin")
        .select(
            "run",
            "update",
            "update_stage",
            "steps",
            "interval",
            "tokens",
            *CORRECT_COLUMNS,
            "mean_abs",
        )  # fmt: skip
    )


def sweep_correct_table(records: Records) -> pl.DataFrame:
    """Per run, step size and bin: ||delta theta|| / ||theta|| and the correct ratios with ties
    (`tokendyn.figures.sweep.sweep_table`)."""
    from tokendyn.figures.sweep import sweep_table

    pc = records.get("prob_change")
    if pc is None:
        raise MissingRecords("correct ratios along the step-size sweep", ["prob_change"])
    return sweep_table(pc)


def accuracy(records: Records) -> pl.DataFrame:
    return accuracy_table(records.get("metrics"))


def camps(records: Records) -> pl.DataFrame:
    from tokendyn.figures.camps import camps_table

    return camps_table(records.get("paired"))


def guidance(records: Records) -> pl.DataFrame:
    from tokendyn.figures.axis import guidance_table

    return guidance_table(records)


TABLES = {
    "accuracy": ("Held-out accuracy", accuracy),
    "bound": ("Bound report: ||delta_l|| / (|w|(1 - pi)) in [C, D]", bound_table),
    "bins": ("Per-bin statistics at the final norm", bin_stats_table),
    "shares": ("Update shares per bin (all parameters)", shares_table),
    "correct": ("Correct ratios per bin after the full update", correct_table),
    "sweep": ("Correct ratios along the counterfactual step-size sweep", sweep_correct_table),
    "both_camps": (
        "Both camps: each rule minus the base rule per bin, from the same states (95 % intervals)",
        camps,
    ),
    "guidance": ("Guidance: where the top bin's correct ratio (A > 0) peaks along each sweep", guidance),
    "checks": ("Exact checks at the LM head and logits (must hold for every token)", checks_table),
    "diagnostics": (
        "Diagnostics: unscaled identity errors (grow like eps / (1 - pi) as pi -> 1; not checks)",
        diagnostics_table,
    ),
}
