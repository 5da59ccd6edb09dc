"""Both camps from the same states, in one picture: every compared rule (rows, grouped by camp: the rules that tame
low-pi tokens, those that protect them, the others) x every bin of pi_old (columns), the cell coloured by the paired
difference from the base rule and marked with the side its 95 % interval lies on (`tokendyn.analysis.paired`):

    ▲  interval above 0 (the rule moves the bin's tokens up / is more often right than the base rule)
    ▼  interval below 0
    ·  interval holds 0 (not resolved)

Left panel: dpi(rule) - dpi(base) per token (colour scale: the panel's largest |difference|); right panel: correct
ratio (A > 0 and A < 0 pooled, ties apart) of the rule minus the base's. One row of panels per (run, mode)."""

from __future__ import annotations

import numpy as np
import polars as pl
from matplotlib.figure import Figure

from tokendyn.figures.data import MissingRecords, need, run_order
from tokendyn.figures.style import new_figure, themed
from tokendyn.vocab import CAMPS, RULE_CAMPS

QUANTITIES = (("diff", "Δπ(rule) − Δπ(base) per token"), ("correct_diff", "correct ratio: rule − base"))
MARKS = {"> 0": "▲", "< 0": "▼", "holds 0": "·", "no data": "?"}


def side(lo: float | None, hi: float | None) -> str:
    """Where an interval lies: "> 0", "< 0", "holds 0" or "no data"."""
    if lo is None or hi is None or not (np.isfinite(lo) and np.isfinite(hi)):
        return "no data"
    return "> 0" if lo > 0 else "< 0" if hi < 0 else "holds 0"


def camps_table(paired: pl.DataFrame | None) -> pl.DataFrame:
    """Per run, mode, camp, rule and bin (bins only): the paired differences of dpi and of the correct ratio with
    their 95 % intervals and the side each interval lies on; rules in camp order, the sweeps' points left out."""
    from tokendyn.figures.paired import summaries

    paired = need(paired, "both camps", ["paired"])
    table = summaries(paired).filter(pl.col("rule") != "base")
    if not table.height:
        raise MissingRecords("both camps", ["paired"], reason="no rule besides the base rule")
    camp = pl.col("rule").replace_strict(RULE_CAMPS, default="other")
    table = table.with_columns(
        camp.alias("camp"),
        *[
            pl.struct(f"{q}_lo", f"{q}_hi")
            .map_elements(lambda s, q=q: side(s[f"{q}_lo"], s[f"{q}_hi"]), return_dtype=pl.Utf8)
            .alias(f"{q}_side")
            for q, _ in QUANTITIES
        ],
    )
    order = {c: i for i, c in enumerate(CAMPS)}
    runs = {r: i for i, r in enumerate(run_order(table))}
    table = table.sort(
        pl.col("run").replace_strict(runs, return_dtype=pl.Int32),
        "mode",
        pl.col("camp").replace_strict(order, default=len(CAMPS), return_dtype=pl.Int32),
        "rule",
        "bin",
    )
    cols = ["run", "mode", "camp", "rule", "bin", "bin_lo", "bin_hi", "tokens"]
    return table.select(*cols, *[f"{q}{s}" for q, _ in QUANTITIES for s in ("", "_lo", "_hi", "_side")])


def both_camps(paired: pl.DataFrame | None) -> Figure:
    """The heat-map of the module docstring (`camps_table`)."""
    table = camps_table(paired)
    keys = table.select("run", "mode").unique(maintain_order=True).rows()
    with themed():
        n_rules = table["rule"].n_unique()
        fig, axes = new_figure(len(keys), 2, w=4.8, h=1.2 + 0.42 * n_rules)
        for row, (run, mode) in enumerate(keys):
            part = table.filter((pl.col("run") == run) & (pl.col("mode") == mode))
            rules = part.select("camp", "rule").unique(maintain_order=True).rows()
            bins = part.select("bin", "bin_lo", "bin_hi").unique("bin").sort("bin").rows()
            for col, (name, label) in enumerate(QUANTITIES):
                ax = axes[row][col]
                grid = np.full((len(rules), len(bins)), np.nan)
                marks = [["" for _ in bins] for _ in rules]
                for i, (_, rule) in enumerate(rules):
                    for j, (b, _, _) in enumerate(bins):
                        cell = part.filter((pl.col("rule") == rule) & (pl.col("bin") == b))
                        if cell.height:
                            r = cell.row(0, named=True)
                            grid[i, j] = np.nan if r[name] is None else r[name]
                            marks[i][j] = MARKS[r[f"{name}_side"]]
                scale = float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0
                image = ax.imshow(grid, cmap="RdBu_r", vmin=-scale, vmax=scale or 1.0, aspect="auto")
                for i in range(len(rules)):
                    for j in range(len(bins)):
                        if marks[i][j]:
                            ax.text(j, i, marks[i][j], ha="center", va="center", fontsize=12, color="black")
                ax.set_xticks(
                    range(len(bins)),
                    [f"[{lo:g}, {hi:g}{']' if hi >= 1 else ')'}" for _, lo, hi in bins],
                    rotation=30,
                    ha="right",
                    fontsize=8,
                )
                ax.set_yticks(range(len(rules)), [f"{camp} · {rule}" for camp, rule in rules])
                for i in range(1, len(rules)):  # a line between camps
                    if rules[i][0] != rules[i - 1][0]:
                        ax.axhline(i - 0.5, color="black", lw=1.5)
                ax.set_xlabel("π_old")
                ax.set_title(f"{run} · {mode}\n{label}", fontsize=9)
                ax.grid(False)
                fig.colorbar(image, ax=ax, shrink=0.8)
        fig.suptitle(
            "Both camps from the same states: ▲ / ▼ the 95 % interval above / below 0, · it holds 0",
            fontweight="bold",
            fontsize=10,
        )
    return fig


def reading(records) -> str:
    """Per run and mode: which rules move which bins up or down beyond their intervals, camp by camp."""
    table = camps_table(records.get("paired"))
    parts = []
    for run, mode in table.select("run", "mode").unique(maintain_order=True).rows():
        part = table.filter((pl.col("run") == run) & (pl.col("mode") == mode))
        said = []
        for camp, rule in part.select("camp", "rule").unique(maintain_order=True).rows():
            r = part.filter(pl.col("rule") == rule)
            up = [
                f"[{lo:g}, {hi:g}"
                for lo, hi, s in r.select("bin_lo", "bin_hi", "diff_side").rows()
                if s == "> 0"
            ]
            down = [
                f"[{lo:g}, {hi:g}"
                for lo, hi, s in r.select("bin_lo", "bin_hi", "diff_side").rows()
                if s == "< 0"
            ]
            moved = "; ".join(x for x in (f"up in {', '.join(up)}" if up else "", f"down in {', '.join(down)}"
                                           if down else "") if x) or "no bin resolved"  # fmt: skip
            said.append(f"{rule} ({camp}): {moved}")
        parts.append(f"{run} ({mode}): " + " — ".join(said))
    return ("Each rule's update against the base rule's from the same parameters, batch and π_old, per interval of "
            "π_old (Δπ per token, 95 % intervals over probed steps × sequences): " + "; ".join(parts) + ".")  # fmt: skip
