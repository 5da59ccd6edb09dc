"""Data parallelism and sharded parameters, as the probe sees them.

Under DDP and FSDP2 every process runs the backward of its own loss L_r and the wrapper *averages* the parameter
gradients over the n processes, so the update is the gradient of L = (1/n) sum_r L_r. The probe's hooks see
dL_r/dh and dL_r/dlog pi on their process; the token's share of the update is 1/n of that. TRL builds L_r so that
L is the one-process loss of the whole batch (it multiplies each rank's loss by n, e.g. the DAPO normaliser
`num_items_in_batch / num_processes`), so the records, divided by n, equal a one-process run on the global batch.

FSDP2 (`torch.distributed.fsdp.fully_shard`) stores each parameter as a DTensor shard outside its module's forward
and backward; `full_weight` all-gathers one (a collective: every rank must call it in the same order).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _is_dtensor(t: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def is_fully_sharded(model: nn.Module) -> bool:
    """True when some module of the model was sharded with FSDP2 `fully_shard` (its parameters are DTensors)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def check_supported(model: nn.Module) -> None:
    """Refuse the wrappers whose gradients the probe cannot attribute: FSDP1 (flat parameters)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ValueError(
            "probe: FSDP1 (FullyShardedDataParallel, flat parameters) is not supported; shard with FSDP2 "
            "(torch.distributed.fsdp.fully_shard; accelerate: fsdp_version: 2) or use DDP"
        )


def data_parallel_size(model: nn.Module) -> int | None:
    """n, the number of processes that average this model's gradients: the DDP process group's size for a
    `DistributedDataParallel` wrapper, the world size for a model sharded with `fully_shard`; None otherwise."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return int(model.process_group.size())
    if is_fully_sharded(model):
        return _world_size()
    return None


def resolve_data_parallel_size(model: nn.Module, given: int | None) -> int:
    """`given` (validated), else `data_parallel_size(model)`, else 1 (with a warning when several processes run:
    records would then be each process's own gradient, which is right only if nothing averages them)."""
    if given is not None:
        if not isinstance(given, int) or isinstance(given, bool) or given < 1:
            raise ValueError(f"probe: data_parallel_size must be None or an integer >= 1, got {given!r}")
        return given
    n, world = data_parallel_size(model), _world_size()
    if n is None and world > 1:
        warnings.warn(
            f"probe: {world} processes, but the model is neither wrapped in DistributedDataParallel nor sharded "
            "with fully_shard: records are each process's own loss gradient; pass data_parallel_size=n if the "
            "gradients are averaged over n processes (1 to silence this)",
            stacklevel=4,
        )
    return n or 1


def full_weight(t: torch.Tensor | None) -> torch.Tensor | None:
    """The whole (unsharded, detached) tensor of an FSDP2 DTensor parameter; a plain tensor as it is."""
    if t is None:
        return None
    t = t.detach()
    return t.full_tensor() if _is_dtensor(t) else t
