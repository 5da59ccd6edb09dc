"""What every per-token rule is: a pure function of the token tensors (`TokenInputs`) and the objective's fields,
returning pg_t, the token's policy-gradient term before the objective's masks, KL term and aggregation
(`tokendyn.probe.tokenloss.loss_terms`), with its parameters (`Param`: name, published default, allowed values)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenInputs:
    """The tensors a rule reads, (B, C) each: ``logp`` log pi_t (differentiable), ``old`` log pi_old,t (detached;
    log pi_t detached when the batch is on-policy), ``log_ratio`` the token log-ratio (0 on padding), ``ratio`` r_t
    (the token's, or the sequence's with ``importance_sampling_level="sequence"``), ``adv`` A_t, ``mask`` the
    completion mask (bool); optional: ``is_ratio`` vLLM's importance-sampling correction ((B, C) or (B, 1)),
    ``entropy`` H_t (detached), ``proxy_logp`` log pi_proxy(o_t) (Lp-Reg)."""

    logp: torch.Tensor
    old: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    is_ratio: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    proxy_logp: torch.Tensor | None = None

    @property
    def masked_logp(self) -> torch.Tensor:
        """log pi_t on completion tokens, 0 on padding."""
        return torch.where(self.mask, self.logp, torch.zeros_like(self.logp))


def _number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def positive(v) -> bool:
    return _number(v) and v > 0


def nonnegative(v) -> bool:
    return _number(v) and v >= 0


def above_one(v) -> bool:
    return _number(v) and v > 1


def open_unit(v) -> bool:
    return _number(v) and 0 < v < 1


def half_open_unit(v) -> bool:
    return _number(v) and 0 < v <= 1


def closed_unit(v) -> bool:
    return _number(v) and 0 <= v <= 1


def finite(v) -> bool:
    return _number(v)


@dataclass(frozen=True)
class Param:
    """One parameter of a rule: a field of `Objective` and (unless ``trl``: TRL's `GRPOConfig` has it already) of
    `TokendynGRPOConfig`, with its published default; ``allowed`` is what the error message names."""

    name: str
    default: float
    help: str
    allowed: str
    check: Callable[[float], bool]
    trl: bool = False

    def problem(self, value) -> str | None:
        """None, or the one-line error naming the field and the allowed values."""
        if self.check(value):
            return None
        return f"{self.name} must be {self.allowed}, got {value!r}"


@dataclass(frozen=True)
class SurrogateRule:
    """A registered rule: ``fn(objective, inputs) -> pg`` (B, C); ``kind`` "loss_type" (a TRL loss type: chosen by
    ``Objective.loss_type``) or "policy_loss" (replaces PPO's surrogate: ``Objective.policy_loss``); ``title`` its name
    in records and figures; ``needs_clip``: uses eps_low / eps_high; ``needs_entropy``: reads H_t; ``needs_proxy``:
    reads Lp-Reg's log pi_proxy; ``source``: where the formula comes from."""

    fn: Callable[..., torch.Tensor]
    kind: str
    title: str
    source: str
    params: tuple[Param, ...] = ()
    needs_clip: bool = False
    needs_entropy: bool = False
    needs_proxy: bool = False

    def __call__(self, objective, inputs: TokenInputs) -> torch.Tensor:
        return self.fn(objective, inputs)
