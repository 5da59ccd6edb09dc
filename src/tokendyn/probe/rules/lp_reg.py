"""Lp-Reg, low-probability regularization (Huang et al., arXiv 2510.03222; CarlanLark/Lp-Reg-dev
``compute_policy_loss_lp_reg``): the lowest-probability negative tokens get a KL pull towards a min-p proxy of
pi_old instead of being pushed down further."""

from __future__ import annotations

import torch

from tokendyn.probe.rules.base import Param, SurrogateRule, TokenInputs, closed_unit, nonnegative, open_unit


def lp_reg_tokens(logp: torch.Tensor, proxy_logp: torch.Tensor, adv, mask, rho: float) -> torch.Tensor:
    """S (bool, (B, C)): of the n valid tokens with A_t < 0, the k = max(1, int(rho n)) of lowest current log pi_t
    (``topk(largest=False)`` in row-major order), none at all when k <= 1 (the authors' quirk), and of those only
    the ones with log pi_t < log pi_proxy(o_t)."""
    flat = torch.nonzero((mask & (adv < 0)).reshape(-1), as_tuple=True)[0]
    chosen = torch.zeros_like(mask).reshape(-1)
    k = max(1, int(flat.numel() * rho)) if flat.numel() else 0
    if k > 1:
        lp = logp.detach().reshape(-1)
        low = flat[torch.topk(lp[flat], k, largest=False).indices]
        low = low[lp[low] < proxy_logp.reshape(-1)[low]]
        chosen[low] = True
    return chosen.reshape(mask.shape)


def lp_reg(o, t: TokenInputs) -> torch.Tensor:
    """t in S (`lp_reg_tokens`):  pg_t = -A_t r_t + beta clamp(pi_proxy/pi_t - log(pi_proxy/pi_t) - 1, -10, 10)
    t not in S:                  pg_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
    so on S dL/dlog pi = (-A r + beta (1 - pi_proxy / pi)) / N (0 for the KL part where the clamp binds)."""
    a, r = t.adv, t.ratio
    ppo = torch.maximum(-a * r, -a * torch.clamp(r, 1.0 - o.eps_low, 1.0 + o.eps_high))
    chosen = lp_reg_tokens(t.logp, t.proxy_logp, a, t.mask, o.lp_reg_rho)
    d = torch.where(chosen, t.proxy_logp - t.logp, torch.zeros_like(t.logp))
    k3 = torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)
    return torch.where(chosen, -a * r + o.lp_reg_beta * k3, ppo)


LP_REG = SurrogateRule(
    lp_reg,
    "policy_loss",
    "Lp-Reg",
    "Huang et al. arXiv 2510.03222; CarlanLark/Lp-Reg-dev compute_policy_loss_lp_reg",
    params=(
        Param(
            "lp_reg_kappa",
            0.02,
            "Lp-Reg: min-p threshold kappa of the proxy, relative to the most likely token (the recipes: 0.02). "
            "(0, 1).",
            "in (0, 1)",
            open_unit,
        ),
        Param(
            "lp_reg_rho",
            0.01,
            "Lp-Reg: fraction rho of the negative-advantage tokens regularised, lowest log pi first (0.01 for "
            "Qwen3-14B, 0.005 for Qwen2.5-32B). [0, 1].",
            "in [0, 1]",
            closed_unit,
        ),
        Param(
            "lp_reg_beta", 1.0, "Lp-Reg: coefficient beta of the KL term (1.0). >= 0.", ">= 0", nonnegative
        ),
    ),
    needs_clip=True,
    needs_proxy=True,
)
