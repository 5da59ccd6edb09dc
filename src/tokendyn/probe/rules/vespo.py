"""VESPO's gamma sequence weight, TRL 1.16's loss_type "vespo"."""

from __future__ import annotations

import math

import torch

from tokendyn.probe.rules.base import Param, SurrogateRule, TokenInputs, finite


def vespo(o, t: TokenInputs) -> torch.Tensor:
    """pg_t = -phi_i A_t log pi_t,  phi_i = exp(lam + k log W_i - lam W_i), detached, (k, lam) = (k_+, lam_+) where
    A >= 0 else (k_-, lam_-), log W_i = clamp(sum_t m_t clamp(log r_t, -20, 20) + sum_t clamp(log rho_t, log 1e-8,
    20), log 1e-8, 20) (normalised so phi(1) = 1; a non-finite phi is 0)."""
    return -vespo_weights(o, t.log_ratio, t.adv, t.mask, t.is_ratio) * t.adv * t.masked_logp


def vespo_weights(o, token_log_ratio, adv, mask, is_ratio) -> torch.Tensor:
    """phi_i of `vespo`, (B, C), detached."""
    m = mask.to(token_log_ratio.dtype)
    lower = math.log(1e-8)
    log_w = (torch.clamp(token_log_ratio.detach(), -20.0, 20.0) * m).sum(-1, keepdim=True)
    if is_ratio is not None:
        log_w = log_w + torch.clamp(torch.log(is_ratio), lower, 20.0).sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, lower, 20.0)
    nonneg = adv >= 0  # per token, as TRL's where() on (B, 1) or per-token (B, T) advantages
    k = torch.where(nonneg, o.vespo_k_pos, o.vespo_k_neg).to(log_w.dtype)
    lam = torch.where(nonneg, o.vespo_lambda_pos, o.vespo_lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


VESPO = SurrogateRule(
    vespo,
    "loss_type",
    "VESPO",
    "TRL 1.16",
    params=(
        Param("vespo_k_pos", 2.0, "VESPO: k for A >= 0 (TRL's field)", "a finite number", finite, trl=True),
        Param(
            "vespo_lambda_pos",
            3.0,
            "VESPO: lambda for A >= 0 (TRL's field)",
            "a finite number",
            finite,
            trl=True,
        ),
        Param("vespo_k_neg", 3.0, "VESPO: k for A < 0 (TRL's field)", "a finite number", finite, trl=True),
        Param(
            "vespo_lambda_neg",
            2.0,
            "VESPO: lambda for A < 0 (TRL's field)",
            "a finite number",
            finite,
            trl=True,
        ),
    ),
)
