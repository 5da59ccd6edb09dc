"""`analyze_run`: the per-bin table, the bound report and the exact checks of a run, as DataFrames and parquet."""

from __future__ import annotations

import os
from pathlib import Path

import polars as pl
from rich.console import Console
from rich.table import Table

from tokendyn.analysis.load import check_run_dir, check_selection, select_steps
from tokendyn.analysis.run import load_run
from tokendyn.analysis.sampler_tables import print_sampler_tables, sampler_tables
from tokendyn.analysis.tables import (
    DIAGNOSTICS_NOTE,
    bin_table,
    bound_report,
    checks_diagnostics,
    checks_summary,
    checks_violations,
    correct_summary,
    unreached,
)
from tokendyn.records import write_parquet
from tokendyn.vocab import FINAL_NORM, point_order, select_names

ANALYSIS_DIR = "analysis"


def analyze_run(
    run_dir: str | os.PathLike,
    *,
    steps: tuple[int | None, int | None] | None = None,
    stage: str | None = None,
    by_step: bool = False,
    write: bool = True,
    out_dir: str | os.PathLike | None = None,
) -> dict[str, pl.DataFrame]:
    """{"bins": per-bin table, "bound": per-layer bound report, "checks": the must-hold exact checks, "diagnostics":
    their unscaled errors, "correct": the correct ratios with tie counts when the run has `prob_change`
    records, "paired": the paired comparison of update rules with bootstrap intervals when it has `paired`
    records (`tokendyn.analysis.paired`), and with the comparison's sweeps "sweep" (per value and bin) and
    "guidance" (`tokendyn.analysis.sweep.GUIDANCE_RULE`), "mismatch": the sampler's log rho per bin of pi_old and of
    mu when it has `sampler` records, each token once (`tokendyn.analysis.mismatch`), "masked": the update share the sampler
    correction's mask removes per bin, with the paired rule no_correction (`tokendyn.analysis.masked`), "mismatched":
    each rule's update share at the view's tokens with |log rho| > log 1.1 (`tokendyn.analysis.mismatch_share`), and
    `tokendyn.analysis.sampler_tables.NAMES`}, from
    the records of every rank. A selection (steps, stage) that matches nothing is a `SelectionError`
    naming what the run holds. With write=True each non-empty table is also written (atomically) to OUT_DIR/{name}.parquet, OUT_DIR defaulting
    to RUN_DIR/analysis (an empty table is not written: an earlier file of that name is left as it was)."""
    path = check_run_dir(run_dir)
    check_selection(path, steps, stage)
    run = load_run(path)
    lf = {k: select_steps(run[k], steps, stage) for k in ("binstats", "hist", "bound", "checks", "tokens")}
    tables = {
        "bins": bin_table(lf["binstats"], lf["hist"], by_step=by_step),
        "bound": bound_report(lf["bound"], lf["binstats"], lf["tokens"]),
        "checks": checks_summary(lf["checks"]),
        "diagnostics": checks_diagnostics(lf["checks"]),
    }
    if "prob_change" in run.kinds:
        tables["correct"] = correct_summary(select_steps(run["prob_change"], steps))
    if "paired" in run.kinds:
        from tokendyn.analysis.paired import paired_summary
        from tokendyn.analysis.sweep import guidance, sweep_summary

        chosen = select_steps(run["paired"], steps).collect()
        tables["paired"] = paired_summary(chosen)
        sweeps = [(sweep_summary(chosen, k), guidance(chosen, k)) for k in ("c", "eta")]
        tables["sweep"] = pl.concat([s for s, _ in sweeps if s.height], how="diagonal_relaxed") if any(
            s.height for s, _ in sweeps) else pl.DataFrame()  # fmt: skip
        tables["guidance"] = pl.concat([g for _, g in sweeps if g.height], how="diagonal_relaxed") if any(
            g.height for _, g in sweeps) else pl.DataFrame()  # fmt: skip
        from tokendyn.analysis.masked import masked_share_table

        tables["masked"] = masked_share_table(chosen)  # (empty without the rule no_correction)
    if "sampler" in run.kinds:
        from tokendyn.analysis.mismatch import mismatch_table
        from tokendyn.analysis.mismatch_seeds import first_stage  # Lopti's two stages: each token once

        tables["mismatch"] = mismatch_table(first_stage(select_steps(run["sampler"], steps, stage).collect()))
    tables.update(sampler_tables(run, steps, stage))  # the sampler's shape, the sign split
    if "floor" in run.kinds:  # the trainer against itself: the noise floor of any sampler's mismatch
        from tokendyn.analysis.mismatch import mismatch_table

        tables["floor"] = mismatch_table(select_steps(run["floor"], steps, stage)).filter(
            pl.col("side") == "pi_old"
        )
    if (
        "token_view" in run.kinds and "token_view_rules" in run.kinds
    ):  # the rules' shares at mismatched tokens
        from tokendyn.analysis.mismatch_share import mismatched_share_table

        view, rules = (select_steps(run[k], steps) for k in ("token_view", "token_view_rules"))
        tables["mismatched"] = mismatched_share_table(view, rules)
    if "notes" in run.kinds:
        tables["notes"] = notes_table(run["notes"])
    if write:
        out = Path(out_dir) if out_dir is not None else path / ANALYSIS_DIR
        out.mkdir(parents=True, exist_ok=True)
        for name, df in tables.items():
            if df.height:
                write_parquet(df, out / f"{name}.parquet")
    return tables


