"""verl's own loss as the rebalancing analyses' objective, so that every verl loss mode (vanilla, gspo, cispo, sapo,
clip_cov, kl_cov, ..., tokendyn's own) is analysed exactly as it is trained.

The loss is what verl's `ppo_loss` computes from the per-token log-probs of a batch, with verl's own functions:

    L = policy_loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                       rollout_is_weights)                                                         (registered mode)
        - entropy_coeff * agg_loss(H, response_mask)                         (when the actor has an entropy bonus)
        + kl_loss_coef * agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type), response_mask)   (use_kl_loss)

(in a Lopti stage the KL and entropy matrices are restricted to the stage's group, as `loss.lopti_ppo_loss` trains)

(``rollout_is_weights``: verl's rollout-correction weights of the analysed rows, `ProbeBatch.is_ratio`, when the
batch carries them: the loss the actor trains) on the analysed sample taken as the whole batch (one rank: dp_size 1, the sample's token count as the global
token count). Its per-token terms, which the analyses split into bins and token sets, are first-order:

    l_t = w_t (log pi_t - sg[log pi_t]) + u_t (H_t - sg[H_t]) + L m_t / N,   w_t = dL/dlog pi_t,  u_t = dL/dH_t

(sg: stop-gradient; w and u from `torch.func.grad` at the current log-probs, so forward-mode JVPs compose with
it). Their gradients are exactly each token's part of dL/dtheta = sum_t (w_t dlog pi_t + u_t dH_t), their sum is
dL/dtheta, and their values sum to L (spread evenly over the N scored tokens: a verl loss has no per-token value
in general, e.g. GSPO's sequence ratio or Clip-Cov's token selection couple tokens). For a loss that is a sum of
per-token terms of log pi_t alone (vanilla PPO, token-mean) these gradients equal the per-token terms' own.
Clip-Cov draws its tokens with `torch.randperm`: each evaluation is seeded with ``seed``, so every analysis of a
step sees the same selection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokendyn.integrations.verl.loss import (
    LOSS_NAME,
    TOKENDYN_RULES,
    VerlConfigError,
    needs_entropy,
    stage_mask,
)
from tokendyn.probe.tokenloss import ProbeBatch


@dataclass(frozen=True)
class VerlObjective:
    """The loss of a verl actor config (`FSDPActorConfig` / `ActorConfig`, as `ppo_loss` receives it); see the
    module docstring."""

    actor_config: Any
    seed: int = 0

    @property
    def needs_entropy(self) -> bool:
        """H_t is an input: an entropy bonus, or a tokendyn rule that reads it (ASPO)."""
        return bool(self.actor_config.entropy_coeff) or needs_entropy(self.actor_config.policy_loss)

    def loss(
        self, logp: torch.Tensor, batch: ProbeBatch, entropy: torch.Tensor | None = None
    ) -> torch.Tensor:
        """L of the batch from verl's own functions (module docstring)."""
        from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty

        cfg = self.actor_config
        mask = batch.completion_mask.to(logp.device)
        dtype = logp.dtype
        info = {
            "dp_size": 1,
            "batch_num_tokens": int(mask.sum()),
            "global_batch_size": int(mask.shape[0]),
            "loss_scale_factor": cfg.loss_scale_factor,
        }
        old = logp.detach() if batch.old_logp is None else batch.old_logp.to(logp.device, dtype)
        # verl's rollout correction (`algorithm.rollout_correction`): the weights its actor multiplies into the loss
        is_weights = None if batch.is_ratio is None else batch.is_ratio.to(logp.device, dtype)
        adv = batch.advantages.to(logp.device, dtype)
        keep = mask  # the KL and entropy terms' tokens: a Lopti stage's group (`loss.lopti_ppo_loss`)
        opts = cfg.policy_loss
        if getattr(opts, "loss_mode", None) == LOSS_NAME and opts.lopti_stage != "all":
            keep = stage_mask(old, mask, opts.eta, opts.lopti_stage)
        saved = dict(cfg.global_batch_info)
        cfg.global_batch_info.update(info)  # ppo_loss sets these from the batch the same way
        if needs_entropy(opts):
            if entropy is None:
                raise ValueError(
                    f"verl objective: base_loss_mode {opts.base_loss_mode!r} needs the entropies H_t"
                )
            opts.token_entropy = (
                entropy.detach()
            )  # as `loss.entropy_ppo_loss` hands them to the loss in training
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                loss, _ = get_policy_loss_fn(cfg.policy_loss.get("loss_mode", "vanilla"))(
                    old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
                    loss_agg_mode=cfg.loss_agg_mode, config=cfg, rollout_is_weights=is_weights,
                )  # fmt: skip
            if entropy is not None and cfg.entropy_coeff:
                ent = agg_loss(
                    loss_mat=entropy * keep.to(dtype), loss_mask=mask, loss_agg_mode=cfg.loss_agg_mode, **info
                )
                loss = loss - cfg.entropy_coeff * ent
            if cfg.use_kl_loss:
                if batch.ref_logp is None:
                    raise ValueError("verl objective: use_kl_loss needs the batch's ref_log_prob")
                ref = batch.ref_logp.to(logp.device, dtype)
                kld = kl_penalty(logprob=logp, ref_logprob=ref, kl_penalty=cfg.kl_loss_type)
                kl = agg_loss(
                    loss_mat=kld * keep.to(dtype), loss_mask=mask, loss_agg_mode=cfg.loss_agg_mode, **info
                )
                loss = loss + kl * cfg.kl_loss_coef
        finally:
            cfg.global_batch_info.clear()
            cfg.global_batch_info.update(saved)
            if needs_entropy(opts):
                opts.token_entropy = None
        return loss

    def terms(
        self, logp: torch.Tensor, batch: ProbeBatch, entropy: torch.Tensor | None = None
    ) -> torch.Tensor:
        """l_t (B, C), zero on padding (module docstring)."""
        mask = batch.completion_mask.to(logp.device)
        if self.needs_entropy:
            if entropy is None:
                raise ValueError("verl objective: an entropy bonus needs the entropies H_t")
            grads, value = torch.func.grad_and_value(lambda lp, h: self.loss(lp, batch, h), argnums=(0, 1))(
                logp.detach(), entropy.detach()
            )
            w, u = grads
            first = w * (logp - logp.detach()) + u * (entropy - entropy.detach())
        else:
            w, value = torch.func.grad_and_value(lambda lp: self.loss(lp, batch))(logp.detach())
            first = w * (logp - logp.detach())
        m = mask.to(logp.dtype)
        spread = value.detach() * m / m.sum().clamp(min=1.0)
        return torch.where(mask, first + spread, torch.zeros_like(first))


