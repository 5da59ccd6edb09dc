"""The correct ratio as a curve of the counterfactual step size (``probe_lr_sweep``): where the paper's lr = 1e-3
SGD step (a first-order probe of the update direction) and larger, non-linear steps part ways, and how both stand
against the lr -> 0 limit the paper's theory describes (the sweep's first point, lr 0: d pi / d lr at lr = 0,
`tokendyn.effects.limit`).

Reads the ``prob_change`` rows with update "sweep" (the full update: "train", or Lopti's "lopti" after both stages);
a row with lr 0 is the limit (its delta pi columns are per unit lr), absent from records written before it was
recorded.
"""

from __future__ import annotations

import numpy as np
import polars as pl
from matplotlib.figure import Figure

from tokendyn.analysis.tables import CORRECT_COLUMNS, correct_summary
from tokendyn.figures.data import MissingRecords, need, run_order
from tokendyn.figures.style import new_figure, run_colors, run_markers, themed
from tokendyn.vocab import FULL_UPDATES

PAPER_LR = 1e-3


def sweep_table(prob_change: pl.DataFrame) -> pl.DataFrame:
    """Per run, step size and bin (-1: all tokens): the median over the probed steps of the step's ||delta theta|| /
    ||theta|| and the correct ratios (ties apart, `tokendyn.analysis.tables.correct_summary`) over those steps."""
    pc = prob_change.filter(pl.col("update") == "sweep")
    if not pc.height:
        raise MissingRecords("correct ratio along the step-size sweep", ["prob_change"], reason="no 'sweep' rows "
                             "(train with --probe_lr_sweep 1e-3 1e-2 1e-1 1)")  # fmt: skip
    out = []
    for run in run_order(pc):
        r = pc.filter(pl.col("run") == run)
        steps = r.group_by("lr").agg(pl.col("param_step").median())  # a diverging step would swamp a mean
        summary = correct_summary(r.lazy()).join(steps, on="lr", how="left")
        out.append(summary.with_columns(pl.lit(run).alias("run")))
    cols = ["run", "lr", "param_step", "bin", "bin_lo", "bin_hi", *CORRECT_COLUMNS]
    return pl.concat(out, how="diagonal_relaxed").select(cols)


def correct_vs_step(prob_change: pl.DataFrame | None) -> Figure:
    """One panel per bin of pi_old: among positive-advantage tokens rose / (rose + fell) against the SGD step size
    (log scale, the relative parameter step ||delta theta|| / ||theta|| of the first run on a second axis label),
    one line per run; the paper's lr = 1e-3 marked; binomial standard errors over the decided tokens; the lr -> 0
    limit, where recorded, a dotted line in the run's colour."""
    table = sweep_table(need(prob_change, "correct ratio along the step-size sweep", ["prob_change"]))
    table = table.filter(pl.col("bin") >= 0)
    limits = table.filter(pl.col("lr") == 0)
    table = table.filter(pl.col("lr") > 0)
    runs = run_order(table)
    colors, marks = run_colors(runs), run_markers(runs)
    bins = table.select("bin", "bin_lo", "bin_hi").unique().sort("bin").rows()
    with themed():
        fig, axes = new_figure(1, len(bins), w=3.6, h=3.6, sharey=True)
        for j, (b, lo, hi) in enumerate(bins):
            ax = axes[0, j]
            for run in runs:
                r = (
                    table.filter((pl.col("run") == run) & (pl.col("bin") == b))
                    .sort("lr")
                    .drop_nulls("correct_pos")
                )
                if not r.height:
                    continue
                p = r["correct_pos"].to_numpy()
                n = (r["n_pos"] - r["tie_pos"]).to_numpy()
                se = np.sqrt(np.clip(p * (1 - p), 0, None) / np.maximum(n, 1))
                ax.errorbar(r["lr"].to_numpy(), p, yerr=se, marker=marks[run], color=colors[run], capsize=3,
                            ms=5, lw=1.5, label=run)  # fmt: skip
                at = limits.filter((pl.col("run") == run) & (pl.col("bin") == b))["correct_pos"].drop_nulls()
                if at.len() and at[0] == at[0]:
                    ax.axhline(at[0], color=colors[run], lw=1, ls=(0, (1, 2)))
            ax.axvline(PAPER_LR, color="0.35", lw=1, ls="--")
            ax.axhline(0.5, color="0.3", lw=1, ls=":")
            ax.set_xscale("log")
            ax.set_title(f"π_old ∈ [{lo:g}, {hi:g}{']' if hi >= 1 else ')'}", fontsize=10)
            ax.set_xlabel("SGD step size (lr)")
            if j == 0:
                ax.text(PAPER_LR, 0.02, " paper: lr 1e-3", transform=ax.get_xaxis_transform(), fontsize=8,
                        color="0.3")  # fmt: skip
        axes[0, 0].set_ylabel("A > 0: rose / (rose + fell)")
        first = (
            table.filter(pl.col("run") == runs[0]).group_by("lr").agg(pl.col("param_step").first()).sort("lr")
        )
        steps = ", ".join(f"lr {lr:g}: {s:.1e}" for lr, s in first.rows() if s is not None)
        handles, labels = axes[0, 0].get_legend_handles_labels()
        fig.legend(
            handles, labels, loc="outside lower center", ncol=min(4, len(runs)), fontsize=9, frameon=False
        )
        title = "Correct ratio against the counterfactual step size"
        if limits.height:
            title += " (dotted: the lr → 0 limit)"
        if steps:
            title += f"\nmedian ‖Δθ‖/‖θ‖ of the step ({runs[0]}): {steps}"
        fig.suptitle(title, fontweight="bold", fontsize=10)
    return fig


