"""Every per-token rule tokendyn trains and analyses, registered by name: the one table (`SURROGATES`) the trainer's
loss, the analyses' `Objective`, the paired comparison and the docs read. Each rule is a small pure function in its
own module, its formula in its docstring and its parameters (published defaults, allowed values) beside it, as
opacus registers one grad-sampler per layer type. Adding a rule: write its module, add one line here.

Advantage rules (Advantage Reweighting, the Delta-log-p reweight, W-REINFORCE, REINFORCE++) change A_t before any
loss and live in `tokendyn.remedies`."""

from __future__ import annotations

from tokendyn.probe.rules.aspo import ASPO
from tokendyn.probe.rules.base import Param, SurrogateRule, TokenInputs
from tokendyn.probe.rules.ce_gppo import CE_GPPO
from tokendyn.probe.rules.cispo import CISPO
from tokendyn.probe.rules.cov import CLIP_COV, KL_COV
from tokendyn.probe.rules.dppo import DPPO_KL, DPPO_TV
from tokendyn.probe.rules.lp_reg import LP_REG
from tokendyn.probe.rules.ppo import PPO
from tokendyn.probe.rules.sapo import SAPO
from tokendyn.probe.rules.vespo import VESPO

SURROGATES: dict[str, SurrogateRule] = {
    # TRL's loss types (Objective.loss_type; grpo, bnpo, dr_grpo, dapo, luspo share "ppo")
    "ppo": PPO,
    "cispo": CISPO,
    "sapo": SAPO,
    "vespo": VESPO,
    # rules that replace PPO's surrogate (Objective.policy_loss)
    "clip_cov": CLIP_COV,
    "kl_cov": KL_COV,
    "dppo_tv": DPPO_TV,
    "dppo_kl": DPPO_KL,
    "aspo": ASPO,
    "ce_gppo": CE_GPPO,
    "lp_reg": LP_REG,
}

POLICY_LOSSES = ("ppo", *(n for n, r in SURROGATES.items() if r.kind == "policy_loss"))


def params() -> tuple[Param, ...]:
    """Every rule's parameters, each once (a parameter two rules share, e.g. DPPO's C, is listed once)."""
    seen: dict[str, Param] = {}
    for rule in SURROGATES.values():
        for p in rule.params:
            seen.setdefault(p.name, p)
    return tuple(seen.values())


def surrogate_name(objective) -> str:
    """The registered rule an objective trains: its ``policy_loss`` unless "ppo", else its ``loss_type`` where that
    is a rule of its own (cispo, sapo, vespo), else "ppo"."""
    if objective.policy_loss != "ppo":
        return objective.policy_loss
    rule = SURROGATES.get(objective.loss_type)
    return objective.loss_type if rule is not None and rule.kind == "loss_type" else "ppo"


__all__ = ["POLICY_LOSSES", "SURROGATES", "Param", "SurrogateRule", "TokenInputs", "params", "surrogate_name"]
