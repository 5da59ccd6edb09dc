"""The paired comparison's step makers (`tokendyn.effects.compare`): a copy of the run's optimizer, and SGD whose step
has a given norm (equal_norm)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tokendyn.effects.change import InPlaceUpdate, OptimizerFactory, _state_to_host
from tokendyn.effects.shares import dot64
from tokendyn.probe.float64 import original
from tokendyn.probe.parallel import local, sum_over_ranks


def optimizer_copy(optimizer: torch.optim.Optimizer) -> OptimizerFactory:
    """A factory of copies of ``optimizer`` (unwrapped from accelerate's wrapper): same class, same parameter groups
    and hyperparameters (the current learning rate included), its state copied (cast to the stepped parameters'
    dtype: float64 copies of them, `tokendyn.probe.float64`), so that its steps leave the original and its state
    untouched."""
    inner = getattr(optimizer, "optimizer", optimizer)

    def make(params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        # the parameters stepped, by the run's parameter each is (or, float64 steps, stands in for)
        by_original = {id(original(p)): p for p in params}
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [by_original[id(p)] for p in g["params"] if id(p) in by_original],
            }
            for g in inner.param_groups
        ]
        copy = type(inner)(groups)
        copy.load_state_dict(_state_to_host(inner.state_dict()))
        return copy

    return make


class NormalizedSGD(torch.optim.Optimizer):
    """SGD whose step has a given norm: theta <- theta - (target / ||g||) g over all parameters (float64 norm, summed
    over FSDP2 ranks), or plain SGD theta <- theta - lr g while ``target`` is None; ``grad_norm`` keeps the last
    ||g||. ``norm_lr`` set (and ``target`` None): the step sets ``target`` = norm_lr ||g|| and is made as every later
    one, (target / ||g||) g, so that a rule with the same gradient makes bitwise the same step. No state: its steps are
    exactly undone by restoring the parameters."""

    def __init__(self, params, model: nn.Module, lr: float) -> None:
        super().__init__(params, {"lr": float(lr)})
        self.model, self.target, self.grad_norm = model, None, float("nan")
        self.norm_lr: float | None = None

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        scales = self.step_scales(params, [p.grad for p in params])
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-scales[id(p)])

    def step_scales(self, params: list[torch.Tensor], grads: list[torch.Tensor | None]) -> dict[int, float]:
        """id(parameter) -> s of the step theta - s g with the gradients ``grads`` of ``params`` (``grad_norm`` and,
        with ``norm_lr``, ``target`` set as the step sets them); `tokendyn.effects.change.InPlaceUpdate` makes
        the step itself as new tensors (no copy of theta_0 then)."""
        sq = torch.tensor(
            [sum(dot64(local(x), local(x)) for x in grads if x is not None)], dtype=torch.float64
        )
        self.grad_norm = float(sum_over_ranks(sq, self.model)) ** 0.5
        if (
            self.target is None and self.norm_lr is not None
        ):  # the first rule: its own step at norm_lr sets it
            self.target = self.norm_lr * self.grad_norm
        scales = {}
        for group in self.param_groups:
            if self.target is None:
                scale = group["lr"]
            else:
                scale = self.target / self.grad_norm if self.grad_norm > 0 else 0.0
            scales.update({id(p): float(scale) for p in group["params"]})
        return scales


def _set_lr(update: InPlaceUpdate, lr: float) -> None:
    for group in update.optimizer.param_groups:
        group["lr"] = lr
