"""How `tokendyn.effects.inplace.InPlaceUpdate` steps: the analysis optimizer (plain SGD by default), whether its
step is swapped in as new tensors (theta_0 never written), and the precision it steps in."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from tokendyn.probe.parallel import local
from tokendyn.probe.tokenloss import (
    trainable_parameters,
)
from tokendyn.vocab import FLOAT64, FLOAT64_STEP

OptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


def sgd(lr: float = 1e-3) -> OptimizerFactory:
    """The paper's diagnostic optimizer: plain SGD (no momentum, no weight decay)."""
    if not float(lr) > 0:
        raise ValueError(f"change: lr must be > 0, got {lr!r}")
    return lambda params: torch.optim.SGD(params, lr=float(lr), momentum=0.0, weight_decay=0.0)


def _like(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The gradient g (FSDP2: this rank's shard) in the layout of the parameter p (a DTensor: the same shard)."""
    if local(p) is p:
        return g
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())


def _plain_sgd(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps theta - s g with a scalar s per parameter and no state: plain SGD
    (`torch.optim.SGD` itself: no momentum, weight decay, nesterov or maximize, float learning rates: s = lr), or an
    optimizer saying so with a ``step_scales(params, grads) -> {id(param): s}`` method (the comparison's
    `NormalizedSGD`). `InPlaceUpdate` then makes its step as new tensors swapped into the parameters
    (``torch.add(theta, g, alpha=-s)``: the kernel of their own ``add_``, so the same floats), so that theta_0 is
    never written and needs no copy."""
    if hasattr(optimizer, "step_scales"):
        return True
    return type(optimizer) is torch.optim.SGD and all(
        (g["momentum"], g["weight_decay"], g["nesterov"], g["maximize"]) == (0, 0, False, False)
        and not torch.is_tensor(g["lr"])
        for g in optimizer.param_groups
    )


def swaps_steps(model: nn.Module) -> bool:
    """Whether `InPlaceUpdate` makes plain SGD's steps in the model's dtype as new tensors swapped in (`_plain_sgd`):
    for unsharded parameters in host memory (CPU), where theta_0 then needs no host copy, so a parameter-sized buffer
    more (the stepped tensors, a kept gradient) costs no more than that copy did. On a GPU the copy of theta_0 goes to
    host memory and the step is in place: no second copy of the parameters on the device."""
    params = list(trainable_parameters(model).values())
    return not _sharded(model) and all(p.device.type == "cpu" for p in params)


def _step_scales(optimizer: torch.optim.Optimizer, params: list, grads: list) -> dict[int, float]:
    """id(parameter) -> s of a `_plain_sgd` optimizer's step theta - s g with these gradients."""
    if hasattr(optimizer, "step_scales"):
        return optimizer.step_scales(params, grads)
    return {id(p): float(group["lr"]) for group in optimizer.param_groups for p in group["params"]}


def _swap_in(params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """Each parameter's data replaced by the same-named tensor (no copy, nothing written)."""
    for n, p in params.items():
        p.data = tensors[n]


def step_mode(model: nn.Module, optimizer: OptimizerFactory, precision: str) -> str:
    """The precision `InPlaceUpdate` steps in for ``precision``: "float64_step" with another optimizer than plain
    SGD is "float64" (its state in float64 too, every op float64); on an FSDP2-sharded model "float64" is
    "float64_step" (no float64 backward of a sharded model: the gradient in the shards' dtype), which needs plain
    SGD there."""
    precision = _sharded_float64_mode(model, precision)
    if precision == FLOAT64_STEP and not _plain_sgd(optimizer(list(trainable_parameters(model).values()))):
        if _sharded(model):
            raise ValueError(
                "change: float64 steps of an FSDP2-sharded model need plain SGD (step_precision 'model' for "
                "another optimizer)"
            )
        precision = FLOAT64
    return precision


def _sharded_float64_mode(model: nn.Module, precision: str) -> str:
    """Precision "float64" on an FSDP2-sharded model is "float64_step" (no float64 backward of a sharded model)."""
    return FLOAT64_STEP if precision == FLOAT64 and _sharded(model) else precision


def _sharded(model: nn.Module) -> bool:
    return any(local(p) is not p for p in model.parameters())