def notes_table(notes: pl.LazyFrame) -> pl.DataFrame:
    """One row per condition that switched a check off (`GradientProbe.note`): its code, message, first step (null:
    from the start) and the ranks that saw it."""
    return (
        notes.group_by("code", "message")
        .agg(pl.col("step").min().alias("first_step"), pl.col("rank").unique().sort().alias("ranks"))
        .sort("code")
        .collect()
    )


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"
    return str(v)


def rich_table(df: pl.DataFrame, title: str, columns: dict[str, str] | None = None) -> Table:
    """A rich table of df; `columns` maps column -> short header (missing columns are skipped)."""
    columns = columns or {c: c for c in df.columns}
    cols = [c for c in columns if c in df.columns]
    table = Table(title=title, header_style="bold")
    for c in cols:
        table.add_column(columns[c], justify="left" if df.schema[c] == pl.Utf8 else "right", no_wrap=True)
    for row in df.select(cols).iter_rows():
        table.add_row(*(_fmt(v) for v in row))
    return table


def print_report(
    tables: dict[str, pl.DataFrame], console: Console | None = None, points: str | None = None
) -> None:
    """Terminal tables: the per-bin table (the points selected by name or glob, default the final norm), the notes
    of the run (checks that were off, and why), the bound report, the checks."""
    console = console or Console()
    bins = tables["bins"]
    recorded = sorted(set(bins["point"].to_list()), key=point_order) if bins.height else []
    if points is None and recorded:
        points = FINAL_NORM if FINAL_NORM in recorded else recorded[0]
    chosen = select_names(recorded, points) if recorded else []
    point = ", ".join(chosen)
    shown = bins.filter(pl.col("point").is_in(chosen)) if recorded else bins
    shown = shown.with_columns(
        pl.format(
            "[{}, {}{}",
            pl.col("bin_lo").round(3),
            pl.col("bin_hi").round(3),
            pl.when(pl.col("bin_hi") >= 1.0).then(pl.lit("]")).otherwise(pl.lit(")")),
        ).alias("pi_old")
    )
    console.print(
        rich_table(
            shown,
            f"Per-bin table at {point}: share of tokens and ||dL/dh|| per token",
            {
                "stage": "stage",
                "step": "step",
                **({"point": "point"} if len(chosen) > 1 else {}),
                "pi_old": "pi_old",
                "tokens": "tokens",
                "share": "share",
                "norm_mean": "mean",
                "norm_p10": "p10",
                "norm_p50": "p50",
                "norm_p90": "p90",
                "norm_per_w_mean": "mean/|w|",
                "ratio_mean": "ratio",
            },
        )
    )
    bound = tables["bound"].with_columns(
        pl.col("point")
        .str.replace("layers.", "L", literal=True)
        .str.replace(".out", "", literal=True)
        .str.replace("final_norm", "final", literal=True)
    )
    console.print(
        rich_table(
            bound,
            "Bound: ratio ||delta|| / (|w|(1-pi)) in [C, D]; rho = spearman(||delta||/|w|, 1-pi)",
            {
                "stage": "stage",
                "point": "point",
                "n": "n",
                "C": "C",
                "ratio_mean": "mean",
                "D": "D",
                "spearman_mean": "rho",
                "spearman_sample": "rho smp",
                "C_direct": "C dir",
                "D_direct": "D dir",
                "spearman_direct": "rho dir",
            },
        )
    )
    for line in unreached(tables["bound"]):
        console.print(f"[red]error: {line}: its statistics are missing, not zero[/red]")
    notes = tables.get("notes")
    for code, message, first, _ranks in notes.iter_rows() if notes is not None else ():
        since = "" if first is None else f" (from step {first})"
        console.print(f"[yellow]note: {code}{since}: {message}[/yellow]")
    checks = tables["checks"]
    if not checks.height:
        console.print("no exact checks recorded (completion ids or the final norm were not probed)")
        return
    _print_by_stage(console, checks, "Exact checks at the LM head (must hold for every token)")
    total = checks_violations(checks)
    style = "green" if total == 0 else "red"
    console.print(f"[{style}]violations of the exact checks: {total}[/{style}]")
    diagnostics = tables.get("diagnostics")
    if diagnostics is not None and diagnostics.height:
        _print_by_stage(console, diagnostics, "Diagnostics: unscaled identity errors")
        console.print(DIAGNOSTICS_NOTE)
    correct = tables.get("correct")
    if correct is not None and correct.height:
        print_correct(console, correct)
    paired = tables.get("paired")
    if paired is not None and paired.height:
        print_paired(console, paired)
    for name, fn in (("sweep", print_sweep), ("guidance", print_guidance), ("mismatch", print_mismatch),
                     ("floor", print_floor), ("masked", print_masked), ("mismatched", print_mismatched)):  # fmt: skip
        frame = tables.get(name)
        if frame is not None and frame.height:
            fn(console, frame)
    print_sampler_tables(console, tables)