def reading(records) -> str:
    """One sentence per run: the highest bin's correct ratio at the paper's step and at the largest step, and the
    step size where the lowest and highest bins part the most."""
    table = sweep_table(
        need(records.get("prob_change"), "correct ratio along the step-size sweep", ["prob_change"])
    )
    table = table.filter(pl.col("bin") >= 0)
    parts = []
    for run in run_order(table):
        r = table.filter(pl.col("run") == run)
        top, lrs = int(r["bin"].max()), sorted(r["lr"].unique().to_list())
        first, last = [x for x in lrs if x > 0][0], lrs[-1]

        def at(lr: float, b: int, r: pl.DataFrame = r):
            return r.filter((pl.col("lr") == lr) & (pl.col("bin") == b))["correct_pos"].first()

        limit = f" (the lr → 0 limit: {_pct(at(0.0, top))})" if lrs[0] == 0 else ""
        parts.append(
            f"{run}: π_old ≥ {r.filter(pl.col('bin') == top)['bin_lo'].first():g} — {_pct(at(first, top))} at lr "
            f"{first:g}, {_pct(at(last, top))} at lr {last:g}{limit} (lowest bin: {_pct(at(first, 0))} → "
            f"{_pct(at(last, 0))})"
        )
    return ("Positive-advantage tokens that rose, among those that moved, as the counterfactual SGD step grows — "
            + "; ".join(parts) + ".")  # fmt: skip


def _pct(x) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}%"


# ---- the lr -> 0 limit beside the finite steps ---------------------------------------------------------------------
LIMIT = "the lr → 0 limit beside the finite steps"


def limit_table(prob_change: pl.DataFrame) -> pl.DataFrame:
    """Per run, step size and bin (-1: all tokens), from the sweep's rows of a run that recorded the lr -> 0 limit
    (lr 0): the correct ratios over the probed steps (`sweep_table`) and the tokens' mean |delta pi| per unit lr,
    ``mean_abs_per_lr`` (token-weighted over the steps; the limit's mean |d pi / d lr|, a finite step's
    mean |delta pi| / lr)."""
    pc = prob_change.filter(pl.col("update") == "sweep")
    with_limit = pc.filter(pl.col("lr") == 0).get_column("run").unique().to_list() if pc.height else []
    if not with_limit:
        raise MissingRecords(LIMIT, ["prob_change"], reason="no lr → 0 limit rows (train with --probe_lr_sweep "
                             "1e-3 1e-1 1; records written before the limit was recorded have none)")  # fmt: skip
    pc = pc.filter(pl.col("run").is_in(with_limit))
    full = pc.filter(
        pl.col("update_stage").is_in(FULL_UPDATES) & (pl.col("source_bin") == -1) & (pl.col("count") > 0)
    )
    moved = full.group_by("run", "lr", "bin").agg(
        ((pl.col("mean_abs") * pl.col("count")).sum() / pl.col("count").sum()).alias("mean_abs")
    )
    per_lr = pl.when(pl.col("lr") > 0).then(pl.col("mean_abs") / pl.col("lr")).otherwise(pl.col("mean_abs"))
    table = sweep_table(pc).join(moved, on=["run", "lr", "bin"], how="left")
    return table.with_columns(per_lr.alias("mean_abs_per_lr")).sort("run", "lr", "bin")


