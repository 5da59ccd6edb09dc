"""The sampler against the trainer, per probability bin (the `sampler` records of a vLLM-sampled run;
`tokendyn.analysis.mismatch`): |log rho| per bin of pi_old and of mu, its signed mean, and what TRL's correction
did to each bin (the share of its tokens in a sequence the correction zeroed)."""

from __future__ import annotations

import numpy as np
import polars as pl
from matplotlib.figure import Figure

from tokendyn.analysis.mismatch import mismatch_table
from tokendyn.figures.data import need, run_order
from tokendyn.figures.style import new_figure, offsets, run_colors, themed

HINT = "train with --use_vllm true and --probe_every N (TRL's vLLM engine records its log-probs)"


def _tables(sampler) -> tuple[list[str], dict[str, pl.DataFrame]]:
    df = need(sampler, "the sampler's mismatch per bin", ["sampler"], HINT)
    runs = run_order(df)
    return runs, {run: mismatch_table(df.filter(pl.col("run") == run).drop("run")) for run in runs}


def mismatch_by_bin(sampler) -> Figure:
    """Three panels per run (bars side by side): mean |log rho| per bin of pi_old with its p99 (tick) and the same
    binned by mu (hollow), the signed mean log rho per bin of pi_old, and the share of each bin's tokens in a
    sequence TRL's correction dropped."""
    runs, tables = _tables(sampler)
    colors = run_colors(runs)
    offs = offsets(len(runs), 0.8)
    with themed():
        fig, axes = new_figure(1, 3, w=4.6, h=3.8)
        for i, run in enumerate(runs):
            t = tables[run].filter(pl.col("bin") >= 0)
            for side, hollow in (("pi_old", False), ("mu", True)):
                r = t.filter(pl.col("side") == side).sort("bin")
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
        axes[0, 0].set_yscale("log")
        axes[0, 0].set_ylabel("mean |log ρ| (bars: by π_old; hatched: by μ; tick: p99)")
        axes[0, 1].axhline(0, color="0.3", lw=0.8)
        axes[0, 1].set_ylabel("mean log ρ = log π_old − log μ (signed)")
        axes[0, 2].set_ylabel("share of tokens in a dropped sequence")
        for ax in axes[0]:
            ax.set_xlim(0, 1)
            ax.set_xlabel("π_old interval")
        axes[0, 0].legend(fontsize=8)
    return fig


def reading(records) -> str:
    """Per run: where the mismatch is largest, how much larger than in the top bin, the (1 − π) envelope's spread
    across bins, and what the correction dropped."""
    runs, tables = _tables(records.get("sampler"))
    parts = []
    for run in runs:
        t = tables[run].filter((pl.col("side") == "pi_old") & (pl.col("bin") >= 0)).sort("bin")
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
        parts.append(
            f"{run}: mean |log ρ| largest in [{t['bin_lo'][worst]:g}, {t['bin_hi'][worst]:g}) ({means[worst]:.2e}"
            f"{ratio}){spread}; tokens in dropped sequences {100 * dropped.min():.1f}–{100 * dropped.max():.1f} % "
            "per bin"
        )
    return ("The sampling engine's log-probabilities against the trainer's π_old, per interval — " + "; ".join(parts)
            + ".")  # fmt: skip
