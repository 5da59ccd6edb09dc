"""Figures over the sampled tokens: share per probability bin with the density (paper Fig. 1a), advantage per bin
(Fig. 1b), and the (1 - pi) bound per layer (Fig. 2a, measured)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import polars as pl
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from tokendyn.figures.data import (
    MissingRecords,
    bin_edges,
    bin_label,
    edges_vary,
    first_stage,
    need,
    one_point,
    optional,
    run_order,
)
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


def token_counts(binstats: pl.DataFrame, point: str | None = None) -> pl.DataFrame:
    """Per (run, bin): tokens, share, bin_lo, bin_hi; each sampled token counted once (one point, first stage)."""
    bs = binstats.filter(pl.col("quantity") == "norm")
    points = bs.get_column("point").unique().to_list()
    point = point or ("final_norm.out" if "final_norm.out" in points else sorted(points)[0])
    bs = first_stage(bs.filter(pl.col("point") == point))
    return (
        bs.group_by("run", "bin")
        .agg(pl.col("count").sum().alias("tokens"), pl.col("bin_lo").mean(), pl.col("bin_hi").mean())
        .with_columns((pl.col("tokens") / pl.col("tokens").sum().over("run")).alias("share"))
        .sort("run", "bin")
    )


def token_share(
    binstats: pl.DataFrame | None, tokens: pl.DataFrame | None = None, *, point: str | None = None
) -> Figure:
    """Share of sampled completion tokens per bin of pi_old (log-scale bars, exact counts from ``binstats``) and
    the density of pi_old (KDE of the ``tokens`` sample, right axis). Paper Fig. 1a."""
    bs = need(binstats, "token share per bin", ["binstats"])
    tokens = optional(tokens)
    counts = token_counts(bs, point)
    runs = run_order(bs)
    colors = run_colors(runs)
    edges = bin_edges(counts)
    nb = len(edges)
    with themed():
        fig, axes = new_figure(1, 1, w=6.4, h=4.2)
        ax = axes[0, 0]
        offs = offsets(len(runs), 0.8)
        for i, run in enumerate(runs):
            c = counts.filter(pl.col("run") == run).sort("bin")
            lo, hi = c["bin_lo"].to_numpy(), c["bin_hi"].to_numpy()
            width = (hi - lo) * 0.8 / len(runs)
            x = (lo + hi) / 2 + offs[i] * (hi - lo)
            face = bin_colors(nb) if len(runs) == 1 else colors[run]
            bars = ax.bar(x, c["share"].to_numpy(), width=width, color=face, edgecolor="0.2", lw=0.8,
                          label=run if len(runs) > 1 else None)  # fmt: skip
            for b, s in zip(
                bars, c["share"].to_list(), strict=True
            ):  # several runs: upright labels, no overlap
                ax.annotate(f"{100 * s:.1f}%", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=8 if len(runs) > 1 else 10,
                            rotation=90 if len(runs) > 1 else 0, xytext=(0, 2), textcoords="offset points")  # fmt: skip
        ax.set_yscale("log")
        smallest = float(counts.filter(pl.col("share") > 0)["share"].min() or 0.01)
        ax.set_ylim(10 ** math.floor(math.log10(max(smallest, 1e-4)) - 0.3), 4.0 if len(runs) > 1 else 1.6)
        ax.set_xlim(0, 1)
        shade_bins(ax, [[*r["bin_lo"], *r["bin_hi"]] for r in counts.partition_by("run")])
        ax.set_xlabel("probability interval of the sampled token, π_old")
        ax.set_ylabel("share of tokens (log scale)")
        handles = []
        if tokens is not None:
            tk = first_stage(one_point(tokens))
            ax2 = ax.twinx()
            ax2.grid(False)
            for run in runs:
                x = tk.filter(pl.col("run") == run).get_column("pi_old").to_numpy()
                if x.size > 1 and np.ptp(x) > 0:
                    col = "#f46d43" if len(runs) == 1 else colors[run]
                    sns.kdeplot(x=x, ax=ax2, clip=(0, 1), cut=0, bw_adjust=0.5, color=col, lw=2)
            ax2.set_ylabel(
                "density of π_old (KDE of the token sample)", color="#f46d43" if len(runs) == 1 else "0.2"
            )
            ax2.set_ylim(bottom=0)
            handles.append(plt_line("#f46d43" if len(runs) == 1 else "0.3", "density (right axis)"))
        if len(runs) > 1:
            handles = [Patch(color=colors[r], label=r) for r in runs] + handles
            fig.legend(handles=handles, loc="outside lower center", ncol=min(4, len(handles)), fontsize=8,
                       frameon=False)  # fmt: skip
        elif handles:
            ax.legend(handles=handles, loc="upper center", fontsize=8, framealpha=0.9)
        vary = " (quantile bins: mean edges)" if edges_vary(counts) else ""
        why = "each token counted once: the stage recorded first"
        ax.set_title(titled(f"Tokens per probability interval{vary}", first_stage(bs), bs, why=why))
    return fig


def plt_line(color: str, label: str):
    from matplotlib.lines import Line2D

    return Line2D([], [], color=color, lw=2, label=label)


def advantage_by_bin(
    tokens: pl.DataFrame | None, binstats: pl.DataFrame | None = None, *, outlier_quantile: float = 0.99
) -> Figure:
    """Violin of the advantage Â_t (as used in the loss) per bin of pi_old, runs side by side (Fig. 1b). Tokens
    outside the current Lopti stage (advantage masked to 0 in the records) are left out; per (run, bin) the tokens
    with |Â| above the ``outlier_quantile`` are dropped, as the paper drops the top 1 %."""
    tk = one_point(need(tokens, "advantage per bin", ["tokens"]))
    binstats = optional(binstats)
    if "in_stage" in tk.columns:
        tk = tk.filter(pl.col("in_stage"))
    tk = tk.filter(pl.col("bin") >= 0)
    cut = pl.col("advantage").abs().quantile(outlier_quantile).over("run", "bin")
    tk = tk.filter(pl.col("advantage").abs() <= cut)
    if not tk.height:
        raise MissingRecords("advantage per bin", ["tokens"], reason="the token sample is empty")
    runs = run_order(tk)
    nb = int(tk["bin"].max()) + 1
    labels = _bin_labels(binstats if binstats is not None else tk, nb)
    pdf = tk.select("run", "bin", "advantage").to_pandas()
    pdf["interval"] = [labels[b] for b in pdf["bin"]]
    with themed():
        fig, axes = new_figure(1, 1, w=max(6.0, 1.6 * nb + 1.2 * len(runs)), h=4.0)
        ax = axes[0, 0]
        ax.axhspan(0, 1e9, color="#fdae61", alpha=0.12, zorder=0)
        ax.axhspan(-1e9, 0, color="#74add1", alpha=0.12, zorder=0)
        kw = dict(data=pdf, x="interval", y="advantage", order=labels, ax=ax, cut=0, inner="quartile",
                  density_norm="width", linewidth=0.8)  # fmt: skip
        if len(runs) > 1:
            sns.violinplot(hue="run", hue_order=runs, palette=run_colors(runs), **kw)
            ax.legend(title=None, fontsize=8, loc="lower right")
        else:
            sns.violinplot(hue="interval", hue_order=labels, palette=bin_colors(nb), legend=False, **kw)
        lim = float(tk["advantage"].abs().max() or 1.0) * 1.15
        ax.set_ylim(-lim, lim)
        ax.axhline(0, color="0.4", lw=0.8)
        ax.set_xlabel("probability interval of the sampled token, π_old")
        ax.set_ylabel("advantage Â (as used in the loss)")
        ax.set_title(
            titled("Advantage per probability interval", tk, tokens, why="each token in its own stage")
        )
    return fig


def _bin_labels(df: pl.DataFrame, nb: int) -> list[str]:
    if "bin_lo" in df.columns:
        edges = bin_edges(df)
        return [bin_label(*edges[b], b == nb - 1) if b in edges else f"bin {b}" for b in range(nb)]
    return [f"bin {b}" for b in range(nb)]


def default_points(points: Sequence[str], k: int = 3) -> list[str]:
    """Up to k probe points: the first and last decoder layers and the final norm."""
    layers = sorted([p for p in points if p.startswith("layers.")], key=lambda p: int(p.split(".")[1]))
    chosen = [*layers[:1], *layers[-1:], *(["final_norm.out"] if "final_norm.out" in points else [])]
    chosen = list(dict.fromkeys(chosen)) or sorted(points)
    return chosen[-k:] if len(chosen) > k else chosen


def envelope(bound: pl.DataFrame) -> pl.DataFrame:
    """Per (run, point): C = min and D = max of ||delta|| / (|w| (1 - pi)) over every recorded micro-batch, and the
    token-weighted mean Spearman correlation of ||delta|| / |w| with (1 - pi)."""
    return bound.group_by("run", "point").agg(
        pl.col("n").sum(),
        pl.col("ratio_min").min().alias("C"),
        pl.col("ratio_max").max().alias("D"),
        (
            (pl.col("spearman") * pl.col("n")).sum()
            / pl.col("n").filter(pl.col("spearman").is_not_null()).sum()
        ).alias("spearman"),
        pl.col("direct_ratio_min").min().alias("C_direct"),
        pl.col("direct_ratio_max").max().alias("D_direct"),
        (
            (pl.col("direct_spearman") * pl.col("direct_n")).sum()
            / pl.col("direct_n").filter(pl.col("direct_spearman").is_not_null()).sum()
        ).alias("spearman_direct"),
    )


def bound(
    tokens: pl.DataFrame | None,
    bound: pl.DataFrame | None = None,
    checks: pl.DataFrame | None = None,
    *,
    points: Sequence[str] | None = None,
    max_tokens: int = 4000,
    gradient: str = "direct",
) -> Figure:
    """||delta_l|| / |w| against pi for each chosen probe point (columns) and run (rows), from the token sample, with
    the measured envelope C_l (1 - pi) .. D_l (1 - pi) (min / max of the ratio in the ``bound`` records; from the
    sample when absent) and the theoretical lines: at the logits sqrt(V/(V-1)) (1 - pi) .. sqrt(2) (1 - pi) (exact;
    first column, when the tokens carry ``logits_ratio``), at the final norm sigma_max(W) sqrt(2) / T (1 - pi)
    (``checks``).

    ``gradient``: what the inner-layer panels show. "direct" (default): each token's own gradient per unit weight,
    ||d log pi_t / dh_l|| = direct_ratio (1 - pi) (every sampled token that has one, whatever its weight w), with its
    envelope: the quantity the paper's Proposition bounds. "total": the
    training backward's ||dL/dh_l[p(t)]||, which at inner layers also carries later tokens' losses through attention,
    so a token with pi -> 1 keeps a finite gradient and D can be ~1e12; its axis is clipped with a note. At the final
    norm both are the same (exact) and the total is drawn."""
    if gradient not in ("direct", "total"):
        raise ValueError(f"bound figure: gradient must be 'direct' or 'total', got {gradient!r}")
    tk = need(tokens, "the (1 - pi) bound", ["tokens"])
    bound, checks = optional(bound), optional(checks)
    # a token's own gradient ||d log pi_t / dh_l|| = direct_ratio (1 - pi) needs no weight: every replayed token
    # (a weight-0 token too: in Lopti's other stage, or of a group whose advantages are all 0)
    own = tk.filter(pl.col("direct_ratio").is_not_null()) if "direct_ratio" in tk.columns else None
    tk = tk.filter(pl.col("w").is_not_null() & (pl.col("w") != 0) & pl.col("norm").is_not_null())
    if "in_stage" in tk.columns:
        tk = tk.filter(pl.col("in_stage"))
    if not tk.height:
        raise MissingRecords(
            "the (1 - pi) bound",
            ["tokens"],
            reason="no sampled token has a non-zero weight w (all advantages 0?)",
        )
    runs = run_order(tk)
    pts = list(points) if points else default_points(tk.get_column("point").unique().to_list())
    env = envelope(bound) if bound is not None else None
    has_logits = "logits_ratio" in tk.columns and tk["logits_ratio"].drop_nulls().len() > 0
    cols = (["logits"] if has_logits else []) + pts
    omp = np.linspace(0, 1, 101)
    pi_line = 1 - omp
    handles: dict[str, object] = {}
    with themed():
        fig, axes = run_rows(runs, len(cols), w=3.9, h=3.2)
        for i, run in enumerate(runs):
            rt = tk.filter(pl.col("run") == run)
            if rt.height > max_tokens * len(cols):
                rt = rt.sample(max_tokens * len(cols), seed=0)
            for j, col in enumerate(cols):
                ax = axes[i, j]
                note, c_d, direct = "", None, False
                if col == "logits":
                    d = one_point(rt).drop_nulls("logits_ratio")
                    x = d["pi"].to_numpy()
                    y = d["logits_ratio"].to_numpy() * (1 - x)
                    vocab = _vocab(checks, run)
                    lo_c = math.sqrt(vocab / (vocab - 1)) if vocab else 1.0
                    handles["theory"] = ax.fill_between(
                        pi_line, lo_c * omp, math.sqrt(2) * omp, color="#92c5de", alpha=0.35, lw=0,
                        label="theory: √(V/(V−1))(1−π) .. √2(1−π) at the logits; σ_max(W)√2/T·(1−π) at the final norm",
                    )  # fmt: skip
                    for c in (lo_c, math.sqrt(2)):
                        ax.plot(pi_line, c * omp, color="#2166ac", lw=1.5)
                    title, ylab = "logits (exact bound)", "‖∂ℓ/∂z‖ / |w| = ‖e_o − π‖"
                    bad = int(
                        np.sum((y > math.sqrt(2) * (1 - x) * (1 + 1e-6)) | (y < lo_c * (1 - x) * (1 - 1e-6)))
                    )
                    note = f"{len(x)} tokens, {bad} outside"
                else:
                    d = rt.filter(pl.col("point") == col)
                    mine = (
                        own.filter((pl.col("run") == run) & (pl.col("point") == col))
                        if own is not None
                        else None
                    )
                    direct = (
                        gradient == "direct"
                        and col != "final_norm.out"
                        and mine is not None
                        and mine.height > 0
                    )
                    if direct:
                        d = mine
                    x = d["pi"].to_numpy()
                    y = (d["direct_ratio"] * (1 - d["pi"]) if direct else d["norm"] / d["w"].abs()).to_numpy()
                    c_d = _cd(env, run, col, d, direct=direct)
                    if c_d is not None:
                        c, dd = c_d
                        handles["measured"] = ax.fill_between(
                            pi_line, c * omp, dd * omp, color="#f4a582", alpha=0.3, lw=0,
                            label="measured envelope C_l(1−π) .. D_l(1−π) (min / max over all recorded tokens)",
                        )  # fmt: skip
                        for v in (c, dd):
                            ax.plot(pi_line, v * omp, color="#b2182b", lw=1.2, ls="--")
                        note = f"C = {c:.3g}, D = {dd:.3g}"
                        rho = _rho(env, run, col, direct=direct)
                        if rho is not None:
                            note += f"\nSpearman ρ = {rho:.2f}"
                    if "direct_norm" in d.columns and not direct:
                        dr = d.drop_nulls("direct_norm")
                        if dr.height:
                            handles["direct"] = ax.scatter(
                                dr["pi"].to_numpy(), (dr["direct_norm"] / dr["w"].abs()).to_numpy(), s=14,
                                marker="D", color="#1b7837", alpha=0.8, lw=0, zorder=4,
                                label="direct gradient (the token's own loss term only)",
                            )  # fmt: skip
                    title, ylab = short_point(col), "‖δ_l‖ / |w|"
                    if direct:
                        title += " (direct)"
                    elif col != "final_norm.out":
                        title += " (total)"
                label = (
                    "sampled tokens: the token's own gradient (direct) at inner layers, training gradient at the "
                    "final norm" if gradient == "direct" else "sampled tokens (training gradient)"
                )  # fmt: skip
                handles["tokens"] = ax.scatter(
                    x,
                    y,
                    s=7,
                    alpha=0.45,
                    color="0.15",
                    lw=0,
                    zorder=3,
                    label=label,
                )
                # the scale follows the tokens with pi < 0.95, where the (1 - pi) law can be seen: at inner layers
                # a token with pi -> 1 keeps later tokens' gradients (attention), and D can be ~1e12 off scale
                core = y[x < 0.95] if np.any(x < 0.95) else y
                ymax = float(np.nanquantile(core, 0.995)) if core.size else 1.0
                top = ymax * 1.3 if ymax > 0 else 1.0
                if (
                    col != "logits" and direct and c_d is not None
                ):  # the direct envelope is the panel's subject
                    top = max(top, c_d[1] * 1.05)
                ax.set_ylim(0, top)
                head = _head_bound(checks, run) if col == "final_norm.out" else None
                if head is not None and head <= top:  # the provable bound sigma_max(W) sqrt(2) / T (1 - pi)
                    ax.plot(pi_line, head * omp, color="#2166ac", lw=1.5)
                elif head is not None:  # far above the tokens: a number, not a near-vertical stroke at pi ~ 1
                    note += f"\nprovable: ≤ {head:.3g}(1−π), off scale"
                above = int(np.sum(y > top))
                if above:
                    note += f"\n{above} token{'s' * (above > 1)} above the axis"
                if col != "logits" and c_d is not None and c_d[1] > top:
                    note += f"\nD above the axis (clipped at {top:.3g})"
                ax.set_xlim(0, 1)
                if note:
                    ax.text(0.97, 0.95, note, transform=ax.transAxes, ha="right", va="top", fontsize=8,
                            bbox=dict(boxstyle="round", fc="white", ec="0.7", alpha=0.9))  # fmt: skip
                ax.set_title(title, fontsize=10)
                ax.set_xlabel("π_θ(o_t)")
                ax.set_ylabel(ylab if j <= 1 else "")
        order = [k for k in ("tokens", "direct", "measured", "theory") if k in handles]
        fig.legend([handles[k] for k in order], [handles[k].get_label() for k in order], loc="outside lower center",
                   ncol=2, fontsize=8, frameon=False)  # fmt: skip
        fig.suptitle(
            titled("Per-token gradient against probability: the (1 − π) bound", tk, tokens), fontweight="bold"
        )
    return fig


def _rho(env: pl.DataFrame | None, run: str, point: str, direct: bool = False) -> float | None:
    if env is None:
        return None
    row = env.filter((pl.col("run") == run) & (pl.col("point") == point))
    v = row["spearman_direct" if direct else "spearman"][0] if row.height else None
    return None if v is None or not math.isfinite(v) else float(v)


def _cd(
    env: pl.DataFrame | None, run: str, point: str, d: pl.DataFrame, direct: bool = False
) -> tuple[float, float] | None:
    c, dd, col = ("C_direct", "D_direct", "direct_ratio") if direct else ("C", "D", "ratio")
    if env is not None:
        row = env.filter((pl.col("run") == run) & (pl.col("point") == point))
        if row.height and row[c][0] is not None and row[dd][0] is not None:
            return float(row[c][0]), float(row[dd][0])
    r = d.get_column(col).drop_nulls() if col in d.columns else None
    if r is not None and r.len():
        return float(r.min()), float(r.max())
    return None


def _vocab(checks: pl.DataFrame | None, run: str) -> int | None:
    if checks is None or not checks.height or "vocab_size" not in checks.columns:
        return None
    v = checks.filter(pl.col("run") == run)["vocab_size"].drop_nulls()
    return int(v.max()) if v.len() else None


def _head_bound(checks: pl.DataFrame | None, run: str) -> float | None:
    if checks is None or not checks.height or "head_bound" not in checks.columns:
        return None
    v = checks.filter(pl.col("run") == run)["head_bound"].drop_nulls().drop_nans()
    return float(v.max()) if v.len() else None
