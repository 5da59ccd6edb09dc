"""pi of the completion tokens at float64 resolution, pi_old fixed for every stage of an update, and the change
pi_after - pi_before of a real update (`tokendyn.effects.change`)."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from tokendyn.effects.step_mode import _sharded_float64_mode
from tokendyn.probe.float64 import as_float64
from tokendyn.probe.tokenloss import (
    ProbeBatch,
    analysis_forward,
    completion_logp,
    eval_mode,
    loss_and_measured_logp,
)
from tokendyn.vocab import FLOAT64, FLOAT64_STEP


@analysis_forward
def completion_probs(
    model: nn.Module, batch: ProbeBatch, params: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """pi_t(o_t) at the batch temperature, (B, C) float64, without grad, in eval mode (mode restored); the
    log-softmax is taken in float64 (`completion_logp`'s ``float64``) so that a change of a near-certain token's
    probability keeps its sign."""
    with torch.no_grad(), eval_mode(model):
        return torch.exp(completion_logp(model, batch, params, float64=True))


@analysis_forward
def fix_pi_old(
    model: nn.Module, batch: ProbeBatch, pi_before: torch.Tensor | None = None, precision: str = "model"
) -> tuple[ProbeBatch, torch.Tensor]:
    """(batch with old_logp set, pi_before): an on-policy batch gets pi_old = the current pi, fixed for every later
    stage (as the trainer does: pi_old is not recomputed between Lopti stages). ``pi_before``: pi at the current
    parameters (`completion_probs`) when the caller measured it already, for a batch whose pi_old is fixed (no
    forward then; it must have been measured in ``precision``). ``precision`` "float64": pi is the float64 model's
    (`as_float64`; FSDP2-sharded too), and so is an on-policy batch's pi_old (the ratio pi / pi_old of the float64
    steps exactly 1 at theta_0); "float64_step": pi is the float64 model's, pi_old the loss's own in the model's
    dtype, where that precision takes its gradients (its ratio exactly 1 at theta_0, as the model-dtype steps' is:
    for bf16 weights the float64 pi_old would be off by percents there; one more forward without grad)."""
    if batch.old_logp is not None and pi_before is not None:
        return batch, pi_before
    precision = _sharded_float64_mode(model, precision)  # (the steps' own: `step_mode`)
    if precision == FLOAT64_STEP and batch.old_logp is None:
        batch = batch.with_old_logp(loss_and_measured_logp(model, batch)[0])
    with as_float64(model) if precision in (FLOAT64, FLOAT64_STEP) else nullcontext():
        if batch.old_logp is not None:
            return batch, completion_probs(model, batch)
        logp, logp64 = loss_and_measured_logp(model, batch)  # pi_old: the loss's own log pi, ratio 1 at start
    return batch.with_old_logp(logp), torch.exp(logp64)


@analysis_forward
def real_change(before: torch.Tensor | nn.Module, after: nn.Module, batch: ProbeBatch) -> torch.Tensor:
    """delta pi = pi_after - pi_before on the batch's completion tokens, (B, C) float64, zero on padding.
    ``before``: pi measured before the update (`completion_probs`, taken before the optimizer step) or the model
    before the update; ``after``: the model after it. Side-effect free (no grad, each module's mode restored)."""
    pi_before = completion_probs(before, batch) if isinstance(before, nn.Module) else before.to(torch.float64)
    pi_after = completion_probs(after, batch)
    if pi_before.shape != pi_after.shape:
        raise ValueError(
            f"change: before has shape {list(pi_before.shape)}, the batch's completion {list(pi_after.shape)}"
        )
    return _masked(pi_after - pi_before.to(pi_after.device), batch.completion_mask)


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.to(x.device), x, torch.zeros_like(x))
