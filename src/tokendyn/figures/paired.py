"""The paired comparison's figure: per bin of pi_old, each rule's change of pi minus the base rule's, from the same
states, with 95 % bootstrap intervals over (probed step, sequence) (`tokendyn.analysis.paired.paired_summary`)."""

from __future__ import annotations

import polars as pl
from matplotlib.figure import Figure

from tokendyn.analysis.paired import paired_summary
from tokendyn.figures.data import MissingRecords
from tokendyn.figures.style import OKABE_ITO, finish, new_figure, offsets

QUANTITIES = (("diff", "Δπ(rule) − Δπ(base) per token"), ("correct_diff", "correct ratio: rule − base"))


def summaries(paired: pl.DataFrame) -> pl.DataFrame:
    """`paired_summary` of each run's records (a ``run`` column), bins only (no all-token row)."""
    parts = [
        paired_summary(g.drop("run"), n_boot=500).with_columns(pl.lit(run).alias("run"))
        for (run,), g in paired.group_by("run", maintain_order=True)
    ]
    out = pl.concat([p for p in parts if p.height])
    return out.filter(pl.col("bin") >= 0)


def paired_differences(paired: pl.DataFrame) -> Figure:
    """One row of panels per (run, mode): the paired difference of dpi and of the correct ratio per bin, one
    marker per rule with its interval; zero is the base rule."""
    if paired is None or not paired.height:
        raise MissingRecords("paired comparison", ["paired"])
    table = summaries(paired).filter(pl.col("rule") != "base")
    keys = table.select("run", "mode").unique(maintain_order=True).rows()
    fig, axes = new_figure(len(keys), 2, squeeze=False)
    rules = table["rule"].unique(maintain_order=True).to_list()
    shift = offsets(len(rules), 0.6)
    for row, (run, mode) in enumerate(keys):
        part = table.filter((pl.col("run") == run) & (pl.col("mode") == mode))
        for col, (name, label) in enumerate(QUANTITIES):
            ax = axes[row][col]
            ax.axhline(0.0, color="#555555", lw=0.8)
            for i, rule in enumerate(rules):
                r = part.filter(pl.col("rule") == rule).sort("bin")
                if not r.height:
                    continue
                x = [b + shift[i] for b in r["bin"].to_list()]
                y = r[name].to_numpy()
                err = [y - r[f"{name}_lo"].to_numpy(), r[f"{name}_hi"].to_numpy() - y]
                ax.errorbar(
                    x, y, yerr=err, fmt="o", ms=4, capsize=3, color=OKABE_ITO[i % len(OKABE_ITO)], label=rule
                )
            bins = part.select("bin", "bin_lo", "bin_hi").unique("bin").sort("bin")
            ax.set_xticks(bins["bin"].to_list())
            ax.set_xticklabels(
                [
                    f"[{lo:g}, {hi:g}{']' if hi >= 1 else ')'}"
                    for lo, hi in bins.select("bin_lo", "bin_hi").rows()
                ]
            )
            ax.set_xlabel("π_old")
            ax.set_ylabel(label)
            ax.set_title(f"{run} · {mode}", fontsize=9)
            if row == 0 and col == 0:
                ax.legend(fontsize=8)
    return finish(fig, "Paired comparison: each rule's update against the base rule's, from the same states")


def reading(records) -> str:
    """Which rules raise the top bin's correct ratio from the same states, interval excluding zero or not."""
    from tokendyn.figures.readings import _need, num

    table = summaries(_need(records, "paired", "paired comparison")).filter(pl.col("rule") != "base")
    parts = []
    for run, mode, rule in table.select("run", "mode", "rule").unique(maintain_order=True).rows():
        r = table.filter((pl.col("run") == run) & (pl.col("mode") == mode) & (pl.col("rule") == rule))
        top = r.filter(pl.col("bin") == r["bin"].max()).row(0, named=True)
        lo, hi = top["correct_diff_lo"], top["correct_diff_hi"]
        sign = (
            "raises"
            if lo is not None and lo > 0
            else "lowers"
            if hi is not None and hi < 0
            else "does not resolve"
        )
        parts.append(
            f"{run} ({mode}): {rule} {sign} the top bin's correct ratio against the base update "
            f"({num(top['correct_diff'])} [{num(lo)}, {num(hi)}])"
        )
    return ("From the same parameters, batch and π_old, every rule's update is made and undone; the panels show its "
            "change of π minus the base rule's, per interval, with 95 % intervals over probed steps and sequences — "
            + "; ".join(parts) + ".")  # fmt: skip
