"""verl's own loss as the rebalancing analyses' objective, so that every verl loss mode (vanilla, gspo, cispo, sapo,
clip_cov, kl_cov, ..., tokendyn's own) is analysed exactly as it is trained.

The loss is what verl's `ppo_loss` computes from the per-token log-probs of a batch, with verl's own functions:

    L = policy_loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config)   (registered mode)
        - entropy_coeff * agg_loss(H, response_mask)                         (when the actor has an entropy bonus)
        + kl_loss_coef * agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type), response_mask)   (use_kl_loss)

(in a Lopti stage the KL and entropy matrices are restricted to the stage's group, as `loss.lopti_ppo_loss` trains)

on the analysed sample taken as the whole batch (one rank: dp_size 1, the sample's token count as the global
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

from tokendyn.integrations.verl.loss import LOSS_NAME, stage_mask
from tokendyn.probe.tokenloss import ProbeBatch


@dataclass(frozen=True)
class VerlObjective:
    """The loss of a verl actor config (`FSDPActorConfig` / `ActorConfig`, as `ppo_loss` receives it); see the
    module docstring."""

    actor_config: Any
    seed: int = 0

    @property
    def needs_entropy(self) -> bool:
        return bool(self.actor_config.entropy_coeff)

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
        adv = batch.advantages.to(logp.device, dtype)
        keep = mask  # the KL and entropy terms' tokens: a Lopti stage's group (`loss.lopti_ppo_loss`)
        opts = cfg.policy_loss
        if getattr(opts, "loss_mode", None) == LOSS_NAME and opts.lopti_stage != "all":
            keep = stage_mask(old, mask, opts.eta, opts.lopti_stage)
        saved = dict(cfg.global_batch_info)
        cfg.global_batch_info.update(info)  # ppo_loss sets these from the batch the same way
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                loss, _ = get_policy_loss_fn(cfg.policy_loss.get("loss_mode", "vanilla"))(
                    old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
                    loss_agg_mode=cfg.loss_agg_mode, config=cfg, rollout_is_weights=None,
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
