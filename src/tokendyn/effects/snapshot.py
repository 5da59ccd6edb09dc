"""Bitwise copies of parameters and optimizer state in host memory, taken and put back tensor by tensor: the saved
points of `tokendyn.effects.inplace.InPlaceUpdate`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokendyn.probe.parallel import local


class HostSnapshot:
    """A bitwise copy of tensors in host memory (CPU; pinned when they live on a GPU), taken and put back tensor by
    tensor: at no time is there a second copy of all of them on the device."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = {n: _to_host(local(t)) for n, t in tensors.items()}  # FSDP2: this rank's shard

    @classmethod
    def borrowed(cls, tensors: dict[str, torch.Tensor]) -> HostSnapshot:
        """The tensors themselves (detached, no copy, wherever they live), for tensors nothing writes while the
        snapshot is held: the model's own weights while float64 copies stand in for them (`InPlaceUpdate`)."""
        snap = cls.__new__(cls)
        snap.tensors = {n: local(t).detach() for n, t in tensors.items()}
        return snap

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy every saved tensor back into the (same-named, same-shape) tensor given, in place."""
        with torch.no_grad():
            for n, t in tensors.items():
                local(t).copy_(self.tensors[n])


def _to_host(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone()
    try:  # pinned: faster copies to and from the GPU
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    except RuntimeError:  # pinning refused (e.g. a locked-memory limit): pageable memory
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return out.copy_(t)


def _state_to_host(obj):
    """An optimizer ``state_dict`` with every tensor copied to host memory (the state is not aliased)."""
    if torch.is_tensor(obj):  # (a DTensor's state, FSDP2, stays a copy of its shard on the device)
        return obj.detach().clone() if local(obj) is not obj else _to_host(obj)
    if isinstance(obj, dict):
        return {k: _state_to_host(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_state_to_host(v) for v in obj)
    return obj


@dataclass
class Saved:
    """The parameters and the analysis optimizer's state at one point of an `InPlaceUpdate` (host memory)."""

    params: HostSnapshot
    optimizer: dict
