"""CISPO (MiniMax-M1), TRL 1.16's loss_type "cispo"."""

from __future__ import annotations

import torch

from tokendyn.probe.rules.base import SurrogateRule, TokenInputs


def cispo(o, t: TokenInputs) -> torch.Tensor:
    """pg_t = -sg[min(r_t, eps_high)] A_t log pi_t   (sg: stop-gradient; eps_high None: no cap)"""
    weight = t.ratio if o.eps_high is None else torch.clamp(t.ratio, max=o.eps_high)
    return -weight.detach() * t.adv * t.masked_logp


CISPO = SurrogateRule(cispo, "loss_type", "CISPO", "TRL 1.16 (MiniMax-M1)")
