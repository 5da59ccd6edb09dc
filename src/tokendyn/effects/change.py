"""Probability change of the sampled tokens after an update, and the correct ratios (docs/definitions.md).

    delta_pi_t = pi_after(o_t) - pi_before(o_t)      (same tokens, same temperature, eval mode)

(a) `counterfactual_change`: an update of the parameters, by default the paper's diagnostic (plain SGD, lr 1e-3,
    one step on the full loss L = sum_t l_t, or on the loss restricted to a token set), made exactly, not to first
    order. It is applied in place and undone exactly (`InPlaceUpdate`): by default on float64 copies of the
    parameters swapped into the model for the analysis (a step of 1e-6 of |theta| is partly lost to float32
    rounding, entirely to bf16's; the copy costs 8 bytes a parameter on the device, the model's own parameters are
    not touched), with precision "model" on the model's own parameters: in host memory (CPU), plain SGD's steps as
    new tensors swapped into them (theta_0 never written, no copy of it); on a GPU, or with another optimizer, in
    place after a copy to host memory, tensor by tensor, copied back bitwise when the analysis ends, also on an
    exception (no copy on the device: a 7B model in bf16 costs 15 GB of host memory instead), with precision "float64_step" (plain SGD only)
    from the gradient in the model's dtype, the step and pi after it in float64 (a float64 copy of the parameters
    only while a step is off theta_0: no float64 activations kept for a backward, no float64 gradients). Each step records how finely it was
    resolved (`Resolution`).
    ``.grad`` of every parameter is set aside during the step and put back, hooks are untouched, and any
    ``torch.optim`` optimizer can make the step (its state, e.g. Adam's moments,
    lives on the device for the analysis only; the trainer's optimizer is never touched). Several stages run in
    sequence with the same optimizer (Lopti: stage 1 then stage 2, pi_old fixed).
(b) `real_change`: pi before (a tensor measured before the optimizer step, or a model) and after a real update
    (re-forward of the same tokens, no grad, mode restored).

Correct ratios (per bin): among A_t > 0 tokens increased / (increased + decreased); among A_t < 0 decreased /
(increased + decreased); pooled = (both numerators) / (both denominators). A tie (delta_pi_t = 0 at float64
resolution) is counted apart (tie_pos, tie_neg), never as a failure. Tokens with A_t = 0 are in neither.

Resolution: pi is measured with a float64 log-softmax of the model's logits (`completion_probs`), so a
near-certain token (1 - pi ~ 1e-7) whose logit margin rises is seen to rise; in float32 its log pi is 0.0 exactly
before and after, and the change would read as a tie.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from tokendyn.effects.change_summary import (
    QUANTILES,
    change_frame,
    correct_ratios,
    delta_summary,
    null_summary,
)
from tokendyn.effects.inplace import InPlaceUpdate
from tokendyn.effects.probs import _masked, completion_probs, fix_pi_old, real_change
from tokendyn.effects.resolution import (
    STEP_ROUNDING_LIMIT,
    Resolution,
    resolution_columns,
    unit_roundoff,
    warn_unresolved,
)
from tokendyn.effects.snapshot import HostSnapshot, Saved, _state_to_host
from tokendyn.effects.step_mode import OptimizerFactory, sgd, step_mode, swaps_steps
from tokendyn.probe.tokenloss import (
    Objective,
    ProbeBatch,
    analysis_forward,
)
from tokendyn.vocab import LOPTI, TRAIN

# (the resolution of a step, and whether it was an update at all, are `tokendyn.effects.resolution`'s; re-exported)
__all__ = [
    "STEP_ROUNDING_LIMIT",
    "Resolution",
    "resolution_columns",
    "unit_roundoff",
    "warn_unresolved",
    # the in-place update and its parts (`tokendyn.effects.inplace`, `.snapshot`, `.step_mode`), the measurement of
    # pi (`tokendyn.effects.probs`) and the record of a delta pi (`tokendyn.effects.change_summary`); re-exported
    "InPlaceUpdate",
    "HostSnapshot",
    "Saved",
    "_state_to_host",
    "OptimizerFactory",
    "sgd",
    "swaps_steps",
    "completion_probs",
    "fix_pi_old",
    "real_change",
    "QUANTILES",
    "change_frame",
    "correct_ratios",
    "delta_summary",
    "null_summary",
]


@dataclass
class ChangeResult:
    """pi before every stage and after the last, and delta pi per stage (relative to the state the stage started
    from); ``delta["lopti"]`` is after the last stage minus before the first (present with two or more stages).
    ``resolution``: per stage (and lopti) how finely its step was resolved (`Resolution`)."""

    pi_before: torch.Tensor  # (B, C) float64
    pi_after: dict[str, torch.Tensor] = field(default_factory=dict)
    delta: dict[str, torch.Tensor] = field(default_factory=dict)
    losses: dict[str, float] = field(default_factory=dict)
    param_step: dict[str, float] = field(
        default_factory=dict
    )  # ||theta - theta_0|| / ||theta_0|| after each stage
    resolution: dict[str, Resolution] = field(default_factory=dict)


@analysis_forward
def counterfactual_change(
    model: nn.Module,
    batch: ProbeBatch,
    stages: Sequence[tuple[str, torch.Tensor | None]] | None = None,
    *,
    lr: float = 1e-3,
    optimizer: OptimizerFactory | None = None,
    objective: Objective | None = None,
    pi_before: torch.Tensor | None = None,
    precision: str = "float64",
) -> ChangeResult:
    """delta pi of every completion token after counterfactual update(s) of the parameters, made in place and
    undone exactly (`InPlaceUpdate`: the model is left bitwise as it was).

    ``stages``: (name, token mask or None for all tokens), applied in order with the same optimizer, each one
    step on L_mask = sum_{t in mask} l_t; default ``[("train", None)]``, the paper's one-step diagnostic. Lopti:
    ``[("low", low), ("high", high)]`` (`tokendyn.vocab`). ``optimizer``: params -> torch.optim.Optimizer; default
    plain SGD(lr). ``pi_before``: as in `fix_pi_old`. ``precision``: the steps' (`InPlaceUpdate`); each stage's
    `Resolution` is in ``resolution`` (a stage without a policy-gradient signal is "no update" there, not warned
    about: `tokendyn.effects.resolution`; "lopti" is one when neither stage is an update).
    """
    stages = [(TRAIN, None)] if stages is None else list(stages)
    if not stages:
        raise ValueError("change: stages must hold at least one (name, mask)")
    names = [s[0] for s in stages]
    if len(set(names)) != len(names) or LOPTI in names:
        raise ValueError(f"change: stage names must be distinct and not {LOPTI!r}, got {names}")
    optimizer = optimizer or sgd(lr)
    batch, pi0 = fix_pi_old(model, batch, pi_before, step_mode(model, optimizer, precision))
    with InPlaceUpdate(model, optimizer, objective, precision) as update:
        pi0 = update.pi_start(batch, pi0)
        result = ChangeResult(pi0)
        before, before_norm, mark = pi0, update.start_norm2**0.5, None
        for i, (name, mask) in enumerate(stages):
            result.losses[name] = update.step(batch, mask)
            result.param_step[name] = update.relative_step()
            result.resolution[name] = update.resolution(
                update.distance(mark), before_norm, signal=update.step_signal
            )
            after = update.probs(batch)
            result.pi_after[name] = after
            result.delta[name] = _masked(after - before, batch.completion_mask)
            before = after
            if i + 1 < len(stages):  # the next stage's step is measured from here
                mark, before_norm = update.save(), update.norm2() ** 0.5
    if len(stages) > 1:
        result.delta[LOPTI] = _masked(before - pi0, batch.completion_mask)
        result.param_step[LOPTI] = result.param_step[stages[-1][0]]
        result.resolution[LOPTI] = update.resolution(
            result.param_step[LOPTI] * update.start_norm2**0.5, steps=len(stages)
        )
    for name, res in result.resolution.items():
        warn_unresolved(f"change ({name})", res)
    return result
