"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"), as verl 0.9.1's policy
loss modes "clip_cov" and "kl_cov"; the token choices are `tokendyn.remedies.clip_cov_keep` / `kl_cov_select`."""

from __future__ import annotations

import torch

from tokendyn.probe.rules.base import Param, SurrogateRule, TokenInputs, finite, half_open_unit, nonnegative
from tokendyn.remedies import CLIP_COV_DEFAULTS, KL_COV_DEFAULTS, clip_cov_keep, kl_cov_select


def clip_cov(o, t: TokenInputs) -> torch.Tensor:
    """pg_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)) c_t,  c_t in {0, 1}: 0 on the tokens Clip-Cov
    detaches (drawn on a generator seeded with ``cov_seed``; None: torch's global one)."""
    generator = None if o.cov_seed is None else torch.Generator().manual_seed(int(o.cov_seed))
    keep = clip_cov_keep(
        t.adv,
        t.logp,
        t.ratio,
        t.mask,
        o.eps_low,
        o.eps_high,
        o.clip_cov_ratio,
        o.clip_cov_lb,
        o.clip_cov_ub,
        generator=generator,
    )
    clipped = torch.clamp(t.ratio, 1.0 - o.eps_low, 1.0 + o.eps_high)
    return torch.maximum(-t.adv * t.ratio, -t.adv * clipped) * keep


def kl_cov(o, t: TokenInputs) -> torch.Tensor:
    """pg_t = -A_t r_t + s_t ppo_kl_coef |log r_t|,  s_t = 1 on the tokens of largest covariance (no clipping)."""
    chosen = kl_cov_select(t.adv, t.logp, t.mask, o.kl_cov_ratio)
    penalty = o.ppo_kl_coef * torch.where(chosen, t.log_ratio.abs(), torch.zeros_like(t.logp))
    return -t.adv * t.ratio + penalty


CLIP_COV = SurrogateRule(
    clip_cov,
    "policy_loss",
    "Clip-Cov",
    "Cui et al. 2025; verl 0.9.1 core_algos 'clip_cov'",
    params=(
        Param(
            "clip_cov_ratio",
            CLIP_COV_DEFAULTS["clip_cov_ratio"],
            "Clip-Cov: fraction of the micro-batch's tokens detached (verl's default 2e-4). (0, 1].",
            "in (0, 1]",
            half_open_unit,
        ),
        Param(
            "clip_cov_lb",
            CLIP_COV_DEFAULTS["clip_cov_lb"],
            "Clip-Cov: lower bound of the covariance of a candidate token (verl's default 1.0).",
            "a finite number",
            finite,
        ),
        Param(
            "clip_cov_ub",
            CLIP_COV_DEFAULTS["clip_cov_ub"],
            "Clip-Cov: upper bound of the covariance of a candidate token (verl's default 5.0).",
            "a finite number",
            finite,
        ),
    ),
    needs_clip=True,
)
KL_COV = SurrogateRule(
    kl_cov,
    "policy_loss",
    "KL-Cov",
    "Cui et al. 2025; verl 0.9.1 core_algos 'kl_cov'",
    params=(
        Param(
            "kl_cov_ratio",
            KL_COV_DEFAULTS["kl_cov_ratio"],
            "KL-Cov: fraction of the micro-batch's tokens penalised (verl's default 2e-4). (0, 1].",
            "in (0, 1]",
            half_open_unit,
        ),
        Param(
            "ppo_kl_coef",
            KL_COV_DEFAULTS["ppo_kl_coef"],
            "KL-Cov: coefficient of the |log ratio| penalty (verl's default 0.1). >= 0.",
            ">= 0",
            nonnegative,
        ),
    ),
)
