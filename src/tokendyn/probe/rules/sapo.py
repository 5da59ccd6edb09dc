"""SAPO's soft gate, TRL 1.16's loss_type "sapo"."""

from __future__ import annotations

import torch

from tokendyn.probe.rules.base import Param, SurrogateRule, TokenInputs, positive


def sapo(o, t: TokenInputs) -> torch.Tensor:
    """pg_t = -(4 / tau_t) sigmoid(tau_t (r_t - 1)) A_t,   tau_t = tau_+ if A_t > 0 else tau_-"""
    tau = torch.where(
        t.adv > 0,
        torch.full_like(t.adv, o.sapo_temperature_pos),
        torch.full_like(t.adv, o.sapo_temperature_neg),
    )
    return -torch.sigmoid(tau * (t.ratio - 1.0)) * 4.0 / tau * t.adv


SAPO = SurrogateRule(
    sapo,
    "loss_type",
    "SAPO",
    "TRL 1.16",
    params=(
        Param("sapo_temperature_pos", 1.0, "SAPO: tau for A > 0 (TRL's field)", "> 0", positive, trl=True),
        Param("sapo_temperature_neg", 1.05, "SAPO: tau for A <= 0 (TRL's field)", "> 0", positive, trl=True),
    ),
)
