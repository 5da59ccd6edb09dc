"""Side-by-side rebalancing tables for several runs (rows: probability bins; columns: runs).

- update share s_b = <g_b, g>/||g||^2 (all parameters), mean over probed steps;
- ||g_b|| / ||g||, mean over probed steps;
- correct ratio of A>0 tokens (pi rose) per bin, pooled over steps by token counts, after the
  counterfactual full update (Lopti: both stages) and after the real training update;
- isolation: mean |delta pi| per target bin when only the lowest / the highest bin is updated (Lopti: per stage).
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from tokendyn.analysis.load import load
from tokendyn.records import run_lopti_order
from tokendyn.vocab import FULL_UPDATES, TRAIN, stage_name


def run_label(run_dir: str | Path) -> str:
    """The run's method (from run.json) and its folder name."""
    meta = Path(run_dir) / "run.json"
    if meta.is_file():
        method = json.loads(meta.read_text()).get("method")
        if method:
            return f"{method} [{Path(run_dir).name}]"
    return Path(run_dir).name


def short_labels(run_dirs) -> dict[str, str]:
    """Column labels: each folder's name, with its parents added while two runs would share one."""
    paths = [Path(d).resolve() for d in run_dirs]
    depth = 1
    while True:
        labels = ["/".join(p.parts[-depth:]) for p in paths]
        if len(set(labels)) == len(labels) or depth >= max(len(p.parts) for p in paths):
            return {str(d): lab for d, lab in zip(run_dirs, labels, strict=True)}
        depth += 1


def _interval(df: pl.DataFrame, lo: str = "bin_lo", hi: str = "bin_hi") -> pl.DataFrame:
    """A readable pi_old interval; the last bin is closed (pi = 1 belongs to it)."""
    close = pl.when(pl.col(hi) >= 1.0).then(pl.lit("]")).otherwise(pl.lit(")"))
    return df.with_columns(
        pl.format("[{}, {}{}", pl.col(lo).round(2), pl.col(hi).round(2), close).alias("pi_old")
    )


def _pivot(frames: list[pl.DataFrame], value: str, index: str = "pi_old") -> pl.DataFrame:
    frames = [f for f in frames if f.height]
    if not frames:
        return pl.DataFrame()
    long = pl.concat(frames, how="vertical_relaxed")
    order = long.select(index, "bin").unique().sort("bin")
    wide = long.pivot(on="run", index=index, values=value, aggregate_function="first")
    return order.join(wide, on=index, how="left").drop("bin")


def shares(run_dirs) -> dict[str, pl.DataFrame]:
    """{"share": s_b per bin and run, "norm_ratio": ||g_b||/||g||} (group "all", bins >= 0) of the whole loss
    (stage "train"; a Lopti run's per-stage rows are left out so that the runs compare)."""
    label = short_labels(run_dirs)
    per_run = []
    for d in run_dirs:
        df = (
            load(d, "shares")
            .filter((pl.col("group") == "all") & (pl.col("bin") >= 0) & (pl.col("stage") == "train"))
            .collect()
        )
        if df.height == 0:
            continue
        df = (
            df.with_columns((pl.col("grad_norm") / pl.col("total_norm")).alias("norm_ratio"))
            .group_by("bin", "bin_lo", "bin_hi")
            .agg(pl.col("share").mean(), pl.col("norm_ratio").mean())
        )
        per_run.append(_interval(df).with_columns(pl.lit(label[str(d)]).alias("run")))
    return {"share": _pivot(per_run, "share"), "norm_ratio": _pivot(per_run, "norm_ratio")}