def print_mismatch(console: Console, mismatch: pl.DataFrame) -> None:
    """The sampler's mismatch per bin, by pi_old and by mu (`tokendyn.analysis.mismatch`)."""
    columns = {
        "bin": "bin", "count": "tokens", "mean_log_rho": "mean log rho", "abs_p50": "|log rho| p50",
        "abs_p95": "p95", "abs_p99": "p99", "envelope": "max |log rho|/(1-pi_old)", "mean_weight": "mean weight",
        "frac_masked": "masked", "frac_seq_masked": "seq masked",
    }  # fmt: skip
    for side in ("pi_old", "mu"):
        rows = mismatch.filter(pl.col("side") == side).with_columns(_bin_label())
        title = f"The sampler against the trainer (log rho = log pi_old - log mu), binned by {side}"
        console.print(rich_table(rows.select(list(columns)), title, columns))


def print_floor(console: Console, floor: pl.DataFrame) -> None:
    """The noise floor per bin: the trainer's log-probs against themselves in another micro-batch split."""
    columns = {"bin": "bin", "count": "tokens", "abs_mean": "mean |log rho|", "mean_log_rho": "mean log rho",
               "abs_p99": "p99", "abs_max": "max"}  # fmt: skip
    rows = floor.with_columns(_bin_label())
    title = "The floor: the trainer against itself (the same tokens in another micro-batch split), binned by pi_old"
    console.print(rich_table(rows.select(list(columns)), title, columns))


def print_masked(console: Console, masked: pl.DataFrame) -> None:
    """The update share the correction's mask removes per bin (`tokendyn.analysis.masked`)."""
    columns = {"mode": "mode", "bin": "bin", "units": "sequences", "masked_units": "masked", "tokens_masked":
               "tokens masked", "removed": "share removed", "removed_lo": "lo", "removed_hi": "hi",
               "of_bin": "of the bin's share", "of_bin_lo": "lo", "of_bin_hi": "hi",
               "excluded_units": "left out: no base rule"}  # fmt: skip
    title = "The correction's mask: the uncorrected update's share carried by the sequences it dropped (rule no_correction)"
    shown = [c for c in columns if c in masked.columns]  # (a table written before excluded_units)
    console.print(rich_table(masked.with_columns(_bin_label()).select(shown), title, columns))


def print_mismatched(console: Console, table: pl.DataFrame) -> None:
    """Each rule's update share at the mismatched tokens of the view (`tokendyn.analysis.mismatch_share`)."""
    columns = {"rule": "rule", "mode": "mode", "tokens": "tokens", "token_fraction": "mismatched tokens",
               "mismatched_share": "their update share", "mismatched_share_lo": "lo", "mismatched_share_hi": "hi",
               "minus_base": "minus base", "minus_base_lo": "lo", "minus_base_hi": "hi",
               "units_without_rule": "no rule", "units_without_base": "no base"}  # fmt: skip
    title = "The update share of the tokens the sampler mismatched (|log rho| > log 1.1), per rule, from the same states"
    console.print(rich_table(table, title, columns))


def _bin_label() -> pl.Expr:
    """The bin column as text: "all" for bin -1, else "[lo, hi)"."""
    label = pl.format("[{}, {})", pl.col("bin_lo"), pl.col("bin_hi"))
    return pl.when(pl.col("bin") < 0).then(pl.lit("all")).otherwise(label).alias("bin")


def _print_by_stage(console: Console, frame: pl.DataFrame, title: str) -> None:
    table = Table(title=title, header_style="bold")
    table.add_column("quantity", no_wrap=True)
    for stage in frame["stage"].to_list():
        table.add_column(stage, justify="right", no_wrap=True)
    for col in frame.columns[1:]:
        table.add_row(col, *(_fmt(v) for v in frame[col].to_list()))
    console.print(table)


