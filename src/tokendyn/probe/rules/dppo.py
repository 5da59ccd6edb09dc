"""DPPO-Binary-TV and DPPO-Binary-KL (Qi et al., arXiv 2602.04879): PPO's ratio clip replaced by a trust-region mask
on the probability itself, with truncated importance sampling; as verl 0.9.1's registered "dppo_tv" / "dppo_kl"
(`verl.trainer.ppo.core_algos.compute_policy_loss_dppo_tv`, `_kl`), anchored at pi_old."""

from __future__ import annotations

import torch

from tokendyn.probe.rules.base import Param, SurrogateRule, TokenInputs, positive


def _truncated_ratio(o, t: TokenInputs) -> torch.Tensor:
    """sg(min(r_t, C)), r_t = exp(clamp(log pi_t - log pi_old,t, -20, 20))."""
    r = torch.exp(torch.clamp(t.logp - t.old, -20.0, 20.0))
    return torch.clamp(r, max=o.dppo_is_cap).detach()


def dppo_tv(o, t: TokenInputs) -> torch.Tensor:
    """pg_t = -A_t sg(min(r_t, C)) log pi_t M_t, so dL/dlog pi_t = -A_t min(r_t, C) M_t / N:
    M_t = 1[pi_t - pi_old,t <= delta] if A_t > 0, else 1[pi_t - pi_old,t >= -delta]   (delta = dppo_tv_delta)."""
    prob, old_prob = torch.exp(t.logp.detach()), torch.exp(t.old)
    keep = torch.where(t.adv > 0, prob - old_prob <= o.dppo_tv_delta, prob - old_prob >= -o.dppo_tv_delta)
    return -t.adv * _truncated_ratio(o, t) * t.masked_logp * keep.to(t.logp.dtype)


def dppo_kl(o, t: TokenInputs) -> torch.Tensor:
    """pg_t = -A_t sg(min(r_t, C)) log pi_t M_t with the Bernoulli KL
    D_t = pi_old log(pi_old / pi) + (1 - pi_old) log((1 - pi_old + 1e-8) / (1 - pi + 1e-8)):
    M_t = 1[D_t <= delta or pi_t <= pi_old,t] if A_t > 0, else 1[D_t <= delta or pi_t >= pi_old,t]."""
    lp = t.logp.detach()
    prob, old_prob = torch.exp(lp), torch.exp(t.old)
    d = old_prob * (t.old - lp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    inside = d <= o.dppo_kl_delta
    keep = torch.where(t.adv > 0, inside | (prob <= old_prob), inside | (prob >= old_prob))
    return -t.adv * _truncated_ratio(o, t) * t.masked_logp * keep.to(t.logp.dtype)


CAP = Param(
    "dppo_is_cap",
    10000.0,
    "DPPO: C, the truncation of the importance ratio sg(min(r, C)) (the authors' run: 10000, i.e. off; verl's "
    "ActorConfig.clip_ratio_c: 3.0). > 0.",
    "> 0",
    positive,
)
DPPO_TV = SurrogateRule(
    dppo_tv,
    "policy_loss",
    "DPPO-TV",
    "Qi et al. arXiv 2602.04879; verl 0.9.1 'dppo_tv'",
    params=(
        Param(
            "dppo_tv_delta",
            0.15,
            "DPPO-TV: delta, the trust region on pi - pi_old (the authors' recipe: 0.15). > 0.",
            "> 0",
            positive,
        ),
        CAP,
    ),
)
DPPO_KL = SurrogateRule(
    dppo_kl,
    "policy_loss",
    "DPPO-KL",
    "Qi et al. arXiv 2602.04879; verl 0.9.1 'dppo_kl'",
    params=(
        Param(
            "dppo_kl_delta",
            0.05,
            "DPPO-KL: delta, the trust region on the Bernoulli KL of pi_old to pi (the authors' recipe: 0.05). > 0.",
            "> 0",
            positive,
        ),
        CAP,
    ),
)