def correct_ratios(run_dirs, update: str = "counterfactual") -> pl.DataFrame:
    """Per bin: among A>0 tokens, rose / (rose + fell), pooled over steps (each weighted by its decided tokens), shown
    as "ratio (ties / tokens)"."""
    label = short_labels(run_dirs)
    per_run = []
    for d in run_dirs:
        df = (
            load(d, "prob_change")
            .filter(
                (pl.col("update") == update)
                & (pl.col("update_stage").is_in(FULL_UPDATES))
                & (pl.col("bin") >= 0)
            )
            .collect()
        )
        if df.height == 0:
            continue
        ties = pl.col("tie_pos").fill_null(0)  # null in records written before ties were counted
        df = (
            df.with_columns((pl.col("n_pos") - ties).alias("decided"), ties.alias("ties"))
            .group_by("bin", "bin_lo", "bin_hi")
            .agg(
                (
                    (pl.col("correct_pos").fill_nan(0) * pl.col("decided")).sum() / pl.col("decided").sum()
                ).alias("ratio"),
                pl.col("ties").sum(),
                pl.col("n_pos").sum(),
            )
            .with_columns(
                pl.format(
                    "{} ({} ties / {})", pl.col("ratio").round(3), pl.col("ties"), pl.col("n_pos")
                ).alias("correct")
            )
        )
        per_run.append(_interval(df).with_columns(pl.lit(label[str(d)]).alias("run")))
    return _pivot(per_run, "correct")


def isolation(run_dirs) -> pl.DataFrame:
    """Mean |delta pi| per target bin (token-weighted over steps) under an update with all tokens (all), only the
    lowest (low) or only the highest (high) source bin. A Lopti run updates each source bin in the stage that holds
    it (low_first: the lowest in the low stage first): its columns name the stage, and "all" is given per stage (all
    of that stage's tokens)."""
    label = short_labels(run_dirs)
    per_run = []
    for d in run_dirs:
        df = load(d, "influence").filter((pl.col("target_bin") >= 0) & (pl.col("count") > 0)).collect()
        if df.height == 0:
            continue
        sources = sorted(s for s in df["source_bin"].unique().to_list() if s >= 0)
        if not sources:
            continue
        df = df.group_by("update_stage", "source_bin", "target_bin", "target_lo", "target_hi").agg(
            ((pl.col("mean_abs") * pl.col("count")).sum() / pl.col("count").sum()).alias("mean_abs")
        )
        staged = TRAIN not in df["update_stage"].unique().to_list()
        columns = []  # (column name, update stage, source bin)
        order = [
            stage_name(1, run_lopti_order(d)),
            stage_name(2, run_lopti_order(d)),
        ]  # the run's stage order
        stages = sorted(
            df["update_stage"].unique().to_list(),
            key=lambda s: (s in order, order.index(s) if s in order else 0, s),
        )
        for stage in stages:
            have = df.filter(pl.col("update_stage") == stage)["source_bin"].unique().to_list()
            where = f" ({stage} stage)" if staged else ""
            columns.append((f"all{where}", stage, -1))
            columns += [(f"{name}{where}", stage, src) for name, src in (("low", sources[0]), ("high", sources[-1]))
                        if src in have]  # fmt: skip
        for name, stage, src in columns:
            part = df.filter((pl.col("update_stage") == stage) & (pl.col("source_bin") == src))
            part = _interval(part.rename({"target_bin": "bin"}), "target_lo", "target_hi")
            per_run.append(part.with_columns(pl.lit(f"{label[str(d)]}: {name}").alias("run")))
    return _pivot(per_run, "mean_abs")


def compare(run_dirs) -> dict[str, pl.DataFrame]:
    """Every side-by-side table that the runs' records allow (empty frames are left out)."""
    s = shares(run_dirs)
    tables = {
        "update share s_b": s["share"],
        "||g_b|| / ||g||": s["norm_ratio"],
        "correct ratio A>0, counterfactual full update": correct_ratios(run_dirs, "counterfactual"),
        "correct ratio A>0, real training update": correct_ratios(run_dirs, "real"),
        "isolation: mean |delta pi| (update source: all / low bin / high bin)": isolation(run_dirs),
    }
    return {k: v for k, v in tables.items() if v.height}
