"""The axis through both camps drawn: per sweep (c: A <- (1 + c (1 - pi_old)) A, c < 0 tames low-pi tokens, c > 0
protects them; eta: Lopti), each measured quantity against the swept value, one line per bin of pi_old with its 95 %
band (`tokendyn.analysis.sweep.sweep_summary`); the guidance's value and interval shaded on the correct-ratio
panels (`tokendyn.analysis.sweep.guidance`)."""

from __future__ import annotations

import polars as pl
from matplotlib.figure import Figure

from tokendyn.analysis.sweep import guidance, sweep_summary
from tokendyn.figures.data import MissingRecords, need, run_order
from tokendyn.figures.style import bin_colors, new_figure, themed

QUANTITIES = (
    ("correct_pos", "correct ratio, A > 0"),
    ("correct_neg", "correct ratio, A < 0"),
    ("dpi", "Δπ per token"),
    ("share", "update share"),
    ("dentropy", "entropy change per token"),
    ("kl", "KL(π_base ‖ π) per token"),
)
AXES = {"c": "c  (← tames low-π · protects low-π →)", "eta": "Lopti's η"}
N_BOOT = 500


def _per_run(paired: pl.DataFrame, fn, sweep: str) -> pl.DataFrame:
    parts = [
        fn(g.drop("run"), sweep, n_boot=N_BOOT).with_columns(pl.lit(run).alias("run"))
        for (run,), g in paired.group_by("run", maintain_order=True)
    ]
    parts = [p for p in parts if p.height]
    return pl.concat(parts, how="diagonal_relaxed") if parts else pl.DataFrame()


def axis_tables(paired: pl.DataFrame | None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(sweep summary, guidance) of every run and sweep, a ``run`` column first."""
    paired = need(paired, "sweep through both camps", ["paired"])
    summary = [_per_run(paired, sweep_summary, k) for k in AXES]
    guide = [_per_run(paired, guidance, k) for k in AXES]
    summary = [s for s in summary if s.height]
    if not summary:
        raise MissingRecords("sweep through both camps", ["paired"], reason="no sweep rows (train with "
                             "--probe_compare_c_sweep -0.5 -0.3 0 0.1 0.2, or tokendyn probe --compare_c_sweep ...)")  # fmt: skip
    guide = [g for g in guide if g.height]
    return (
        pl.concat(summary, how="diagonal_relaxed").select("run", pl.exclude("run")),
        pl.concat(guide, how="diagonal_relaxed").select("run", pl.exclude("run"))
        if guide
        else pl.DataFrame(),
    )


def sweep_curves(paired: pl.DataFrame | None) -> Figure:
    """One column per (run, sweep, mode), one row per quantity; x the swept value, a line per bin with its band."""
    summary, guide = axis_tables(paired)
    summary = summary.filter(pl.col("bin") >= 0)
    runs = run_order(summary)
    keys = [k for r in runs for k in summary.filter(pl.col("run") == r).select("run", "sweep", "mode")
            .unique(maintain_order=True).rows()]  # fmt: skip
    bins = summary.select("bin", "bin_lo", "bin_hi").unique("bin").sort("bin").rows()
    colors = bin_colors(len(bins))
    with themed():
        fig, axes = new_figure(len(QUANTITIES), len(keys), w=4.2, h=2.5, sharex="col")
        for col, (run, sweep, mode) in enumerate(keys):
            part = summary.filter(
                (pl.col("run") == run) & (pl.col("sweep") == sweep) & (pl.col("mode") == mode)
            )
            g = guide.filter((pl.col("run") == run) & (pl.col("sweep") == sweep) & (pl.col("mode") == mode)) if \
                guide.height else guide  # fmt: skip
            for row, (name, label) in enumerate(QUANTITIES):
                ax = axes[row][col]
                for k, (b, lo, hi) in enumerate(bins):
                    r = part.filter(pl.col("bin") == b).sort("value")
                    if not r.height:
                        continue
                    x = r["value"].to_numpy()
                    ax.plot(x, r[name].to_numpy(), "o-", color=colors[k], ms=4, lw=1.4,
                            label=f"π_old ∈ [{lo:g}, {hi:g}{']' if hi >= 1 else ')'}")  # fmt: skip
                    ax.fill_between(x, r[f"{name}_lo"].to_numpy(), r[f"{name}_hi"].to_numpy(), color=colors[k],
                                    alpha=0.15, lw=0)  # fmt: skip
                if sweep == "c":
                    ax.axvline(0.0, color="0.3", lw=1, ls="--")
                if name == "correct_pos" and g.height and g["best"][0] is not None:
                    best, blo, bhi = g.row(0, named=True)["best"], g["best_lo"][0], g["best_hi"][0]
                    ax.axvspan(blo, bhi, color="0.85", zorder=0)
                    ax.axvline(best, color="black", lw=1.2)
                if name.startswith("correct"):
                    ax.axhline(0.5, color="0.3", lw=1, ls=":")
                ax.set_ylabel(label, fontsize=8)
                if row == 0:
                    ax.set_title(f"{run} · {sweep} · {mode}", fontsize=9)
                if row == len(QUANTITIES) - 1:
                    ax.set_xlabel(AXES[sweep])
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncol=len(bins), fontsize=8, frameon=False)
        fig.suptitle("Along the axis from the same states (dashed: c = 0, the base rule; black: the guidance's value, "
                     "grey: its 95 % interval)", fontweight="bold", fontsize=10)  # fmt: skip
    return fig


def guidance_table(records) -> pl.DataFrame:
    """The guidance of every run and sweep (`tokendyn.analysis.sweep.GUIDANCE_RULE`)."""
    _, guide = axis_tables(records.get("paired"))
    if not guide.height:
        raise MissingRecords("guidance", ["paired"], reason="no sweep rows")
    return guide


def reading(records) -> str:
    """The guidance, stated as its rule and measured."""
    from tokendyn.figures.readings import num

    guide = guidance_table(records)
    parts = [
        f"{r['run']} ({r['mode']}): every swept {r['sweep']} ties (top-bin correct ratio {num(r['peak'])}): the "
        "statistic tells none from another"
        if r.get("tied") and r["tied"] == len(r["values"].split(","))
        else f"{r['run']} ({r['mode']}): {r['sweep']}* = {num(r['best'])} [{num(r['best_lo'])}, "
        f"{num(r['best_hi'])}], top-bin correct ratio {num(r['peak'])} there against {num(r['at_value'])} at "
        f"{r['sweep']} = {r['at']:g}"
        for r in guide.iter_rows(named=True)
    ]
    return ("Where the top π_old bin's correct ratio of positive-advantage tokens peaks along each sweep, every "
            "value's update made from the same states at equal ‖Δθ‖ (the value's 95 % interval: the argmax over "
            "resamples of probed steps × sequences) — " + "; ".join(parts) + ".")  # fmt: skip
