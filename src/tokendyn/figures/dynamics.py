"""Figures of what an update does to the tokens' probabilities: delta pi per bin after the full update (paper
Fig. 1c), the isolation panels (Fig. 1e/f) and the whole influence matrix, the correct ratio per bin (Fig. 2b).

All read the rebalancing records (``prob_change``, ``influence``); a Lopti run's full update is its "lopti" (both
stages), a plain run's "train" (`tokendyn.vocab`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import polars as pl
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from tokendyn.figures.data import MissingRecords, bin_label, need, optional, run_order
from tokendyn.figures.stages import titled
from tokendyn.figures.style import new_figure, offsets, run_colors, run_markers, shade_bins, themed
from tokendyn.vocab import FULL_UPDATES, HIGH, LOW, TRAIN

QS = ("q01", "q05", "q25", "q50", "q75", "q95", "q99")
FULL_STAGES = FULL_UPDATES  # the full update: both Lopti stages, else the single update


def full_update(prob_change: pl.DataFrame, update: str | None = "counterfactual") -> pl.DataFrame:
    """Rows of the full update per run: source all tokens (-1), the given kind of update (fallback: whatever the
    run has), update_stage "lopti" where present, else "train"."""
    pc = prob_change.filter(pl.col("source_bin") == -1)
    out = []
    for run in run_order(pc):
        r = pc.filter(pl.col("run") == run)
        kinds = r.get_column("update").unique().to_list()
        kind = (
            update
            if update in kinds
            else ("counterfactual" if "counterfactual" in kinds else sorted(kinds)[0])
        )
        r = r.filter(pl.col("update") == kind)
        stages = r.get_column("update_stage").unique().to_list()
        stage = next((s for s in FULL_STAGES if s in stages), sorted(stages)[0])
        out.append(r.filter(pl.col("update_stage") == stage))
    return pl.concat(out, how="diagonal_relaxed") if out else pc.clear()


def pooled_change(prob_change: pl.DataFrame, update: str | None = "counterfactual") -> pl.DataFrame:
    """Per (run, bin; bin -1 = all tokens) over the steps of the full update: tokens, count-weighted mean of the
    mean, mean |delta pi| and the quantiles, and the correct ratios pooled (correct counts summed over steps, each
    step weighted by its decided tokens: n - ties). Ties are summed beside them (records written before ties were
    counted have none: their ratios counted a tie as a failure)."""
    full = (
        full_update(prob_change, update)
        .filter(pl.col("count") > 0)
        .with_columns(pl.col("tie_pos", "tie_neg").fill_null(0))
    )
    full = full.with_columns(
        (pl.col("n_pos") - pl.col("tie_pos")).alias("d_pos"),
        (pl.col("n_neg") - pl.col("tie_neg")).alias("d_neg"),
    ).with_columns((pl.col("d_pos") + pl.col("d_neg")).alias("d_signed"))
    wmean = lambda c: ((pl.col(c) * pl.col("count")).sum() / pl.col("count").sum()).alias(c)  # noqa: E731

    def ratio(c: str, n: str) -> pl.Expr:
        ok = pl.col(c).is_not_null() & pl.col(c).is_not_nan() & (pl.col(n) > 0)
        num = (pl.col(c) * pl.col(n)).filter(ok).sum()
        den = pl.col(n).filter(ok).sum()
        return pl.when(den > 0).then(num / den).otherwise(None).alias(c)

    return (
        full.group_by("run", "bin")
        .agg(
            pl.col("update").first(),
            pl.col("update_stage").first(),
            pl.col("lr").first(),
            pl.col("step").n_unique().alias("steps"),
            pl.col("bin_lo").mean(),
            pl.col("bin_hi").mean(),
            pl.col("count").sum().alias("tokens"),
            *[wmean(c) for c in ("mean", "mean_abs", *QS)],
            pl.col("min").min(),
            pl.col("max").max(),
            pl.col("n_pos").sum(),
            pl.col("n_neg").sum(),
            pl.col("tie_pos").sum(),
            pl.col("tie_neg").sum(),
            ratio("correct_pos", "d_pos"),
            ratio("correct_neg", "d_neg"),
            ratio(
                "correct_pooled", "d_signed"
            ),  # a step without decided tokens in the bin (NaN) adds nothing
        )
        .sort("run", "bin")
    )


def _update_note(df: pl.DataFrame) -> str:
    kinds = df.get_column("update").unique().to_list()
    lrs = [x for x in df.get_column("lr").unique().to_list() if x is not None]
    if kinds == ["counterfactual"]:
        return f"counterfactual SGD step, lr = {lrs[0]:g}" if len(lrs) == 1 else "counterfactual SGD step"
    if kinds == ["real"]:
        return "the real training update"
    return "update: " + ", ".join(kinds)


def prob_change_by_bin(prob_change: pl.DataFrame | None, token_shares: pl.DataFrame | None = None) -> Figure:
    """Delta pi = pi_after - pi_before per bin of pi_old after one update with all tokens (Fig. 1c): box q25..q75,
    median, whiskers q01..q99 (the top and bottom 1 % left out, as the paper), pooled over the recorded steps; the
    sampled tokens' delta pi (``token_shares``) as violins behind when recorded. Runs side by side in each bin."""
    pc = need(prob_change, "probability change per bin", ["prob_change"])
    pooled = pooled_change(pc).filter(pl.col("bin") >= 0)
    if not pooled.height:
        raise MissingRecords("probability change per bin", ["prob_change"], reason="no full-update rows")
    runs = run_order(pooled)
    colors = run_colors(runs)
    ts = optional(token_shares)
    if ts is not None:
        ts = ts.drop_nulls("delta_pi") if "delta_pi" in ts.columns else None
    with themed():
        fig, axes = new_figure(1, 1, w=max(6.4, 2.0 + 1.4 * len(runs) * 2), h=4.2)
        ax = axes[0, 0]
        offs = offsets(len(runs), 0.78)
        edges = []
        for i, run in enumerate(runs):
            r = pooled.filter(pl.col("run") == run).sort("bin")
            lo, hi = r["bin_lo"].to_numpy(), r["bin_hi"].to_numpy()
            edges.append([*lo, *hi])
            pos = (lo + hi) / 2 + np.array(offs[i]) * (hi - lo)
            width = (hi - lo) * 0.78 / len(runs)
            if ts is not None:
                t = ts.filter(pl.col("run") == run)
                for b, p, wd in zip(r["bin"].to_list(), pos, width, strict=True):
                    v = t.filter(pl.col("bin") == b)["delta_pi"].to_numpy()
                    if v.size > 2 and np.ptp(v) > 0:
                        lo_q, hi_q = np.quantile(v, [0.01, 0.99])
                        parts = ax.violinplot(v[(v >= lo_q) & (v <= hi_q)], [p], widths=wd * 0.95,
                                              showextrema=False)  # fmt: skip
                        for body in parts["bodies"]:
                            body.set(facecolor=colors[run], alpha=0.25, edgecolor=colors[run])
            _boxes(ax, r, pos, width * 0.55, colors[run])
        ax.axhline(0, color="0.4", lw=0.8)
        ax.set_xlim(0, 1)
        shade_bins(ax, edges)
        ax.set_xlabel("probability interval of the sampled token, π_old")
        ax.set_ylabel("probability change Δπ = π_after − π_before")
        title = f"Probability change after one update with all tokens\n({_update_note(pooled)})"
        ax.set_title(titled(title, pooled, pc, column="update_stage"), fontsize=11)
        handles = [Patch(color=colors[r], label=r) for r in runs]
        if ts is not None:
            handles.append(Patch(color="0.6", alpha=0.3, label="violin: sampled tokens"))
        ax.legend(handles=handles, fontsize=8, loc="upper right")
    return fig