AGGREGATIONS = {"token-mean": "bnpo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum": "luspo"}
DPPO_MODES = {"dppo_tv": "dppo_tv_delta", "dppo_kl": "dppo_kl_delta"}


def tokendyn_objective(actor_config):
    """The tokendyn `Objective` (`tokendyn.probe.objective`) that trains what a verl actor config trains, for the
    base modes tokendyn has a rule for; else a `VerlConfigError` in one line naming what it would not reproduce.

    base mode (``loss_mode``, or ``base_loss_mode`` under "tokendyn")   -> ``policy_loss`` and its parameters
        dppo_tv / dppo_kl   -> dppo_tv / dppo_kl, delta = clip_ratio_low = clip_ratio_high (verl's delta; the rule
                               has one), dppo_is_cap = clip_ratio_c (verl's C)
        aspo / ce_gppo      -> the rule, its parameters from the loss config, eps from clip_ratio_low / _high
    loss_agg_mode -> ``loss_type``: token-mean -> bnpo (p_t / N), seq-mean-token-mean -> grpo (p_t / (n_i B)),
        seq-mean-token-sum -> luspo (p_t / B), seq-mean-token-sum-norm with loss_scale_factor S -> dr_grpo with
        max_completion_length S (the batch taken as one rank, as `VerlObjective` takes it).

    The advantage rewrites (reweight_alpha, logp_reweight_c, a Lopti stage) act on the batch, not the objective:
    the batch's advantages are `loss.stage_advantages` of verl's. Not reproduced, each refused: verl's other modes
    (vanilla's dual clip, gspo, geo_mean, ... have no tokendyn rule of the same formula; the analyses inside verl
    run verl's own function, `VerlObjective`, for every mode), a KL loss (verl's kl_loss_type estimators), an
    entropy bonus, token-sum aggregation."""
    from tokendyn.integrations.verl.loss import rule_objective
    from tokendyn.probe.objective import Objective

    cfg = actor_config
    opts = cfg.policy_loss
    tokendyn = getattr(opts, "loss_mode", None) == LOSS_NAME
    mode = opts.base_loss_mode if tokendyn else opts.get("loss_mode", "vanilla")
    agg = cfg.loss_agg_mode
    extra = {}
    if agg == "seq-mean-token-sum-norm" and cfg.loss_scale_factor is not None:
        loss_type = "dr_grpo"
        extra["max_completion_length"] = int(cfg.loss_scale_factor)
    elif agg in AGGREGATIONS:
        loss_type = AGGREGATIONS[agg]
    else:
        raise VerlConfigError(
            f"actor.loss_agg_mode: {agg!r} has no tokendyn Objective aggregation (token-mean, seq-mean-token-mean, "
            "seq-mean-token-sum, or seq-mean-token-sum-norm with loss_scale_factor set)"
        )
    if cfg.use_kl_loss or cfg.entropy_coeff:
        raise VerlConfigError(
            "actor.use_kl_loss / entropy_coeff: the tokendyn Objective of a verl config reproduces the policy loss "
            f"alone, got use_kl_loss={cfg.use_kl_loss!r}, entropy_coeff={cfg.entropy_coeff!r}"
        )
    if mode in TOKENDYN_RULES:
        return replace_loss_type(rule_objective(cfg), loss_type, extra)
    if mode in DPPO_MODES:
        eps = float(cfg.clip_ratio)
        low = float(cfg.clip_ratio_low) if cfg.clip_ratio_low is not None else eps
        high = float(cfg.clip_ratio_high) if cfg.clip_ratio_high is not None else eps
        if low != high:
            raise VerlConfigError(
                f"actor.clip_ratio_low / clip_ratio_high: {mode}'s delta must be one number for the tokendyn rule "
                f"(verl's takes the low one for A <= 0, the high one for A > 0), got {low!r} and {high!r}"
            )
        return Objective(
            loss_type=loss_type, policy_loss=mode, dppo_is_cap=float(cfg.clip_ratio_c), **{DPPO_MODES[mode]: high},
            **extra,
        )  # fmt: skip
    raise VerlConfigError(
        f"actor.policy_loss: verl's {mode!r} has no tokendyn Objective of the same formula (those: "
        f"{', '.join([*DPPO_MODES, *TOKENDYN_RULES])}); the analyses inside verl run verl's own function for it"
    )


def replace_loss_type(objective, loss_type: str, extra: dict):
    """``objective`` with verl's aggregation (`tokendyn_objective`)."""
    from dataclasses import replace

    return replace(objective, loss_type=loss_type, **extra)
