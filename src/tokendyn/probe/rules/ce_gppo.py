"""CE-GPPO, gradient-preserving clipping (Su et al., arXiv 2509.20712; Kwai-Klear/CE-GPPO
``compute_gppo_loss_general_beta``): clipped tokens keep a bounded gradient."""

from __future__ import annotations

import torch

from tokendyn.probe.rules.base import Param, SurrogateRule, TokenInputs, above_one, nonnegative


def ce_gppo(o, t: TokenInputs) -> torch.Tensor:
    """pg_t = -beta1 (1 - eps_low) (r / sg r) A   if A < 0 and r < 1 - eps_low
              -beta2 (1 + eps_high) (r / sg r) A  if A > 0 and r > 1 + eps_high
              -r A                                otherwise;
    then for A < 0: min(pg_t, -c A) (dual clip: no gradient for r > c). So dL/dlog pi = -w A / N with
    w = beta1 (1 - eps_low), beta2 (1 + eps_high), r, or 0."""
    r, a = t.ratio, t.adv
    grad_only = r / r.detach()
    low = (r < 1.0 - o.eps_low) & (a < 0)
    high = (r > 1.0 + o.eps_high) & (a > 0)
    pg = torch.where(
        low,
        -o.ce_gppo_beta1 * (1.0 - o.eps_low) * grad_only * a,
        torch.where(high, -o.ce_gppo_beta2 * (1.0 + o.eps_high) * grad_only * a, -r * a),
    )
    return torch.where(a < 0, torch.minimum(pg, -a * o.ce_gppo_dual_clip), pg)


CE_GPPO = SurrogateRule(
    ce_gppo,
    "policy_loss",
    "CE-GPPO",
    "Su et al. arXiv 2509.20712; Kwai-Klear/CE-GPPO compute_gppo_loss_general_beta",
    params=(
        Param(
            "ce_gppo_beta1",
            0.5,
            "CE-GPPO: beta1, the gradient kept on clipped A < 0 tokens (the authors: 0.5 at 1.5B, 0.75 at 7B). >= 0.",
            ">= 0",
            nonnegative,
        ),
        Param(
            "ce_gppo_beta2",
            1.0,
            "CE-GPPO: beta2, the gradient kept on clipped A > 0 tokens (1.0). >= 0.",
            ">= 0",
            nonnegative,
        ),
        Param(
            "ce_gppo_dual_clip",
            10.0,
            "CE-GPPO: dual clip c for A < 0 (the authors: 10). > 1.",
            "> 1",
            above_one,
        ),
    ),
    needs_clip=True,
)