def _pooled_influence(influence: pl.DataFrame) -> pl.DataFrame:
    """Per (run, update_stage, source, target) over the steps: tokens, and the count-weighted means of mean |delta pi|,
    mean and the quantiles of delta pi."""
    inf = influence.filter(pl.col("count") > 0)

    def wmean(c: str) -> pl.Expr:  # rows without the value (records of an older version) weigh nothing
        ok = pl.col(c).is_not_null()
        return ((pl.col(c) * pl.col("count")).filter(ok).sum() / pl.col("count").filter(ok).sum()).alias(c)

    return (
        inf.group_by("run", "update_stage", "source_bin", "target_bin")
        .agg(
            pl.col("source_lo").mean(),
            pl.col("source_hi").mean(),
            pl.col("target_lo").mean(),
            pl.col("target_hi").mean(),
            pl.col("lr").first(),
            pl.col("count").sum().alias("tokens"),
            pl.col("source_count").sum(),
            *[wmean(c) for c in ("mean_abs", "mean", *QS)],
        )
        .sort("run", "update_stage", "source_bin", "target_bin")
    )


def _boxes(ax, rows: pl.DataFrame, pos, width, face: str | Sequence[str], *, alpha: float = 0.75,
           edge: str = "0.2") -> None:  # fmt: skip
    """One box per row of quantile columns: q25..q75, median, whiskers q01..q99 (the top and bottom 1 % left out,
    as the paper's violins)."""
    faces = [face] * rows.height if isinstance(face, str) else list(face)
    stats = [
        dict(med=q50, q1=q25, q3=q75, whislo=q01, whishi=q99, fliers=[], label="")
        for q01, q25, q50, q75, q99 in rows.select("q01", "q25", "q50", "q75", "q99").iter_rows()
    ]
    parts = ax.bxp(stats, positions=list(pos), widths=width, patch_artist=True, manage_ticks=False,
                   boxprops=dict(alpha=alpha, edgecolor=edge), medianprops=dict(color="black", lw=1.4),
                   whiskerprops=dict(color=edge), capprops=dict(color=edge))  # fmt: skip
    for box, fc in zip(parts["boxes"], faces, strict=True):
        box.set_facecolor(fc)


