"""The sampler against the trainer, per probability bin (the `sampler` records of a vLLM-sampled run;
`tokendyn.analysis.mismatch`): |log rho| per bin of pi_old and of mu, its signed mean, and what TRL's correction
did to each bin (the share of its tokens in a sequence the correction zeroed); beside it the noise floor (the `floor`
records: the trainer against itself, the same tokens recomputed in another micro-batch split), which every probed TRL
run records, so a run sampled by its own ``generate`` shows its floor."""

from __future__ import annotations

import numpy as np
import polars as pl
from matplotlib.figure import Figure

from tokendyn.analysis.mismatch import mismatch_table
from tokendyn.figures.data import MissingRecords, ensure_run, run_order
from tokendyn.figures.stages import titled
from tokendyn.figures.style import new_figure, offsets, run_colors, themed

HINT = (
    "train with --probe_every N (the floor, --probe_floor true, the default) and --use_vllm true (TRL's vLLM engine "
    "records its log-probs)"
)
KINDS = ["sampler", "floor"]


def nonempty(df) -> pl.DataFrame | None:
    """The records with a run column, or None when there are none."""
    if df is None:
        return None
    df = ensure_run(df)
    return df if df.height else None


def _tables(sampler, floor) -> tuple[list[str], dict[str, pl.DataFrame], dict[str, pl.DataFrame]]:
    """(runs, run -> sampler table, run -> floor table), each table present where the run has those records."""
    s, f = nonempty(sampler), nonempty(floor)
    if s is None and f is None:
        raise MissingRecords("the sampler's mismatch per bin", KINDS, HINT)
    both = pl.concat([d.select("run") for d in (s, f) if d is not None])
    runs = run_order(both)

    def per_run(d):
        if d is None:
            return {}
        return {run: mismatch_table(d.filter(pl.col("run") == run).drop("run")) for run in runs
                if d.filter(pl.col("run") == run).height}  # fmt: skip

    return runs, per_run(s), per_run(f)


def _pi_old(table: pl.DataFrame) -> pl.DataFrame:
    return table.filter((pl.col("side") == "pi_old") & (pl.col("bin") >= 0)).sort("bin")


