"""The correct ratio as a curve of the counterfactual step size (``probe_lr_sweep``): where the paper's lr = 1e-3
SGD step (a first-order probe of the update direction) and larger, non-linear steps part ways.

Reads the ``prob_change`` rows with update "sweep" (the full update: "train", or Lopti's "lopti" after both stages).
"""

from __future__ import annotations

import numpy as np
import polars as pl
from matplotlib.figure import Figure

from tokendyn.analysis.tables import CORRECT_COLUMNS, correct_summary
from tokendyn.figures.data import MissingRecords, need, run_order
from tokendyn.figures.style import new_figure, run_colors, run_markers, themed

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
    one line per run; the paper's lr = 1e-3 marked; binomial standard errors over the decided tokens."""
    table = sweep_table(need(prob_change, "correct ratio along the step-size sweep", ["prob_change"]))
    table = table.filter(pl.col("bin") >= 0)
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
        first, last = lrs[0], lrs[-1]

        def at(lr: float, b: int, r: pl.DataFrame = r):
            return r.filter((pl.col("lr") == lr) & (pl.col("bin") == b))["correct_pos"].first()

        parts.append(
            f"{run}: π_old ≥ {r.filter(pl.col('bin') == top)['bin_lo'].first():g} — {_pct(at(first, top))} at lr "
            f"{first:g}, {_pct(at(last, top))} at lr {last:g} (lowest bin: {_pct(at(first, 0))} → {_pct(at(last, 0))})"
        )
    return ("Positive-advantage tokens that rose, among those that moved, as the counterfactual SGD step grows — "
            + "; ".join(parts) + ".")  # fmt: skip


def _pct(x) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}%"