HOT, COLD = "#d6604d", "#4393c3"  # the paper's updated (red) and frozen (blue) intervals


def isolation(influence: pl.DataFrame | None, *, sources: Sequence[int] | None = None) -> Figure:
    """Delta pi per target bin after an update restricted to one source bin (Fig. 1e: the lowest bin, Fig. 1f: the
    highest; ``sources`` to choose): boxes q25..q75 with the median, whiskers q01..q99, red in the updated interval
    and blue in the frozen ones (which ideally do not move); grey boxes beside them: the update with all tokens of
    the same stage (Fig. 1c). Quantiles are pooled over the steps as token-weighted means of the per-step
    quantiles. One row per run, one y scale for the whole figure."""
    inf = need(influence, "isolation panels", ["influence"])
    if "q50" not in inf.columns or inf["q50"].null_count() == inf.height:
        raise MissingRecords(
            "isolation panels",
            ["influence"],
            reason="the influence records hold no Δπ quantiles (written by an older tokendyn; rerun the analyses)",
        )
    pooled = _pooled_influence(inf)
    runs = run_order(pooled)
    bins = sorted(b for b in pooled.get_column("source_bin").unique().to_list() if b >= 0)
    if not bins:
        raise MissingRecords(
            "isolation panels", ["influence"], reason="no update restricted to one bin recorded"
        )
    srcs = list(sources) if sources is not None else sorted({bins[0], bins[-1]})
    from tokendyn.figures.style import run_rows

    targets = pooled.filter(pl.col("target_bin") >= 0)
    drawn = targets.filter(pl.col("source_bin").is_in([-1, *srcs]))  # the scale of what is drawn
    ylim = float(max(drawn["q99"].abs().max() or 0, drawn["q01"].abs().max() or 0)) * 1.15 or 1.0
    with themed():
        fig, axes = run_rows(runs, len(srcs), w=4.4, h=3.4)
        for i, run in enumerate(runs):
            r = targets.filter(pl.col("run") == run)
            for j, src in enumerate(srcs):
                ax = axes[i, j]
                rows = r.filter(pl.col("source_bin") == src)
                stages = rows.get_column("update_stage").unique().to_list()
                if not stages:
                    ax.text(0.5, 0.5, f"no tokens in source bin {src}", ha="center", va="center",
                            transform=ax.transAxes)  # fmt: skip
                    ax.set_axis_off()
                    continue
                stage = TRAIN if TRAIN in stages else sorted(stages)[0]
                rows = rows.filter(pl.col("update_stage") == stage).sort("target_bin")
                ref = r.filter((pl.col("source_bin") == -1) & (pl.col("update_stage") == stage))
                ref = ref.join(rows.select("target_bin"), on="target_bin", how="semi").sort("target_bin")
                lo, hi = rows["target_lo"].to_numpy(), rows["target_hi"].to_numpy()
                s_lo, s_hi = float(rows["source_lo"][0]), float(rows["source_hi"][0])
                hot = [math.isclose(a, s_lo) and math.isclose(b, s_hi) for a, b in zip(lo, hi, strict=True)]
                for a, b, h in zip(lo, hi, hot, strict=True):
                    ax.axvspan(a, b, color=HOT if h else COLD, alpha=0.08, lw=0)
                w = hi - lo
                _boxes(ax, rows, (lo + hi) / 2 - 0.14 * w, 0.3 * w, [HOT if h else COLD for h in hot])
                if ref.height == rows.height:
                    _boxes(ax, ref, (lo + hi) / 2 + 0.2 * w, 0.2 * w, "0.75", alpha=0.9, edge="0.45")
                ax.axhline(0, color="0.4", lw=0.8)
                ax.set_xlim(0, 1)
                ax.set_ylim(-ylim, ylim)
                where = "" if stage == TRAIN else f", {_stage_title(stage)}"
                ax.set_title(f"update only π_old in {bin_label(s_lo, s_hi, s_hi >= 1)}{where}", fontsize=10)
                ax.set_xlabel("π_old of the measured tokens")
                ax.set_ylabel("probability change Δπ" if j == 0 else "")
        handles = [Patch(color=HOT, alpha=0.75, label="updated interval"),
                   Patch(color=COLD, alpha=0.75, label="frozen intervals (ideally Δπ = 0)"),
                   Patch(facecolor="0.75", edgecolor="0.45", label="all tokens updated (Lopti: all of the stage's)")]  # fmt: skip
        fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8.5, frameon=False)
        fig.suptitle(f"Isolation: Δπ after updating one interval only\n{_lr_note(pooled)}; boxes q25–q75, "
                     "whiskers q01–q99", fontweight="bold")  # fmt: skip
    return fig