def limit_vs_step(prob_change: pl.DataFrame | None) -> Figure:
    """Two rows of panels, one panel per bin of pi_old: the correct ratio of positive-advantage tokens (top; binomial
    standard errors over the decided tokens) and the mean |delta pi| per unit lr (bottom, log scale) against the
    step, from its lr -> 0 limit (left, "0") through the sweep's step sizes, evenly spaced; one line per run."""
    table = limit_table(need(prob_change, LIMIT, ["prob_change"])).filter(pl.col("bin") >= 0)
    runs = run_order(table)
    colors, marks = run_colors(runs), run_markers(runs)
    lrs = sorted(table["lr"].unique().to_list())
    where = {lr: i for i, lr in enumerate(lrs)}
    labels = ["0\n(limit)" if lr == 0 else f"{lr:g}" for lr in lrs]
    bins = table.select("bin", "bin_lo", "bin_hi").unique().sort("bin").rows()
    with themed():
        fig, axes = new_figure(2, len(bins), w=3.4, h=3.0, sharey="row")
        for j, (b, lo, hi) in enumerate(bins):
            top, bottom = axes[0, j], axes[1, j]
            for run in runs:
                r = table.filter((pl.col("run") == run) & (pl.col("bin") == b)).sort("lr")
                x = np.array([where[lr] for lr in r["lr"]])
                p = r["correct_pos"].to_numpy().astype(float)
                n = (r["n_pos"] - r["tie_pos"]).to_numpy().astype(float)
                se = np.sqrt(np.clip(p * (1 - p), 0, None) / np.maximum(n, 1))
                top.errorbar(x, p, yerr=se, marker=marks[run], color=colors[run], capsize=3, ms=5, lw=1.5,
                             label=run)  # fmt: skip
                bottom.plot(x, r["mean_abs_per_lr"].to_numpy().astype(float), marker=marks[run], color=colors[run],
                            ms=5, lw=1.5)  # fmt: skip
            top.axhline(0.5, color="0.3", lw=1, ls=":")
            top.set_title(f"π_old ∈ [{lo:g}, {hi:g}{']' if hi >= 1 else ')'}", fontsize=10)
            bottom.set_yscale("log")
            for ax in (top, bottom):
                ax.axvline(0.5, color="0.35", lw=1, ls="--")  # the limit apart from the finite steps
                ax.set_xticks(range(len(lrs)), labels, fontsize=8)
                if PAPER_LR in where:
                    ax.get_xticklabels()[where[PAPER_LR]].set_fontweight("bold")
            bottom.set_xlabel("SGD step size (lr)")
        axes[0, 0].set_ylabel("A > 0: rose / (rose + fell)")
        axes[1, 0].set_ylabel("mean |Δπ| / lr")
        handles, names = axes[0, 0].get_legend_handles_labels()
        fig.legend(
            handles, names, loc="outside lower center", ncol=min(4, len(runs)), fontsize=9, frameon=False
        )
        fig.suptitle("The lr → 0 limit (the paper's theory) beside the finite SGD steps (its figures: lr 1e-3)",
                     fontweight="bold", fontsize=10)  # fmt: skip
    return fig


def limit_reading(records) -> str:
    """One sentence per run: the highest and lowest bins' correct ratio and mean |delta pi| / lr at the limit and at
    the paper's lr 1e-3 (else the smallest finite step)."""
    table = limit_table(need(records.get("prob_change"), LIMIT, ["prob_change"])).filter(pl.col("bin") >= 0)
    parts = []
    for run in run_order(table):
        r = table.filter(pl.col("run") == run)
        finite = sorted(x for x in r["lr"].unique().to_list() if x > 0)
        if not finite:
            continue
        step = PAPER_LR if PAPER_LR in finite else finite[0]
        said = []
        for b in (int(r["bin"].max()), int(r["bin"].min())):

            def at(lr: float, column: str, b: int = b, r: pl.DataFrame = r):
                return r.filter((pl.col("lr") == lr) & (pl.col("bin") == b))[column].first()

            said.append(f"π_old from {at(0.0, 'bin_lo'):g}: {_pct(at(0.0, 'correct_pos'))} at the limit vs "
                        f"{_pct(at(step, 'correct_pos'))} at lr {step:g}, mean |Δπ|/lr "
                        f"{_num(at(0.0, 'mean_abs_per_lr'))} vs {_num(at(step, 'mean_abs_per_lr'))}")  # fmt: skip
        parts.append(f"{run}: " + "; ".join(said))
    return ("The correct ratio of positive-advantage tokens and the mean |Δπ| per unit lr at the lr → 0 limit and "
            "at a finite step — " + "; ".join(parts) + ".")  # fmt: skip


def _num(x) -> str:
    return "n/a" if x is None or x != x else f"{x:.3g}"
