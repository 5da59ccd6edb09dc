"""ASPO, asymmetric importance sampling (Wang et al., arXiv 2510.06062; wizard-III/Archer2.0
``compute_policy_loss_archer``): for positive tokens the IS weight is flipped to 1/r inside the clip range."""

from __future__ import annotations

import torch

from tokendyn.probe.rules.base import Param, SurrogateRule, TokenInputs, above_one, open_unit


def aspo_eps(o, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """eps_t = aspo_eps where H_t <= the (1 - aspo_top_entropy)-quantile of H within its sequence (``nanquantile``
    over the completion tokens, dim -1), else aspo_eps_high_entropy (the top-entropy tokens). (B, C)."""
    h = torch.where(mask, entropy.detach(), torch.full_like(entropy, float("nan")))
    q = torch.nanquantile(h, 1.0 - o.aspo_top_entropy, dim=-1, keepdim=True)
    low = torch.full_like(h, o.aspo_eps)
    return torch.where(h <= q, low, torch.full_like(h, o.aspo_eps_high_entropy))


def aspo(o, t: TokenInputs) -> torch.Tensor:
    """r = exp(clamp(log r_t, -20, 20)), c = aspo_dual_clip, eps_t by entropy (`aspo_eps`):
    A > 0:  p = min(r, 1 + eps_t);  pg = -A (p / sg p) / sg p  (value -A / p; dL/dlog pi = -A / r inside, 0 above)
            and where r < 1/c:  pg = -A c log pi  (soft dual clip: weight c)
    A <= 0: pg = -A max(r, 1 - eps_t)  (weight r above 1 - eps_t, 0 below)
            and where r > c:  pg = -A c log pi  (weight c)"""
    eps = aspo_eps(o, t.entropy, t.mask)
    c = o.aspo_dual_clip
    r = torch.exp(torch.clamp(t.log_ratio, -20.0, 20.0))
    p = torch.minimum(r, 1.0 + eps)
    positive_part = -t.adv * (p / p.detach()) / p.detach()
    negative_part = -t.adv * torch.maximum(r, 1.0 - eps)
    soft = -t.adv * c * t.masked_logp
    rd = r.detach()
    pos = torch.where(rd < 1.0 / c, soft, positive_part)
    neg = torch.where(rd > c, soft, negative_part)
    return torch.where(t.adv > 0, pos, neg)


ASPO = SurrogateRule(
    aspo,
    "policy_loss",
    "ASPO",
    "Wang et al. arXiv 2510.06062; Archer2.0 compute_policy_loss_archer",
    params=(
        Param(
            "aspo_eps",
            0.2,
            "ASPO: clip range eps of the low-entropy tokens (0.2). (0, 1).",
            "in (0, 1)",
            open_unit,
        ),
        Param(
            "aspo_eps_high_entropy",
            0.4,
            "ASPO: clip range eps of each sequence's top-entropy tokens (0.4). (0, 1).",
            "in (0, 1)",
            open_unit,
        ),
        Param(
            "aspo_top_entropy",
            0.2,
            "ASPO: fraction of each sequence's tokens, by entropy, that get aspo_eps_high_entropy (0.2). (0, 1).",
            "in (0, 1)",
            open_unit,
        ),
        Param("aspo_dual_clip", 3.0, "ASPO: soft dual clip c (3.0). > 1.", "> 1", above_one),
    ),
    needs_entropy=True,
)
