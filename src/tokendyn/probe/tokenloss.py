"""The per-token loss terms l_t of an `Objective` on a `ProbeBatch`, and the one loss every analysis uses.

Every rebalancing analysis (shares, probability change, influence) takes the same inputs, a `ProbeBatch`, and
differentiates the same per-token terms l_t computed here, so sum_t l_t is exactly the loss L whose gradient
they decompose. The module is split by job: the objective's configuration (`tokendyn.probe.objective`), the batch
(`tokendyn.probe.batch`), the model split and chunked forward (`tokendyn.probe.forward`) and the per-token rules
(`tokendyn.probe.rules`, one table); their public names are importable from here too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokendyn.probe.batch import ProbeBatch, _as_2d  # noqa: F401  (re-exported)
from tokendyn.probe.forward import (  # noqa: F401  (re-exported)
    CHUNK_BYTES,
    _accepts_logits_to_keep,
    _checkpoint,
    _Features,
    _features,
    _Parts,
    _peft_base,
    _split,
    _split_checked,
    _splittable,
    _token_values,
    analysis_forward,
    checkpointed_layers,
    chunk_logits,
    chunk_tokens,
    completion_logp,
    completion_logp_entropy,
    completion_proxy_logp,
    eval_mode,
    head_inputs,
    logp_and_entropy,
    logp_float64,
    loss_and_measured_logp,
    minp_proxy_logp,
    trainable_parameters,
)
from tokendyn.probe.objective import (  # noqa: F401  (re-exported)
    COV_FIELDS,
    IS_LEVELS,
    LOSS_TYPES,
    POLICY_LOSSES,
    PPO_FAMILY,
    Objective,
    TokenObjective,
    surrogate_problem,
)
from tokendyn.probe.rules import SURROGATES, TokenInputs  # noqa: F401  (re-exported)


def loss_terms(
    logp: torch.Tensor,
    batch: ProbeBatch,
    objective: Objective | TokenObjective | None = None,
    entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """The per-token terms l_t, (B, C), zero on padding, sum = L (formula: `Objective`; a `TokenObjective`, another
    stack's loss, computes its own).

    ``logp`` is log pi_t (B, C); pi_old is batch.old_logp, or logp.detach() when None (ratio 1, gradient of the
    plain surrogate -A_t log pi_t). ``entropy``: H_t (B, C), needed when the objective has an entropy bonus or an
    entropy mask (`completion_logp_entropy`)."""
    objective = objective or Objective()
    if objective.needs_entropy and entropy is None:
        raise ValueError("objective: an entropy bonus or top_entropy_quantile < 1 needs the entropies H_t")
    if not isinstance(objective, Objective):
        return objective.terms(logp, batch, entropy)
    mask = batch.completion_mask.to(logp.device)
    m = mask.to(logp.dtype)
    zero = torch.zeros_like(logp)
    adv = batch.advantages.to(device=logp.device, dtype=logp.dtype)
    old = logp.detach() if batch.old_logp is None else batch.old_logp.to(device=logp.device, dtype=logp.dtype)
    token_log_ratio = torch.where(mask, logp - old, zero)
    log_ratio = token_log_ratio
    if objective.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    is_ratio = None
    if objective.is_correction:
        if batch.is_ratio is None:
            raise ValueError(
                "objective: is_correction needs batch.is_ratio (TRL's importance_sampling_ratio)"
            )
        is_ratio = batch.is_ratio.to(device=logp.device, dtype=logp.dtype)
    proxy = None
    if objective.needs_proxy:
        if batch.proxy_logp is None:
            raise ValueError(
                f"objective: policy_loss {objective.policy_loss} needs batch.proxy_logp (Lp-Reg's min-p proxy of "
                "pi_old, `tokendyn.probe.forward.completion_proxy_logp`)"
            )
        proxy = batch.proxy_logp.to(device=logp.device, dtype=logp.dtype)
    inputs = TokenInputs(
        logp=logp,
        old=old,
        log_ratio=token_log_ratio,
        ratio=ratio,
        adv=adv,
        mask=mask,
        is_ratio=is_ratio,
        entropy=None if entropy is None else entropy.detach(),
        proxy_logp=proxy,
    )
    pg = objective.rule(
        objective, inputs
    )  # pg_t before the masks: the registered rule (`tokendyn.probe.rules`)
    if objective.off_policy_mask_threshold is not None:
        pg = pg * _off_policy_mask(objective, logp, old, batch, adv, mask)
    keep = m
    if objective.top_entropy_quantile < 1.0:
        keep = m * _high_entropy_mask(entropy.detach(), mask, objective.top_entropy_quantile).to(m.dtype)
        pg = pg * keep
    if is_ratio is not None and objective.loss_type != "vespo":
        pg = pg * is_ratio
    if objective.beta > 0:
        if batch.ref_logp is None:
            raise ValueError("objective: beta > 0 needs batch.ref_logp (log pi_ref of the completion tokens)")
        ref = batch.ref_logp.to(device=logp.device, dtype=logp.dtype)
        d = torch.where(mask, ref - logp, zero)
        if objective.kl_clamp:
            d = torch.clamp(d, -5.0, 5.0)
            kl = torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)
        else:
            kl = torch.exp(d) - d - 1.0
        pg = pg + objective.beta * (kl * ratio if objective.bias_correction_kl else kl)
    per_token = torch.where(mask, pg, zero)
    b = logp.size(0)
    if objective.loss_type in ("grpo", "sapo"):
        terms = per_token / (m.sum(-1, keepdim=True).clamp(min=1.0) * b)
    elif objective.loss_type == "luspo":
        terms = per_token / b
    elif objective.loss_type == "bnpo":
        terms = per_token / m.sum().clamp(min=1.0)
    elif objective.loss_type == "dr_grpo":
        terms = per_token / (b * objective.max_completion_length)
    else:  # dapo, cispo, vespo
        terms = per_token / batch.norm
    if objective.entropy_coef:
        terms = terms - objective.entropy_coef * keep * entropy / keep.sum().clamp(min=1.0)
    return terms


def _off_policy_mask(objective, logp, old, batch, adv, mask) -> torch.Tensor:
    """o_t = 1 where A_t >= 0 or the sequence's mean of (log pi_sampler - sg[log pi_t]) over its tokens is <= the
    threshold (TRL's get_off_policy_mask, DeepSeek-V3.2; NaN sampler log-probs count 0), else 0. (B, C)."""
    sampler = (
        old if batch.sampling_logp is None else batch.sampling_logp.to(device=logp.device, dtype=logp.dtype)
    )
    m = mask.to(logp.dtype)
    kl = torch.nan_to_num(sampler - logp.detach(), nan=0.0)
    mean_kl = (kl * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    return ((adv >= 0) | (mean_kl <= objective.off_policy_mask_threshold)).to(logp.dtype)


def _high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, top: float) -> torch.Tensor:
    """e_t = H_t >= the (1 - top)-quantile of H over the batch's completion tokens (TRL's get_high_entropy_mask on
    one process), and 0 on padding."""
    valid = entropy[mask].float()
    if valid.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(valid, 1.0 - top)
    return ((entropy * mask) >= threshold) & mask


@dataclass
class TokenLoss:
    """logp: log pi_t (B, C); terms: l_t (B, C); loss: L = sum_t l_t (0-d); entropy: H_t (B, C) when the objective
    reads it, else None."""

    logp: torch.Tensor
    terms: torch.Tensor
    loss: torch.Tensor
    entropy: torch.Tensor | None = None


def token_loss(
    model: nn.Module,
    batch: ProbeBatch,
    objective: Objective | None = None,
    params: dict[str, torch.Tensor] | None = None,
) -> TokenLoss:
    """Forward the batch and return log pi_t, the per-token loss terms l_t and L = sum_t l_t
    (`completion_logp` or `completion_logp_entropy`, then `loss_terms`): the one loss every analysis uses."""
    objective = objective or Objective()
    if objective.needs_entropy:
        logp, entropy = completion_logp_entropy(model, batch, params)
    else:
        logp, entropy = completion_logp(model, batch, params), None
    terms = loss_terms(logp, batch, objective, entropy)
    return TokenLoss(logp, terms, terms.sum(), entropy)


def bin_index(pi: torch.Tensor, mask: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Bin of every token by probability (`tokendyn.probe.bins.assign_bins`: [e_b, e_b+1), last bin closed);
    -1 on padding. (B, C) long."""
    from tokendyn.probe.bins import assign_bins

    idx = assign_bins(pi.detach(), edges.to(pi.device))
    return torch.where(mask.to(pi.device), idx, torch.full_like(idx, -1))


def pi_old(model: nn.Module, batch: ProbeBatch) -> torch.Tensor:
    """pi_old of every completion token as float64 (B, C): exp(batch.old_logp), or the current pi (eval mode,
    no grad) when the batch is on-policy."""
    if batch.old_logp is not None:
        return torch.exp(batch.old_logp.to(torch.float64))
    with torch.no_grad(), eval_mode(model):
        return torch.exp(completion_logp(model, batch, float64=True))
