"""Training curves across runs (reward, accuracy per puzzle size) and the accuracy table (paper Fig. 3), from each
run's ``metrics.parquet`` (one row per logged step; ``rollout`` added by `load_runs`)."""

from __future__ import annotations

import math
import re

import matplotlib.pyplot as plt
import numpy as np
import polars as pl
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from tokendyn.figures.data import MissingRecords, need, run_order
from tokendyn.figures.style import new_figure, run_colors, run_markers, themed

# held-out accuracy per difficulty: K&K puzzle sizes (..._3ppl) or the arithmetic task's operand digits (..._2digit)
HELDOUT = re.compile(r"^heldout/accuracy_(\d+)(ppl|digit)$")
UNITS = {"ppl": "people", "digit": "digits"}
LAST_EVALS = 3  # the paper averages the last three checkpoints


def heldout_sizes(metrics: pl.DataFrame) -> list[tuple[str, str]]:
    """(column, label) of each difficulty's held-out accuracy, by difficulty: ("heldout/accuracy_3ppl", "3 people"),
    ("heldout/accuracy_2digit", "2 digits")."""
    found = sorted((int(m.group(1)), c, m.group(2)) for c in metrics.columns if (m := HELDOUT.match(c)))
    return [(c, f"{k} {UNITS[unit]}") for k, c, unit in found]


def _x(metrics: pl.DataFrame) -> str:
    return "rollout" if "rollout" in metrics.columns else "step"


