"""The sampler's log rho per probability bin as histograms (`tokendyn.analysis.mismatch_tail.mismatch_hist`): one
panel per interval of pi_old, the token counts of each run's `sampler` records over the fixed symmetric cells of
log rho (log-scale counts), the floor's (the `floor` records: the trainer against itself) dashed beside them, so a run
sampled by its own ``generate`` shows its floor alone; dotted, the fixed band |log rho| = log 1.1."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
from matplotlib.figure import Figure

from tokendyn.analysis.mismatch_seeds import first_stage
from tokendyn.analysis.mismatch_tail import FIXED_TAU, LOG_RHO_EDGES, N_CELLS, mismatch_hist, mismatch_tail
from tokendyn.figures.data import MissingRecords, run_order
from tokendyn.figures.sampler import HINT, KINDS, nonempty
from tokendyn.figures.stages import titled
from tokendyn.figures.style import new_figure, run_colors, themed

TICKS = (-3.0, -1.0, -0.1, -0.01, -1e-3, -1e-4, 1e-4, 1e-3, 0.01, 0.1, 1.0, 3.0)  # labelled edges


def _hists(sampler, floor) -> tuple[list[str], dict[str, pl.DataFrame], dict[str, pl.DataFrame]]:
    """(runs, run -> sampler histogram, run -> floor histogram), each where the run has those records."""
    s, f = nonempty(sampler), nonempty(floor)
    if s is None and f is None:
        raise MissingRecords("the histogram of the sampler's log rho per bin", KINDS, HINT)
    runs = run_order(pl.concat([d.select("run") for d in (s, f) if d is not None]))

    def per_run(d):
        if d is None:
            return {}
        mine = {run: d.filter(pl.col("run") == run).drop("run") for run in runs}
        return {run: mismatch_hist(first_stage(m)) for run, m in mine.items() if m.height}

    return runs, per_run(s), per_run(f)


def position(x: float, edges=LOG_RHO_EDGES) -> float:
    """Where log rho x sits on the figure's axis: cell k = #{i : e_i <= x} spans [k, k + 1), so edge e_i sits at
    i + 1 (the last edge at len(edges)); log-interpolated inside a finite cell of one sign (linear in the central
    cell); k + 0.5 inside an open outer cell (x < e_0 or x > e_last)."""
    k = sum(1 for e in edges if e <= x)
    if k == len(edges) and x == edges[-1]:
        return float(k)
    if k == 0 or k == len(edges):
        return k + 0.5
    lo, hi = edges[k - 1], edges[k]
    if lo < 0 < hi:
        return k + (x - lo) / (hi - lo)
    return k + math.log(abs(x) / abs(lo)) / math.log(abs(hi) / abs(lo))


def log_rho_histograms(sampler, floor=None) -> Figure:
    """One panel per interval of pi_old: per run the token counts over the cells of log rho (steps), the floor's
    dashed; dotted the fixed band ±log 1.1."""
    runs, hists, floors = _hists(sampler, floor)
    colors = run_colors(runs)
    x = np.arange(N_CELLS + 1)
    with themed():
        fig, axes = new_figure(1, 4, w=3.6, h=3.4, sharey=True)
        for b, ax in enumerate(axes[0]):
            for run in runs:
                for table, style, label in (
                    (hists.get(run), "-", run),
                    (floors.get(run), "--", f"{run}: floor"),
                ):
                    if table is None:
                        continue
                    rows = table.filter((pl.col("bin") == b) & pl.col("cell").is_not_null()).sort("cell")
                    if rows.height and rows["count"].sum():
                        ax.stairs(rows["count"].to_numpy(), x, color=colors[run], ls=style, lw=1.6,
                                  label=label if b == 0 else None)  # fmt: skip
            for t in (math.log(FIXED_TAU), -math.log(FIXED_TAU)):
                ax.axvline(position(t), color="0.4", ls=":", lw=1)
            ax.set_yscale("log", nonpositive="clip")
            ax.set_ylim(bottom=0.7)
            ax.set_xticks([position(t) for t in TICKS], [f"{t:g}" for t in TICKS], rotation=90, fontsize=7)
            edges = mismatch_edges(hists, floors, b)
            ax.set_title(f"π_old in {edges}", fontsize=10)
            ax.set_xlabel("log ρ = log π_old − log μ")
        axes[0, 0].set_ylabel("tokens (log scale; dashed: floor)")
        axes[0, 0].legend(fontsize=7)
        drawn = [d.select("run", "stage") for d in (nonempty(sampler), nonempty(floor)) if d is not None]
        fig.suptitle(titled("The sampler's log ρ per interval", pl.concat(drawn)), fontweight="bold")
    return fig


def mismatch_edges(hists: dict, floors: dict, b: int) -> str:
    """The interval of bin b as text, from the first table that has it."""
    for table in (*hists.values(), *floors.values()):
        r = table.filter(pl.col("bin") == b)
        if r.height:
            lo, hi = r["bin_lo"][0], r["bin_hi"][0]
            return f"[{lo:g}, {hi:g}{']' if hi >= 1 else ')'}"
    return f"bin {b}"


def reading(records) -> str:
    """Per run: the share of each interval's tokens outside the fixed band, and how many have log ρ < −1 or
    log ρ >= 1 (the cells below -1 and from 1 up)."""
    s = nonempty(records.get("sampler"))
    if s is None:
        return "No sampler log-probabilities: the panels show the floor alone (the trainer against itself)."
    parts = []
    for run in run_order(s):
        mine = first_stage(s.filter(pl.col("run") == run).drop("run"))
        tail = mismatch_tail(mine).filter((pl.col("source") == "fixed") & (pl.col("bin") >= 0)).sort("bin")
        hist = mismatch_hist(mine).filter(pl.col("bin") == -1)
        far = int(hist.filter((pl.col("edge_hi") <= -1.0) | (pl.col("edge_lo") >= 1.0))["count"].sum())
        shares = ", ".join(
            f"{100 * r['outside']:.1f} % in [{r['bin_lo']:g}, {r['bin_hi']:g}{']' if r['bin_hi'] >= 1 else ')'}"
            for r in tail.iter_rows(named=True)
            if r["outside"] is not None
        )
        parts.append(
            f"{run}: tokens with ρ outside [1/1.1, 1.1] {shares}; {far} token(s) with log ρ < −1 or ≥ 1"
        )
    return "The sampler's log ρ per interval of π_old — " + "; ".join(parts) + "."
