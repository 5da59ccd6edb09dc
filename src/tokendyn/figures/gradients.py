"""Figures of the gradient per probability bin: its norm against the all-token gradient (paper Fig. 1d), a
layer-by-bin heatmap, and the update shares s_b per layer and over training steps (Lopti's stages apart).

From the ``shares`` records (g_b = gradient of the loss with the advantages zeroed outside bin b, over the
parameters; docs/definitions.md) when present; (d) and the heatmap fall back to the per-token
activation-gradient norms of ``binstats``.
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from tokendyn.figures.data import MissingRecords, bin_label, first_stage, full_loss, need, optional, run_order
from tokendyn.figures.stages import titled
from tokendyn.figures.style import (
    bin_colors,
    new_figure,
    offsets,
    run_colors,
    run_rows,
    shade_bins,
    short_point,
    themed,
)
from tokendyn.vocab import ALL_PARAMETERS, EMBEDDINGS, FINAL_NORM_GROUP, LM_HEAD, group_order

ALL = ALL_PARAMETERS


def _series(df: pl.DataFrame) -> list[tuple[str, str]]:
    """(run, stage) pairs in run order, stages in order of first step ("train", the whole loss, first on a tie)."""
    order = run_order(df)
    firsts = df.group_by("run", "stage").agg(pl.col("step").min().alias("s"))
    pairs = sorted(firsts.rows(), key=lambda r: (order.index(r[0]), r[2], r[1] != "train", r[1]))
    return [(r, s) for r, s, _ in pairs]


def _series_label(run: str, stage: str, stages_of_run: int) -> str:
    return run if stages_of_run == 1 and stage == "train" else f"{run}: stage {stage}"


def gradient_norm_by_bin(shares: pl.DataFrame | None = None, binstats: pl.DataFrame | None = None) -> Figure:
    """||g_b|| over all parameters per bin (mean ± std over steps) with ||g|| of the all-token loss as reference
    (Fig. 1d; from ``shares``); without ``shares``: the mean per-token ||dL/dh|| at the final norm per bin with the
    mean over all tokens as reference (from ``binstats``)."""
    shares, binstats = optional(shares), optional(binstats)
    if shares is not None:
        return _norm_from_shares(shares)
    if binstats is not None:
        return _norm_from_binstats(binstats)
    raise MissingRecords("gradient norm per bin", ["shares", "binstats"])


def _norm_from_shares(shares: pl.DataFrame) -> Figure:
    """Left: ||g_b|| per bin with ||g|| of all tokens (dashed); right: ||g_b|| / ||g|| of the same step, which
    takes out how large each step's gradient happens to be. Means over the recorded steps ± standard error."""
    sh = (
        full_loss(shares)
        .filter(pl.col("group") == ALL)
        .with_columns((pl.col("grad_norm") / pl.col("total_norm")).alias("rel"))
    )
    se = lambda c: (pl.col(c).std().fill_null(0) / pl.col(c).count().sqrt()).alias(f"{c}_se")  # noqa: E731
    per = (
        sh.group_by("run", "stage", "bin")
        .agg(
            pl.col("grad_norm").mean(),
            se("grad_norm"),
            pl.col("rel").mean(),
            se("rel"),
            pl.col("bin_lo").mean(),
            pl.col("bin_hi").mean(),
            pl.col("step").n_unique().alias("steps"),
        )
        .sort("bin")
    )
    runs = run_order(sh)
    colors = run_colors(runs)
    with themed():
        fig, axes = new_figure(1, 2, w=5.2, h=4.0)
        offs = offsets(len(runs), 0.3)
        edges: list[list[float]] = []
        for k, run in enumerate(runs):
            r = per.filter(pl.col("run") == run)
            b = r.filter(pl.col("bin") >= 0)
            ref = r.filter(pl.col("bin") < 0)
            lo, hi = b["bin_lo"].to_numpy(), b["bin_hi"].to_numpy()
            edges.append([*lo, *hi])
            x = (lo + hi) / 2 + np.array(offs[k]) * (hi - lo)
            c = colors[run]
            for ax, col in ((axes[0, 0], "grad_norm"), (axes[0, 1], "rel")):
                ax.errorbar(x, b[col].to_numpy(), yerr=b[f"{col}_se"].to_numpy(), fmt="-o", color=c, capsize=4,
                            ms=6, lw=1.6, label=f"{run}: loss of one interval")  # fmt: skip
            if ref.height:
                m, s_ = float(ref["grad_norm"][0]), float(ref["grad_norm_se"][0])
                axes[0, 0].axhline(m, color=c, lw=1.2, ls="--", label=f"{run}: all tokens")
                if s_ > 0:
                    axes[0, 0].axhspan(m - s_, m + s_, color=c, alpha=0.08, lw=0)
        axes[0, 1].axhline(1.0, color="0.3", lw=1.2, ls="--")
        axes[0, 1].text(0.98, 1.0, "all tokens", transform=axes[0, 1].get_yaxis_transform(), ha="right",
                        va="bottom", fontsize=8, color="0.3")  # fmt: skip
        for ax in axes[0]:
            ax.set_xlim(0, 1)
            ax.set_ylim(bottom=0)
            shade_bins(ax, edges)
            ax.set_xlabel("probability interval, π_old")
        axes[0, 1].set_ylim(0, max(1.1, float(np.nanmax(per["rel"].to_numpy())) * 1.15))
        axes[0, 0].set_ylabel("gradient norm ‖g_b‖ (all parameters)")
        axes[0, 1].set_ylabel("‖g_b‖ / ‖g‖ (same step)")
        axes[0, 0].set_title("norm of each interval's gradient", fontsize=10)
        axes[0, 1].set_title("relative to the all-token gradient", fontsize=10)
        steps = int(per["steps"].max())
        title = f"Gradient norm of each interval's loss (mean ± s.e. over {steps} step{'s' * (steps > 1)})"
        fig.suptitle(titled(title, sh, shares), fontweight="bold")
        _legend_below(fig, axes[0, 0])
    return fig