def ema(y: np.ndarray, smoothing: float) -> np.ndarray:
    """Exponential moving average with bias correction (TensorBoard's smoothing)."""
    out, acc, w = np.empty_like(y, dtype=float), 0.0, 0.0
    for i, v in enumerate(y):
        acc = smoothing * acc + (1 - smoothing) * v
        w = smoothing * w + (1 - smoothing)
        out[i] = acc / w
    return out


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion p observed on n trials (95% for z = 1.96): (lo, hi)."""
    if n <= 0:
        return (math.nan, math.nan)
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, centre - half), min(1.0, centre + half)


def _puzzles(m: pl.DataFrame) -> int | None:
    """Held-out puzzles per size per evaluation (run.json's eval_n, a ``heldout_n`` column of the loaded metrics)."""
    if "heldout_n" not in m.columns:
        return None
    n = m["heldout_n"].drop_nulls()
    return int(n.max()) if n.len() else None


def _smoothing(n: int) -> float:
    return 0.95 if n >= 100 else 0.8 if n >= 20 else 0.0


def _accuracy_top(m: pl.DataFrame, col: str, columns: list[str]) -> float:
    """The top of an accuracy axis: a little above the best value, not always 1, so that small gaps show; every
    held-out panel on one scale, so that puzzle sizes compare."""
    same = [c for c in columns if c.startswith("heldout/")] if col.startswith("heldout/") else [col]
    best = max(float(m.get_column(c).drop_nulls().drop_nans().max() or 0.0) for c in same)
    return min(1.03, max(0.25, 1.2 * best + 0.03))


def training_curves(metrics: pl.DataFrame | None) -> Figure:
    """Training reward (raw, and EMA-smoothed when there are enough steps, as the paper), training accuracy when
    logged, and held-out accuracy per puzzle size and on average, against rollout batches (the paper's RL steps:
    Lopti takes two optimizer steps per rollout), runs overlaid."""
    m = need(metrics, "training curves", ["metrics"], "RUN_DIR/metrics.parquet")
    x = _x(m)
    sizes = heldout_sizes(m)
    panels = [("reward", "training reward")]
    acc_cols = [c for c in m.columns if c.startswith("rewards/") and "accuracy" in c and c.endswith("/mean")]
    panels += [(c, "training accuracy") for c in acc_cols[:1]]
    panels += [(col, f"held-out accuracy, {label}") for col, label in sizes]
    if len(sizes) > 1 and "heldout/accuracy" in m.columns:
        panels.append(("heldout/accuracy", "held-out accuracy, mean over sizes"))
    panels = [(c, t) for c, t in panels if c in m.columns and m[c].drop_nulls().len()]
    if not panels:
        raise MissingRecords("training curves", ["metrics"], reason="no reward or accuracy column logged")
    runs = run_order(m)
    colors = run_colors(runs)
    marks = run_markers(runs)
    ncols = min(4, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    try:
        table = accuracy_table(m)
    except MissingRecords:
        table = None
    with themed():
        top = None
        if table is None:
            fig, axes = new_figure(nrows, ncols, w=4.0, h=3.2)
        else:
            fig = plt.figure(
                figsize=(4.0 * ncols, 3.2 * nrows + 0.9 + 0.3 * table.height), layout="constrained"
            )
            top, bottom = fig.subfigures(2, 1, height_ratios=[3.2 * nrows, 0.9 + 0.3 * table.height])
            axes = top.subplots(nrows, ncols, squeeze=False)
            _draw_table(bottom.subplots(), table, colors)
        for k, (col, title) in enumerate(panels):
            ax = axes[k // ncols, k % ncols]
            for run in runs:
                d = m.filter((pl.col("run") == run) & pl.col(col).is_not_null() & pl.col(col).is_not_nan())
                d = d.sort(x)
                if not d.height:
                    continue
                xs, ys = d[x].to_numpy(), d[col].to_numpy().astype(float)
                s = _smoothing(len(ys)) if col == "reward" else 0.0
                if s:
                    ax.plot(xs, ys, color=colors[run], alpha=0.25, lw=1)
                    ax.plot(xs, ema(ys, s), color=colors[run], lw=2, label=run)
                else:
                    ax.plot(
                        xs, ys, "-", marker=marks[run], color=colors[run], lw=1.8, ms=5, alpha=0.9, label=run
                    )
                    n = _puzzles(d)
                    if (
                        col.startswith("heldout/") and n
                    ):  # 95% Wilson band: n puzzles per size (x sizes: mean)
                        n_all = n * (len(sizes) if col == "heldout/accuracy" else 1)
                        band = np.array([wilson(float(y), n_all) for y in ys])
                        ax.fill_between(xs, band[:, 0], band[:, 1], color=colors[run], alpha=0.12, lw=0)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("rollout batch (RL step)" if x == "rollout" else "optimizer step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if "accuracy" in col:
                ax.set_ylim(-0.02, _accuracy_top(m, col, [c for c, _ in panels]))
            if (
                k % ncols == 0
                or col == "reward"
                or (k > 0 and "accuracy" in col) != ("accuracy" in panels[k - 1][0])
            ):
                ax.set_ylabel("accuracy" if "accuracy" in col else "reward")
        for k in range(len(panels), nrows * ncols):
            axes[k // ncols, k % ncols].set_axis_off()
        handles, labels = axes[0, 0].get_legend_handles_labels()
        host = fig if table is None else top
        host.legend(
            handles, labels, loc="outside lower center", ncol=min(4, len(runs)), fontsize=9, frameon=False
        )
        fig.suptitle("Training curves", fontweight="bold")
    return fig


def _draw_table(ax, table: pl.DataFrame, colors: dict[str, str]) -> None:
    """The accuracy table under the curves, each run's row in its colour (as the paper's Fig. 3)."""
    ax.set_axis_off()
    cols = [c for c in table.columns if c not in ("evaluations",)]
    cells = [[_cell(v, c) for c, v in zip(cols, row, strict=True)] for row in table.select(cols).iter_rows()]
    width = min(0.95, 0.12 * (len(cols) + 2))
    tab = ax.table(cellText=cells, colLabels=[c.replace("people", "ppl") for c in cols], cellLoc="center",
                   bbox=[(1 - width) / 2, 0, width, 1])  # fmt: skip
    tab.auto_set_font_size(False)
    tab.set_fontsize(9)
    tab.auto_set_column_width(list(range(len(cols))))
    for (r, _c), cell in tab.get_celld().items():
        cell.set_edgecolor("0.85")
        if r == 0:
            cell.set_text_props(fontweight="bold")
        else:
            cell.get_text().set_color(colors.get(table["run"][r - 1], "black"))
    n = int(table["evaluations"].max() or 0)
    ax.set_title(f"held-out accuracy, mean of the last {n} evaluation{'s' * (n != 1)}", fontsize=10)


def _cell(v, col: str) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return (
            f"{v:+.1f}%"
            if "%" in col
            else f"{v:.2f}"
            if col.endswith(("people", "digits")) or col == "mean"
            else f"{v:g}"
        )
    return str(v)


def accuracy_table(metrics: pl.DataFrame | None, last: int = LAST_EVALS) -> pl.DataFrame:
    """Per run: held-out accuracy per puzzle size and its mean, averaged over the last ``last`` evaluations (as the
    paper), the number of evaluations used, and the relative gain of the mean over the plain GRPO run (when one of
    the runs is plain GRPO)."""
    m = need(metrics, "accuracy table", ["metrics"], "RUN_DIR/metrics.parquet")
    sizes = heldout_sizes(m)
    if not sizes:
        raise MissingRecords(
            "accuracy table", ["metrics"], reason="no held-out accuracy logged (eval_n = 0?)"
        )
    x = _x(m)
    rows = []
    start = m.filter(pl.col(sizes[0][0]).is_not_null() & (pl.col(x) == 0))
    if start.height:  # the evaluation before the first update: every run starts from the same policy
        row = {"run": "starting policy"}
        for col, label in sizes:
            v = start[col].drop_nulls()
            row[label] = float(v.mean()) if v.len() else None
        row["evaluations"] = 1
        rows.append(row)
    for run in run_order(m):
        d = m.filter(pl.col("run") == run)
        row: dict = {"run": run}
        evals = d.filter(pl.col(sizes[0][0]).is_not_null()).sort(x).tail(last)
        for col, label in sizes:
            v = evals[col].drop_nulls()
            row[label] = float(v.mean()) if v.len() else None
        vals = [row[label] for _, label in sizes if row[label] is not None]
        row["mean"] = sum(vals) / len(vals) if vals else None
        row["evaluations"] = evals.height
        row["at rollout" if x == "rollout" else "at step"] = float(evals[x].max()) if evals.height else None
        rows.append(row)
    n = _puzzles(m)
    for row in rows:
        vals = [row[label] for _, label in sizes if row.get(label) is not None]
        row["mean"] = sum(vals) / len(vals) if vals else None
        if n and row["mean"] is not None:  # 95% Wilson interval over every puzzle the mean pools
            lo, hi = wilson(row["mean"], n * len(vals) * max(1, row["evaluations"]))
            row["mean 95% CI"] = f"[{lo:.2f}, {hi:.2f}]"
    table = pl.DataFrame(rows, infer_schema_length=None)
    first = ["run", *(label for _, label in sizes), "mean", "mean 95% CI"]
    present = [c for c in first if c in table.columns]
    table = table.select(*(pl.col(c) for c in present), pl.exclude(present))
    base = [r for r in rows if r["run"].strip().upper() == "GRPO"]
    if base and base[0]["mean"]:
        b = base[0]["mean"]
        table = table.with_columns(((pl.col("mean") / b - 1) * 100).alias("vs GRPO (%)"))
    return table