def _stage_title(update_stage: str) -> str:
    """ "low" -> "low stage" (a counterfactual update restricted to one Lopti stage's tokens)."""
    return f"{update_stage} stage" if update_stage in (LOW, HIGH) else update_stage


def _lr_note(pooled: pl.DataFrame) -> str:
    lrs = [x for x in pooled.get_column("lr").unique().to_list() if x is not None]
    return f"SGD step, lr = {lrs[0]:g}" if len(lrs) == 1 else "counterfactual update"


def influence_matrix(influence: pl.DataFrame | None) -> Figure:
    """Heatmap M[source bin, target bin] = mean |delta pi| over the target bin's tokens after an update with only the
    source bin's tokens (row "all": every token), one panel per run (and per Lopti stage)."""
    inf = need(influence, "influence matrix", ["influence"])
    pooled = _pooled_influence(inf)
    order = run_order(pooled)
    panels = sorted(
        pooled.select("run", "update_stage").unique().rows(), key=lambda p: (order.index(p[0]), p[1])
    )
    nrows, ncols = grid_shape(len(panels))
    mats = [_influence_panel(pooled, run, stage) for run, stage in panels]
    top = max((float(np.nanmax(m)) for m, _, _ in mats if np.isfinite(m).any()), default=0.0)
    exp = math.floor(math.log10(top)) if top > 0 else 0
    with themed():
        fig, axes = new_figure(nrows, ncols, w=4.2, h=3.6)
        for k, ((run, stage), (m, slab, tlab)) in enumerate(zip(panels, mats, strict=True)):
            ax = axes[k // ncols, k % ncols]
            sns.heatmap(m / 10.0**exp, ax=ax, annot=True, fmt=".2g", cmap="rocket_r", xticklabels=tlab,
                        yticklabels=slab, linewidths=0.5, linecolor="white", vmin=0.0, vmax=top / 10.0**exp,
                        cbar=False)  # fmt: skip
            ax.set_xlabel("measured tokens (target), π_old")
            ax.set_ylabel("updated tokens (source)")
            ax.set_title(run if stage == TRAIN else f"{run}: {_stage_title(stage)}", fontsize=10)
            ax.tick_params(axis="x", rotation=0, labelsize=8)
            ax.tick_params(axis="y", rotation=0, labelsize=8)
        for k in range(len(panels), nrows * ncols):
            fig.delaxes(axes[k // ncols, k % ncols])
        used = [axes[k // ncols, k % ncols] for k in range(len(panels))]
        label = "mean |Δπ|" + (f" (×$10^{{{exp}}}$)" if exp else "")
        fig.colorbar(used[0].collections[0], ax=used, label=label, shrink=0.9)
        fig.suptitle("Influence matrix: who moves whom (one colour scale)", fontweight="bold")
    return fig


def grid_shape(n: int, max_cols: int = 3) -> tuple[int, int]:
    """(rows, cols) for n panels: the fewest rows, then the fewest empty cells (4 panels: 2 x 2, not 2 x 3)."""
    best = min(range(1, min(max_cols, n) + 1), key=lambda c: (math.ceil(n / c), -n % c))
    return math.ceil(n / best), best


def _influence_panel(pooled: pl.DataFrame, run: str, stage: str) -> tuple[np.ndarray, list[str], list[str]]:
    """M[source, target] of one run and stage, with the row (source) and column (target) labels."""
    r = pooled.filter(
        (pl.col("run") == run) & (pl.col("update_stage") == stage) & (pl.col("target_bin") >= 0)
    )
    tl = r.select("target_bin", "target_lo", "target_hi").unique().sort("target_bin")
    sl = r.select("source_bin", "source_lo", "source_hi").unique().sort("source_bin")
    nt = tl.height
    tlab = [bin_label(a, b, i == nt - 1) for i, (_, a, b) in enumerate(tl.iter_rows())]
    every = "all" if stage == TRAIN else "all of the stage"
    slab = [every if s < 0 else bin_label(a, b, b >= 1) for s, a, b in sl.iter_rows()]
    m = np.full((sl.height, nt), np.nan)
    si = {s: i for i, s in enumerate(sl["source_bin"].to_list())}
    ti = {t: i for i, t in enumerate(tl["target_bin"].to_list())}
    for s, t, v in r.select("source_bin", "target_bin", "mean_abs").iter_rows():
        m[si[s], ti[t]] = v
    return m, slab, tlab


def correct_ratio(prob_change: pl.DataFrame | None, *, update: str | None = "counterfactual") -> Figure:
    """Per bin of pi_old, among positive-advantage tokens increased / (increased + decreased) (left: the paper's
    Fig. 2b), among negative-advantage tokens decreased / (increased + decreased) (middle) and both pooled (right),
    after the full update; ties (no change at float64 resolution) are left out and counted in the legend; runs
    overlaid; error bars: binomial standard error over the decided tokens."""
    pc = need(prob_change, "correct ratio per bin", ["prob_change"])
    pooled = pooled_change(pc, update).filter(pl.col("bin") >= 0)
    runs = run_order(pooled)
    colors = run_colors(runs)
    marks = run_markers(runs)
    panels = [("correct_pos", ("pos",), "A > 0: rose / (rose + fell)"),
              ("correct_neg", ("neg",), "A < 0: fell / (rose + fell)"),
              ("correct_pooled", ("pos", "neg"), "both signs pooled")]  # fmt: skip
    with themed():
        fig, axes = new_figure(1, 3, w=4.4, h=3.8, sharey=True)
        offs = offsets(len(runs), 0.5)
        edges: list[list[float]] = []
        for j, (col, ncol, title) in enumerate(panels):
            ax = axes[0, j]
            for i, run in enumerate(runs):
                r = (
                    pooled.filter(pl.col("run") == run)
                    .sort("bin")
                    .drop_nulls(col)
                    .filter(pl.col(col).is_not_nan())
                )
                if not r.height:
                    continue
                lo, hi = r["bin_lo"].to_numpy(), r["bin_hi"].to_numpy()
                edges.append([*lo, *hi])
                x = (lo + hi) / 2 + np.array(offs[i]) * (hi - lo)
                p = r[col].to_numpy()
                n = sum((r[f"n_{sg}"] - r[f"tie_{sg}"]).to_numpy() for sg in ncol)
                se = np.sqrt(np.clip(p * (1 - p), 0, None) / np.maximum(n, 1))
                ties = int(sum(r[f"tie_{sg}"].sum() for sg in ncol))
                label = f"{run} ({ties} ties)" if ties else run
                ax.errorbar(x, p, yerr=se, fmt="-", marker=marks[run], color=colors[run], capsize=4, ms=5, lw=1.5,
                            alpha=0.9, label=label)  # fmt: skip
            ax.axhline(0.5, color="0.3", lw=1, ls=":")
            ax.set_xlim(0, 1)
            shade_bins(ax, edges)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("probability interval, π_old")
        axes[0, 0].set_ylabel("correct ratio")
        handles, labels = axes[0, 0].get_legend_handles_labels()
        fig.legend(
            handles, labels, loc="outside lower center", ncol=min(4, len(runs)), fontsize=9, frameon=False
        )
        title = f"Tokens moved in the direction of their advantage ({_update_note(pooled)})"
        fig.suptitle(titled(title, pooled, pc, column="update_stage"), fontweight="bold")
    return fig
