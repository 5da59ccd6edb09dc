"""The lr -> 0 limit of the counterfactual SGD step: d pi_t / d lr at lr = 0, for every token at once.

The paper's theory (its Proposition 4.2 and what it reads from it) is the update to first order, the lr -> 0 limit;
its figures measure a finite step (plain SGD, lr 1e-3: `tokendyn.effects.change.counterfactual_change`). Along that
step's direction per unit lr, d = -grad_theta L (pi_old fixed; with Lopti's stages d = -sum_s grad_theta L_s at
theta_0, the first-order limit of the stages in order, the later stages' gradients being taken O(lr) away):

    pi_t(theta_0 + lr d) = pi_t + lr pi_t <grad_theta log pi_t, d> + O(lr^2)
    d pi_t / d lr |_{lr = 0} = pi_t <grad_theta log pi_t, d>

for every completion token from one backward (d) and one forward-mode JVP of the log-probabilities along d
(``torch.func.jvp`` over ``torch.func.functional_call``, as `tokendyn.effects.shares.token_shares`), in the model's
own dtype: no parameter copy, no step, the weights never touched. The JVP's log-softmax is taken in float64
(`completion_logp`'s ``float64``): its tangent d log pi_o = sum_k (delta_ko - pi_k) dz_k cancels for a near-certain
token, so it is formed in float64 from the model's logit tangents dz_k (each exact to the model's rounding) and its
sign holds near pi = 1, as the finite step's delta pi does.

At the limit the correct ratio is that of the derivative's sign (`tokendyn.effects.change.correct_ratios` on it; an
exactly zero derivative is a tie), and mean |d pi / d lr| is the per-unit-lr counterpart of a finite step's
mean |delta pi| / lr. `tokendyn.effects.rebalance.analyze_update` records it as the first point of the lr sweep
(``prob_change`` rows with update "sweep", lr 0, ``limit`` true).

Needs eager attention or the SDPA math kernel (selected here) and an unfused LM head (forward-mode AD has no rule for the fused kernels); refused on an
FSDP2-sharded model (the JVP substitutes the parameters FSDP2 gathers). Memory: d (one parameter-sized gradient) and
the JVP's tangents (one forward's activations twice).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tokendyn.effects.change import fix_pi_old
from tokendyn.effects.resolution import Resolution, policy_signal
from tokendyn.effects.shares import _no_input_require_grads, dot64, jvp_attention
from tokendyn.probe.parallel import fsdp_modules
from tokendyn.probe.tokenloss import (
    Objective,
    ProbeBatch,
    analysis_forward,
    completion_logp,
    eval_mode,
    token_loss,
    trainable_parameters,
)

FSDP_NO_LIMIT = (
    "limit: the lr -> 0 limit of the sweep is not computed on FSDP2-sharded parameters: its forward-mode JVP "
    "substitutes the parameters, which FSDP2's gathering replaces; the sweep's finite steps are exact"
)


def limit_refusal(model: nn.Module) -> str | None:
    """Why the limit cannot be computed on this model (FSDP2-sharded parameters, an attention kernel forward-mode AD
    cannot go through), else None: the sweep then goes without it (its finite steps are unaffected)."""
    if fsdp_modules(model):
        return FSDP_NO_LIMIT
    try:
        jvp_attention(model)
    except ValueError as exc:
        return f"limit: the lr -> 0 limit of the sweep is skipped: {exc}"
    return None


@dataclass
class LimitResult:
    """pi at theta_0 (B, C) float64; ``rate`` = d pi_t / d lr at lr = 0 along d = -grad L (B, C) float64, zero on
    padding; ``direction_norm`` = ||d|| (float64 sums); ``signal``: whether L carried a policy-gradient signal (else
    the limit is "no update", `tokendyn.effects.resolution`); ``dtype``: the dtype it was computed in."""

    pi0: torch.Tensor
    rate: torch.Tensor
    direction_norm: float
    signal: bool
    dtype: str

    @property
    def resolution(self) -> Resolution:
        """The record's resolution columns: no step was made (step_norm, step_dtype, step_rounding, step_resolved
        null); no_update without a signal."""
        return Resolution(None, None, None, not self.signal)


@analysis_forward
def limit_change(
    model: nn.Module,
    batch: ProbeBatch,
    stages: Sequence[tuple[str, torch.Tensor | None]] | None = None,
    *,
    objective: Objective | None = None,
) -> LimitResult:
    """d pi_t / d lr at lr = 0 of every completion token for the counterfactual SGD step of ``stages`` (as
    `tokendyn.effects.change.counterfactual_change` takes them: (name, token mask or None); default one stage on every
    token), module docstring. An on-policy batch (old_logp None) gets pi_old = the model's own pi first, as the step
    does. The model is left as it was (no parameter, ``.grad`` or mode changed)."""
    if fsdp_modules(model):
        raise ValueError(FSDP_NO_LIMIT)
    if batch.old_logp is None:
        batch, _ = fix_pi_old(model, batch)
    masks = [m for _, m in (stages or [("train", None)])]
    valid = batch.completion_mask
    weight = torch.zeros(valid.shape, dtype=torch.float64, device=valid.device)
    for m in masks:  # sum_s L_s: a token in several stages counts in each
        weight = weight + (valid if m is None else m.to(valid.device).bool() & valid).to(torch.float64)
    union = weight > 0
    params = trainable_parameters(model)
    names, tensors = list(params), list(params.values())
    with eval_mode(model):
        tl = token_loss(model, batch, objective)
        loss = (tl.terms * weight.to(tl.terms.device, tl.terms.dtype)).sum()
        signal = policy_signal(tl.logp, batch, union, objective, tl.entropy)
        grads = torch.autograd.grad(loss, tensors, allow_unused=True)
    del tl, loss
    tangents = tuple(
        torch.zeros_like(p) if g is None else -g.detach() for p, g in zip(tensors, grads, strict=True)
    )
    del grads
    norm = sum(dot64(v, v) for v in tangents) ** 0.5
    primals = tuple(p.detach() for p in tensors)

    def logp(*ps: torch.Tensor) -> torch.Tensor:
        return completion_logp(model, batch, dict(zip(names, ps, strict=True)), float64=True)

    # forward-mode AD keeps no activations for a backward: nothing to checkpoint (and checkpointing refuses jvp)
    with eval_mode(model, checkpoint=False), jvp_attention(model), _no_input_require_grads(model):
        lp, dlp = torch.func.jvp(logp, primals, tangents)
    pi0 = torch.exp(lp.detach().to(torch.float64))
    rate = pi0 * dlp.detach().to(torch.float64)
    rate = torch.where(valid.to(rate.device), rate, torch.zeros_like(rate))
    dtype = max((p.dtype for p in tensors), key=lambda d: torch.finfo(d).eps, default=torch.float32)
    return LimitResult(pi0, rate, float(norm), bool(signal), str(dtype).removeprefix("torch."))
