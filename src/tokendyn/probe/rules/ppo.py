"""PPO's clipped surrogate as TRL 1.16 computes it (loss types grpo, bnpo, dr_grpo, dapo, luspo)."""

from __future__ import annotations

import torch

from tokendyn.probe.rules.base import SurrogateRule, TokenInputs


def ppo_clip(o, t: TokenInputs) -> torch.Tensor:
    """pg_t = -min(min(r_t, delta) A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)   (eps set; delta optional)
    pg_t = -r_t A_t                                                                  (eps None: plain surrogate)"""
    capped = t.ratio if o.delta is None else torch.clamp(t.ratio, max=o.delta)
    if o.eps_low is None:
        return -capped * t.adv
    clipped = torch.clamp(t.ratio, 1.0 - o.eps_low, 1.0 + o.eps_high)
    return -torch.minimum(capped * t.adv, clipped * t.adv)


PPO = SurrogateRule(ppo_clip, "loss_type", "GRPO", "TRL 1.16 GRPOTrainer._compute_loss")
