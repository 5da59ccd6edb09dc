"""The study's figures: the paper's Fig. 3 (v1 Fig. 2b) analogue — the correct ratio of positive-advantage tokens
per probability bin and method with 95 % intervals, the paper's values beside it — and held-out accuracy per puzzle
size with 95 % intervals. Drawn from the study's tables (`tokendyn.analysis.study`) alone."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from tokendyn.analysis.study import PAPER_CORRECT
from tokendyn.figures.style import finish, new_figure, offsets, run_colors, themed


def _color(method: str, k: int) -> str:
    return "k" if method == "start" else run_colors([method])[method]


def correct_ratio_figure(bins: pl.DataFrame, path: Path) -> Path:
    """x: bins of pi_old; y: rose / (rose + fell) among A > 0 tokens after the counterfactual full update (ties left
    out), one series per method with its interval; hollow markers: the paper's values; dashed: 0.5."""
    methods = bins["method"].unique(maintain_order=True).to_list()
    labels = bins.filter(pl.col("method") == methods[0]).sort("bin")["pi_old"].to_list()
    with themed():
        fig, axes = new_figure(1, 1, w=6.4, h=4.0)
        ax = axes[0, 0]
        offs = offsets(len(methods), 0.6)
        for k, (m, dx) in enumerate(zip(methods, offs, strict=True)):
            r = bins.filter(pl.col("method") == m).sort("bin").drop_nulls("correct_pos")
            if not r.height:
                continue
            x = [b + dx for b in r["bin"].to_list()]
            y = r["correct_pos"].to_numpy()
            err = [y - r["correct_pos_lo"].to_numpy(), r["correct_pos_hi"].to_numpy() - y]
            ax.errorbar(x, y, yerr=err, fmt="o", color=_color(m, k), capsize=3, label=f"{m} (ours)")
            if m in PAPER_CORRECT:
                ax.plot(x, PAPER_CORRECT[m][: len(x)], "o", mfc="none", color=_color(m, k), ms=8, alpha=0.7,
                        label=f"{m} (paper)")  # fmt: skip
        ax.axhline(0.5, color="0.4", ls="--", lw=1)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel("pi_old interval")
        ax.set_ylabel("correct ratio, A > 0 tokens")
        ax.legend(fontsize=8, ncol=2)
        finish(fig, "Correct ratio per bin (paper Fig. 3 analogue), 95 % intervals")
        fig.savefig(path)
    return path


def accuracy_figure(acc: pl.DataFrame, path: Path) -> Path:
    """Held-out accuracy per puzzle size (and all sizes pooled), one panel per decoding mode, one series per method
    (the starting policy included), 95 % intervals over seeds and puzzles."""
    modes = acc["mode"].unique(maintain_order=True).to_list()
    methods = acc["method"].unique(maintain_order=True).to_list()
    with themed():
        fig, axes = new_figure(1, len(modes), w=5.2, h=3.8, sharey=True)
        for j, mode in enumerate(modes):
            ax = axes[0, j]
            sizes = acc.filter(pl.col("mode") == mode)["people"].unique(maintain_order=True).to_list()
            for k, (m, dx) in enumerate(zip(methods, offsets(len(methods), 0.7), strict=True)):
                r = acc.filter((pl.col("mode") == mode) & (pl.col("method") == m))
                if not r.height:
                    continue
                x = [sizes.index(p) + dx for p in r["people"].to_list()]
                y = r["accuracy"].to_numpy()
                err = [y - r["lo"].to_numpy(), r["hi"].to_numpy() - y]
                ax.errorbar(x, y, yerr=err, fmt="o", color=_color(m, k), capsize=3, label=m)
            ax.set_xticks(range(len(sizes)), sizes)
            ax.set_xlabel("people")
            ax.set_title(mode)
        axes[0, 0].set_ylabel("accuracy (reward = 3)")
        axes[0, -1].legend(fontsize=8)
        finish(fig, "Held-out accuracy, 95 % intervals")
        fig.savefig(path)
    return path


def accuracy_curve_figure(acc: pl.DataFrame, path: Path) -> Path:
    """The seeded study's held-out accuracy after each evaluated rollout, one series per method (the starting
    policy at rollout 0), 95 % intervals over training seeds and problems."""
    methods = [m for m in acc["method"].unique(maintain_order=True).to_list() if m != "start"]
    with themed():
        fig, axes = new_figure(1, 1, w=6.4, h=4.0)
        ax = axes[0, 0]
        span = max(1, int(acc["rollout"].max()))
        for k, (m, dx) in enumerate(zip(methods, offsets(len(methods), 0.08 * span), strict=True)):
            r = acc.filter(pl.col("method") == m).sort("rollout")
            x = [v + dx for v in r["rollout"].to_list()]
            y = r["accuracy"].to_numpy()
            err = [y - r["lo"].to_numpy(), r["hi"].to_numpy() - y]
            seeds = int(r["seeds"].max())
            ax.errorbar(x, y, yerr=err, fmt="o-", color=_color(m, k), capsize=3, label=f"{m} ({seeds} seeds)")
        ax.set_xlabel("rollouts trained")
        ax.set_ylabel("held-out accuracy (greedy)")
        ax.legend(fontsize=7, ncol=2)
        finish(fig, "Held-out accuracy over training, 95 % intervals over seeds and problems")
        fig.savefig(path)
    return path


def difference_figure(diffs: pl.DataFrame, path: Path, minus: str = "grpo", label: str = "GRPO's") -> Path:
    """Each method minus ``minus`` (paired by training seed and problem) with its 95 % two-stage interval; 0
    dashed."""
    rows = diffs.filter(pl.col("minus") == minus)
    names = rows["method"].to_list()
    with themed():
        fig, axes = new_figure(1, 1, w=6.4, h=0.5 * max(3, len(names)) + 1.0)
        ax = axes[0, 0]
        y = list(range(len(names)))[::-1]
        d = rows["difference"].to_numpy()
        err = [d - rows["lo"].to_numpy(), rows["hi"].to_numpy() - d]
        for k, m in enumerate(names):
            ax.errorbar(
                [d[k]], [y[k]], xerr=[[err[0][k]], [err[1][k]]], fmt="o", color=_color(m, k), capsize=3
            )
        ax.axvline(0.0, color="0.4", ls="--", lw=1)
        ax.set_yticks(y, [f"{m} ({s} seeds)" for m, s in zip(names, rows["seeds"].to_list(), strict=True)])
        ax.set_xlabel(f"held-out accuracy minus {label}")
        finish(fig, f"After {int(rows['rollout'].max())} rollouts, 95 % intervals over seeds and problems")
        fig.savefig(path)
    return path