def print_correct(console: Console, correct: pl.DataFrame) -> None:
    """The correct ratios per update, step size and bin, each with its ties (never counted as failures)."""
    table = Table(title="Correct ratios after the full update: rose / (rose + fell) for A > 0, fell / (rose + fell) "
                  "for A < 0; ties apart", header_style="bold")  # fmt: skip
    for col in ("update", "lr", "interval", "A>0", "ties", "A<0", "ties ", "pooled"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in correct.iter_rows(named=True):
        interval = "all" if r["bin"] < 0 else f"[{r['bin_lo']:g}, {r['bin_hi']:g})"
        table.add_row(
            r["update"],
            "" if r["lr"] is None else f"{r['lr']:g}",
            interval,
            _fmt(r["correct_pos"]),
            f"{r['tie_pos']}/{r['n_pos']}",
            _fmt(r["correct_neg"]),
            f"{r['tie_neg']}/{r['n_neg']}",
            _fmt(r["correct_pooled"]),
        )
    console.print(table)


def print_paired(console: Console, paired: pl.DataFrame) -> None:
    """The paired comparison: per rule, step size and bin, the mean change of pi, the paired difference from the
    base rule, the correct ratio and its difference, the bin's share of the update, each with its 95 % interval."""
    table = Table(title="Paired comparison from the same state: rule - base per token, 95 % bootstrap intervals over "
                  "(step, sequence)", header_style="bold")  # fmt: skip
    for col in (
        "rule",
        "mode",
        "interval",
        "tokens",
        "dpi",
        "dpi - base",
        "correct",
        "correct - base",
        "share",
    ):
        table.add_column(col, justify="right", no_wrap=True)

    def ci(r, name):
        return f"{_fmt(r[name])} [{_fmt(r[name + '_lo'])}, {_fmt(r[name + '_hi'])}]"

    for r in paired.iter_rows(named=True):
        interval = "all" if r["bin"] < 0 else f"[{r['bin_lo']:g}, {r['bin_hi']:g})"
        table.add_row(
            r["rule"], r["mode"], interval, str(r["tokens"]), ci(r, "dpi"), ci(r, "diff"), ci(r, "correct"),
            ci(r, "correct_diff"), ci(r, "share"),
        )  # fmt: skip
    console.print(table)


def _ci(r, name) -> str:
    return f"{_fmt(r[name])} [{_fmt(r[name + '_lo'])}, {_fmt(r[name + '_hi'])}]"


def print_sweep(console: Console, sweep: pl.DataFrame) -> None:
    """The sweeps: per value and bin, dpi, the correct ratios of A > 0 and A < 0 apart, the update share, the entropy
    change and the KL to the base update, each with its 95 % interval."""
    table = Table(title="Sweeps from the same states (c: A <- (1 + c (1 - pi_old)) A, c < 0 Reweight alpha = -c, "
                  "c > 0 Delta-log-p; eta: Lopti), 95 % intervals over (step, sequence)", header_style="bold")  # fmt: skip
    for col in (
        "sweep",
        "mode",
        "value",
        "interval",
        "dpi",
        "correct A>0",
        "correct A<0",
        "share",
        "dH",
        "KL base",
    ):
        table.add_column(col, justify="right", no_wrap=True)
    for r in sweep.iter_rows(named=True):
        interval = "all" if r["bin"] < 0 else f"[{r['bin_lo']:g}, {r['bin_hi']:g})"
        table.add_row(
            r["sweep"], r["mode"], f"{r['value']:g}", interval, _ci(r, "dpi"), _ci(r, "correct_pos"),
            _ci(r, "correct_neg"), _ci(r, "share"), _ci(r, "dentropy"), _ci(r, "kl"),
        )  # fmt: skip
    console.print(table)


def print_guidance(console: Console, guidance: pl.DataFrame) -> None:
    """The guidance of each sweep (`tokendyn.analysis.sweep.GUIDANCE_RULE`), then the rule itself."""
    from tokendyn.analysis.sweep import GUIDANCE_RULE

    table = Table(
        title="Guidance: where the top bin's correct ratio (A > 0) peaks along each sweep",
        header_style="bold",
    )
    for col in ("sweep", "mode", "best [95 %]", "peak", "at", "there", "values"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in guidance.iter_rows(named=True):
        table.add_row(
            r["sweep"], r["mode"], f"{_fmt(r['best'])} [{_fmt(r['best_lo'])}, {_fmt(r['best_hi'])}]",
            _ci(r, "peak"), f"{r['sweep']} = {r['at']:g}", _ci(r, "at_value"), r["values"],
        )  # fmt: skip
    console.print(table)
    console.print(GUIDANCE_RULE)