def mismatch_by_bin(sampler, floor=None) -> Figure:
    """Three panels per run (bars side by side): mean |log rho| per bin of pi_old with its p99 (tick), the same
    binned by mu (hatched) and the floor (triangle), the signed mean log rho per bin of pi_old, and the share of each
    bin's tokens in a sequence TRL's correction dropped. A run without a sampler shows its floor alone."""
    runs, tables, floors = _tables(sampler, floor)
    colors = run_colors(runs)
    offs = offsets(len(runs), 0.8)
    with themed():
        fig, axes = new_figure(1, 3, w=4.6, h=3.8)
        for i, run in enumerate(runs):
            t = tables.get(run)
            if t is not None:
                for side, hollow in (("pi_old", False), ("mu", True)):
                    r = t.filter((pl.col("side") == side) & (pl.col("bin") >= 0)).sort("bin")
                    lo, hi = r["bin_lo"].to_numpy(), r["bin_hi"].to_numpy()
                    width = (hi - lo) * 0.8 / len(runs)
                    x = (lo + hi) / 2 + offs[i] * (hi - lo)
                    kw = (
                        dict(facecolor="none", edgecolor=colors[run], hatch="//")
                        if hollow
                        else dict(color=colors[run])
                    )
                    if side == "pi_old":
                        axes[0, 0].bar(x, r["abs_mean"].to_numpy(), width=width, label=run, **kw)
                        axes[0, 0].plot(x, r["abs_p99"].to_numpy(), "_", color="0.2", ms=12)
                        axes[0, 1].bar(x, r["mean_log_rho"].to_numpy(), width=width, color=colors[run])
                        axes[0, 2].bar(x, r["frac_seq_masked"].to_numpy(), width=width, color=colors[run])
                    else:
                        axes[0, 0].bar(x, r["abs_mean"].to_numpy(), width=width * 0.5, **kw)
            f = floors.get(run)
            if f is not None:
                r = _pi_old(f)
                lo, hi = r["bin_lo"].to_numpy(), r["bin_hi"].to_numpy()
                x = (lo + hi) / 2 + offs[i] * (hi - lo)
                values = np.maximum(r["abs_mean"].to_numpy(), 1e-18)  # an exact 0 has no place on a log axis
                label = f"{run}: floor" if t is not None else f"{run}: floor (no sampler log-probs)"
                axes[0, 0].plot(x, values, "v", color=colors[run], ms=7, label=label)
                if t is None:
                    axes[0, 1].plot(x, r["mean_log_rho"].to_numpy(), "v", color=colors[run], ms=7)
        axes[0, 0].set_yscale("log")
        axes[0, 0].set_ylabel("mean |log ρ| (hatched: by μ; ▼ floor)")
        if not tables:
            axes[0, 2].text(0.5, 0.5, "no sampler log-probs:\nno correction applied", ha="center", va="center",
                            transform=axes[0, 2].transAxes, color="0.4")  # fmt: skip
        axes[0, 1].axhline(0, color="0.3", lw=0.8)
        axes[0, 1].set_ylabel("mean log ρ = log π_old − log μ (signed)")
        axes[0, 2].set_ylabel("share of tokens in a dropped sequence")
        for ax in axes[0]:
            ax.set_xlim(0, 1)
            ax.set_xlabel("π_old interval")
        axes[0, 0].legend(fontsize=8)
        drawn = [d.select("run", "stage") for d in (nonempty(sampler), nonempty(floor)) if d is not None]
        fig.suptitle(titled("The sampling engine against the trainer", pl.concat(drawn)), fontweight="bold")
    return fig


def _floor_text(f: pl.DataFrame) -> str:
    m = _pi_old(f)["abs_mean"].to_numpy()
    return (
        f"floor (the trainer against itself, another micro-batch split) {m.min():.1e}–{m.max():.1e} per bin"
    )


def reading(records) -> str:
    """Per run: where the mismatch is largest, how much larger than in the top bin and than the floor, the (1 − π)
    envelope's spread across bins, and what the correction dropped; a run without a sampler: its floor."""
    runs, tables, floors = _tables(records.get("sampler"), records.get("floor"))
    parts = []
    for run in runs:
        f = floors.get(run)
        if run not in tables:
            if f is not None and _pi_old(f).height:
                parts.append(
                    f"{run}: sampled by the trainer's own generate (no sampler log-probs); its {_floor_text(f)}"
                )
            continue
        t = _pi_old(tables[run])
        if t.height == 0:
            continue
        means = t["abs_mean"].to_numpy()
        worst = int(np.nanargmax(means))
        top = means[-1]
        ratio = f", {means[worst] / top:.1f}× the top bin's" if top > 0 and worst != len(means) - 1 else ""
        env = t["envelope"].drop_nulls().to_numpy()
        spread = (
            f"; max |log ρ| / (1 − π_old) from {env.min():.3g} to {env.max():.3g} across bins"
            if env.size
            else ""
        )
        dropped = t["frac_seq_masked"].to_numpy()
        floor = f"; {_floor_text(f)}" if f is not None and _pi_old(f).height else ""
        parts.append(
            f"{run}: mean |log ρ| largest in [{t['bin_lo'][worst]:g}, {t['bin_hi'][worst]:g}) ({means[worst]:.2e}"
            f"{ratio}){spread}; tokens in dropped sequences {100 * dropped.min():.1f}–{100 * dropped.max():.1f} % "
            f"per bin{floor}"
        )
    return ("The sampling engine's log-probabilities against the trainer's π_old, per interval — " + "; ".join(parts)
            + ".")  # fmt: skip