def _legend_below(fig, ax) -> None:
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=2, fontsize=8, frameon=False)


def per_token_norms(
    binstats: pl.DataFrame, point: str = "final_norm.out"
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(per (run, bin), per run) at one point: mean per-token ||dL/dh||, each token counted in the stage that
    updates it: norms summed over Lopti's stages, divided by the tokens of one stage (at the final norm a token
    outside the current stage has exactly zero gradient; a plain run has one stage)."""
    bs = binstats.filter((pl.col("quantity") == "norm") & (pl.col("point") == point))
    sums = bs.group_by("run", "bin").agg(
        pl.col("sum").sum(), pl.col("bin_lo").mean(), pl.col("bin_hi").mean()
    )
    counts = first_stage(bs).group_by("run", "bin").agg(pl.col("count").sum())
    per_bin = sums.join(counts, on=["run", "bin"]).with_columns((pl.col("sum") / pl.col("count")).alias("m"))
    all_tokens = per_bin.group_by("run").agg(
        (pl.col("sum").sum() / pl.col("count").sum()).alias("m"), pl.col("count").sum()
    )
    return per_bin.sort("run", "bin"), all_tokens


def _norm_from_binstats(binstats: pl.DataFrame) -> Figure:
    points = binstats.get_column("point").unique().to_list()
    point = "final_norm.out" if "final_norm.out" in points else sorted(points)[-1]
    per_bin, all_tokens = per_token_norms(binstats, point)
    runs = run_order(per_bin)
    colors = run_colors(runs)
    with themed():
        fig, axes = new_figure(1, 1, w=6.4, h=4.2)
        ax = axes[0, 0]
        offs = offsets(len(runs), 0.3)
        edges: list[list[float]] = []
        for k, run in enumerate(runs):
            b = per_bin.filter(pl.col("run") == run)
            lo, hi = b["bin_lo"].to_numpy(), b["bin_hi"].to_numpy()
            edges.append([*lo, *hi])
            x = (lo + hi) / 2 + np.array(offs[k]) * (hi - lo)
            ax.plot(x, b["m"].to_numpy(), "-o", color=colors[run], ms=6, lw=1.6, label=f"{run}: per interval")
            ref = all_tokens.filter(pl.col("run") == run)
            ax.axhline(float(ref["m"][0]), color=colors[run], ls="--", lw=1.2, label=f"{run}: all tokens")
        ax.set_xlim(0, 1)
        ax.set_ylim(bottom=0)
        shade_bins(ax, edges)
        ax.set_xlabel("probability interval, π_old")
        ax.set_ylabel(f"mean ‖∂L/∂h‖ per token\n({short_point(point)})")
        ax.set_title(
            titled("Per-token gradient norm per interval", binstats, why="summed over stages"), fontsize=11
        )
        _legend_below(fig, ax)
    return fig


def layer_bin_heatmap(shares: pl.DataFrame | None = None, binstats: pl.DataFrame | None = None) -> Figure:
    """Per layer (rows) and bin (columns): ||g_b|| of that layer's parameters relative to the layer's all-token
    ||g|| (``shares``); without shares: mean per-token ||dL/dh_l|| per bin relative to all tokens (``binstats``).
    One panel per run (and Lopti stage)."""
    shares, binstats = optional(shares), optional(binstats)
    if shares is not None:
        sh = full_loss(shares).filter(pl.col("group") != ALL).rename({"group": "row"})
        rel = sh.group_by("run", "stage", "row", "bin").agg(
            (pl.col("grad_norm") / pl.col("total_norm")).mean().alias("v"), pl.col("bin_lo").mean(),
            pl.col("bin_hi").mean(),
        )  # fmt: skip
        panels = _series(sh)
        what, ylabel = "‖g_b‖ / ‖g‖ of the group's parameters", "parameter group"
        key = "row"
    elif binstats is not None:
        bs = binstats.filter(pl.col("quantity") == "norm")
        agg = bs.group_by("run", "stage", "point", "point_index", "bin").agg(
            pl.col("sum").sum(), pl.col("count").sum(), pl.col("bin_lo").mean(), pl.col("bin_hi").mean()
        )
        allt = agg.group_by("run", "stage", "point").agg(
            (pl.col("sum").sum() / pl.col("count").sum()).alias("a")
        )
        rel = (
            agg.join(allt, on=["run", "stage", "point"])
            .with_columns((pl.col("sum") / pl.col("count") / pl.col("a")).alias("v"))
            .rename({"point": "row"})
        )
        panels = _series(bs)
        what, ylabel = "per-token ‖∂L/∂h_l‖ / all tokens' mean", "probe point"
        key = "point_index"
    else:
        raise MissingRecords("layer-by-bin heatmap", ["shares", "binstats"])
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    nst = {r: sum(1 for x, _ in panels if x == r) for r, _ in panels}
    with themed():
        fig, axes = new_figure(nrows, ncols, w=4.8, h=max(3.2, 0.45 * rel["row"].n_unique() + 1.6))
        for k, (run, stage) in enumerate(panels):
            ax = axes[k // ncols, k % ncols]
            r = rel.filter((pl.col("run") == run) & (pl.col("stage") == stage) & (pl.col("bin") >= 0))
            layers = _layer_order(r, key)
            bins = r.select("bin", "bin_lo", "bin_hi").group_by("bin").agg(pl.all().mean()).sort("bin")
            m = np.full((len(layers), bins.height), np.nan)
            li = {l: i for i, l in enumerate(layers)}  # noqa: E741
            bi = {b: i for i, b in enumerate(bins["bin"].to_list())}
            for lay, b, v in r.select("row", "bin", "v").iter_rows():
                m[li[lay], bi[b]] = v
            xl = [bin_label(a, c, i == bins.height - 1) for i, (_, a, c) in enumerate(bins.iter_rows())]
            yl = [short_point(x) if key == "point_index" else _short_layer(x) for x in layers]
            sns.heatmap(m, ax=ax, annot=True, fmt=".2f", cmap="mako_r", xticklabels=xl, yticklabels=yl, vmin=0,
                        cbar_kws={"label": what}, linewidths=0.5, linecolor="white")  # fmt: skip
            ax.set_title(_series_label(run, stage, nst[run]), fontsize=10)
            ax.set_xlabel("probability interval, π_old")
            ax.set_ylabel(ylabel)
            ax.tick_params(axis="x", rotation=0, labelsize=8)
            ax.tick_params(axis="y", rotation=0, labelsize=8)
        for k in range(len(panels), nrows * ncols):
            axes[k // ncols, k % ncols].set_axis_off()
        fig.suptitle(
            titled("Gradient per layer and interval", rel, shares if shares is not None else binstats),
            fontweight="bold",
        )
    return fig


def _layer_order(r: pl.DataFrame, key: str) -> list[str]:
    if key == "point_index":
        return r.select("row", "point_index").unique().sort("point_index")["row"].to_list()
    return sorted(r[key].unique().to_list(), key=group_order)


def _stack(ax, x, values: np.ndarray, colors, width: float, labels=None) -> None:
    """Diverging stacked bars: positive parts stacked up from 0, negative parts down (shares may be negative)."""
    pos_base = np.zeros(len(x))
    neg_base = np.zeros(len(x))
    for k in range(values.shape[1]):
        v = np.nan_to_num(values[:, k])
        up, down = np.clip(v, 0, None), np.clip(v, None, 0)
        ax.bar(x, up, width, bottom=pos_base, color=colors[k], edgecolor="white", lw=0.5,
               label=labels[k] if labels else None)  # fmt: skip
        ax.bar(x, down, width, bottom=neg_base, color=colors[k], edgecolor="white", lw=0.5, hatch="//")
        pos_base += up
        neg_base += down


def update_shares(shares: pl.DataFrame | None) -> Figure:
    """Projection shares s_b = <g_b, g> / ||g||^2 (they sum to 1 over the bins; a negative share pulls against the
    update, drawn hatched below 0): per parameter group (mean over steps) and over the training steps (all
    parameters), one row per run. A Lopti run with per-stage rows shows its two stages apart, each the
    decomposition of that stage loss's gradient at the start of the stage (the stage's tokens only, so its shares
    sum to 1 within the stage)."""
    sh = need(shares, "update shares", ["shares"]).filter(pl.col("bin") >= 0)
    series = _series(sh)
    runs = run_order(sh)
    stages_of = {r: [s for x, s in series if x == r] for r in runs}
    for (
        r,
        st,
    ) in stages_of.items():  # a Lopti run: its two stages, not the full loss it never steps along
        if any(s != "train" for s in st):
            stages_of[r] = [s for s in st if s != "train"]
    ncols = 2 * max(len(v) for v in stages_of.values())
    edges = sh.group_by("bin").agg(pl.col("bin_lo").mean(), pl.col("bin_hi").mean()).sort("bin")
    nb = edges.height
    colors = bin_colors(nb)
    labels = [bin_label(a, b, i == nb - 1) for i, (_, a, b) in enumerate(edges.iter_rows())]
    with themed():
        fig, axes = run_rows(runs, ncols, w=4.6, h=3.4)
        for i, run in enumerate(runs):
            for k, stage in enumerate(stages_of[run]):
                r = sh.filter((pl.col("run") == run) & (pl.col("stage") == stage))
                suffix = "" if stage == "train" else f"\nLopti stage {k + 1}: {stage}-probability tokens"
                per_layer = r.group_by("group", "bin").agg(pl.col("share").mean())
                layers = _layer_order(per_layer, "group")
                m = np.zeros((len(layers), nb))
                for lay, b, v in per_layer.iter_rows():
                    m[layers.index(lay), b] = v
                ax = axes[i, 2 * k]
                _stack(ax, np.arange(len(layers)), m, colors, 0.7)
                ax.set_xticks(np.arange(len(layers)), [_short_layer(x) for x in layers], rotation=30, ha="right",
                              fontsize=8)  # fmt: skip
                ax.axhline(0, color="0.3", lw=0.8)
                ax.set_ylabel("share of the update s_b")
                ax.set_title("per parameter group" + suffix, fontsize=10)
                overall = (
                    r.filter(pl.col("group") == ALL)
                    .pivot(on="bin", index="step", values="share")
                    .sort("step")
                )
                steps = overall["step"].to_numpy()
                vals = np.column_stack([overall[str(b)].to_numpy() if str(b) in overall.columns
                                        else np.zeros(len(steps)) for b in range(nb)])  # fmt: skip
                ax = axes[i, 2 * k + 1]
                _stack(ax, np.arange(len(steps)), vals, colors, 0.8)
                ax.set_xticks(np.arange(len(steps)), [str(s) for s in steps], fontsize=8)
                ax.axhline(0, color="0.3", lw=0.8)
                ax.set_xlabel("optimizer step")
                ax.set_title("all parameters, over training" + suffix, fontsize=10)
            for k in range(2 * len(stages_of[run]), ncols):
                axes[i, k].set_axis_off()
        handles = [Patch(color=c, label=f"π_old in {lab}") for c, lab in zip(colors, labels, strict=True)]
        handles.append(
            Patch(facecolor="white", edgecolor="0.3", hatch="//", label="negative share (against g)")
        )
        fig.legend(
            handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8.5, frameon=False
        )
        fig.suptitle(
            "Which tokens make the update: projection shares s_b = ⟨g_b, g⟩ / ‖g‖²", fontweight="bold"
        )
    return fig


def _short_layer(g: str) -> str:
    return {EMBEDDINGS: "embed", FINAL_NORM_GROUP: "final norm", LM_HEAD: "LM head", ALL: "all"}.get(
        g, g.replace("layers.", "layer ")
    )
