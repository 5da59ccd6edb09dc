"""The "direct" per-token gradient by replaying the layers from their recorded inputs, one layer at a time.

direct_l(t) = ||d log pi_t / d h_l[p(t)]|| (see `direct.py`). The live-graph computation there needs a second
backward through the training graph, which two configurations forbid: FSDP2 (`fully_shard`: the graph's weights
are freed after the forward and re-gathered only by FSDP's own backward hooks, which a second backward would run
out of order) and reentrant activation checkpointing (`torch.utils.checkpoint` refuses `autograd.grad`). Here the
chain rule is run by hand instead, from the top:

    c_N = d log pi / d h_N             (final norm and LM head recomputed from the final norm's recorded input)
    c_{j-1} = c_j . d layer_j / d h_{j-1}   (layer j recomputed from its recorded input h_{j-1}),

with K tokens' seeds batched (`is_grads_batched`; tokens in distinct rows share a seed slot, as in `direct.py`);
c_N starts from u = d log pi / dh at the LM-head input (`direct.head_seed`), so the LM head is not needed here.
The slots go through the whole chain a group at a time: a group of c slots holds its cotangents into and out of one
layer, 2 c x b x S x H x itemsize bytes, which `memory_bytes` caps (`plan_direct`); each group replays the layers
again. Each module is recomputed with its plain `forward` (no FSDP or checkpoint hooks; HF gradient checkpointing
off), its FSDP2 shards all-gathered for that module only (memory: one layer's full weights at a time; with an FSDP2
mixed-precision policy, cast to the dtype FSDP gave the module's inputs), and the random state and autocast state
it had in the forward (dropout masks repeat). The weights are those of the forward (the replay runs before the
training backward and the optimizer step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from tokendyn.probe.direct import _grads, head_seed, plan_direct, row_slots
from tokendyn.probe.parallel import _is_dtensor


@dataclass
class LayerCall:
    """One module call of the forward: the point name of its output, the module, its inputs, and the RNG and
    autocast states it ran under (`LayerCall.record`)."""

    name: str
    module: nn.Module
    args: tuple
    kwargs: dict
    rng: tuple[torch.Tensor, torch.Tensor | None]
    autocast: tuple[bool, torch.dtype]

    @classmethod
    def record(cls, name: str, module: nn.Module, args: tuple, kwargs: dict) -> LayerCall:
        """The call as it starts: (CPU RNG state, CUDA RNG state or None), as torch.utils.checkpoint keeps them,
        and (autocast enabled, its dtype) on the input's device."""
        device = args[0].device
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
        return cls(name, module, tuple(args), dict(kwargs), (torch.get_rng_state(), cuda), autocast)


def _inner(module: nn.Module) -> nn.Module:
    """The module under torch's checkpoint_wrapper (`_checkpoint_wrapped_module`), if any."""
    while isinstance(getattr(module, "_checkpoint_wrapped_module", None), nn.Module):
        module = module._checkpoint_wrapped_module
    return module


@contextmanager
def _plain(module: nn.Module, dtype: torch.dtype | None) -> Iterator[nn.Module]:
    """The module with full (all-gathered, detached; cast to `dtype` if given) weights in place of its FSDP2
    shards and HF gradient checkpointing off, restored on exit."""
    swapped = []
    flags = [(m, m.gradient_checkpointing) for m in module.modules() if hasattr(m, "gradient_checkpointing")]
    try:
        for m, _ in flags:
            m.gradient_checkpointing = False
        for sub in module.modules():
            for name, param in list(sub._parameters.items()):
                if param is not None and _is_dtensor(param):
                    full = param.detach().full_tensor()
                    if dtype is not None and full.is_floating_point():
                        full = full.to(dtype)
                    sub._parameters[name] = full
                    swapped.append((sub, name, param))
        yield module
    finally:
        for m, flag in flags:
            m.gradient_checkpointing = flag
        for sub, name, param in swapped:
            sub._parameters[name] = param


def _run(call: LayerCall, x: torch.Tensor) -> torch.Tensor:
    """The module's plain forward on x (its recorded first argument replaced), as it ran in the forward."""
    module = _inner(call.module)
    kwargs = dict(call.kwargs)
    if (
        kwargs.get("past_key_values") is not None
    ):  # the cache was filled by this very forward: do not refill it
        kwargs["past_key_values"] = None
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    cpu, cuda = call.rng
    devices = [x.device] if cuda is not None else []
    autocast, dtype = call.autocast
    # FSDP2 mixed precision (no autocast): FSDP computed in the dtype it cast the inputs to
    cast = x.dtype if not autocast and x.is_floating_point() else None
    with (
        torch.random.fork_rng(devices=devices),
        _plain(module, cast),
        torch.enable_grad(),
        torch.autocast(x.device.type, dtype=dtype, enabled=autocast),
    ):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, x.device)
        out = module.forward(x, *call.args[1:], **kwargs)
    return out if torch.is_tensor(out) else out[0]


def replay_direct_norms(
    calls: list[LayerCall],
    probed: list[str],
    rows: torch.Tensor,
    positions: torch.Tensor,
    direction: torch.Tensor,
    chunk: int = 8,
    memory_bytes: float | None = None,
    agree: Callable[[int], int] = lambda n: n,
) -> dict[str, torch.Tensor]:
    """{point: [K] float32 ||d log pi_k / d h_point[rows_k, positions_k]||} for the probed points.

    `calls`: every decoder layer then the final norm, in forward order (the input of calls[i] is the output of
    calls[i-1]); `direction` [K, H] = d log pi_k / dh at the LM-head input. Every module from the final norm down to
    the layer after the lowest probed one is recomputed once per group of slots, also with K = 0: under FSDP2 every
    rank must gather the same weights, so `agree` (a max over the ranks there) makes the one-slot size and the
    number of groups the same on every rank. Raises DirectMemoryError when one slot alone is over the cap."""
    device = positions.device
    k_total = rows.shape[0]
    out = {n: torch.full((k_total,), float("nan"), dtype=torch.float32, device=device) for n in probed}
    names = [c.name for c in calls]
    lowest = min(names.index(n) for n in probed)
    slots = row_slots(rows) if k_total else rows
    top = calls[-1]
    x_top = top.args[0]
    slot_bytes = agree(2 * x_top.numel() * x_top.element_size())  # the cotangents into and out of one layer
    ((_, per),) = plan_direct([slot_bytes], chunk, memory_bytes)
    n_slots = int(slots.max()) + 1 if k_total else 0
    n_groups = agree(-(-n_slots // per))

    def record(name: str, grads: torch.Tensor, start: int) -> None:
        if name not in out:
            return
        sel = torch.nonzero((slots >= start) & (slots < start + grads.shape[0])).squeeze(1)
        out[name][sel] = torch.linalg.vector_norm(
            grads[slots[sel] - start, rows[sel], positions[sel]], dim=-1, dtype=torch.float32
        )

    for group in range(n_groups):
        start = group * per
        stop = max(start, min(start + per, n_slots))
        seeds = (slots.unsqueeze(0) == torch.arange(start, stop, device=device).unsqueeze(1)).float()
        x = top.args[0].detach().requires_grad_()
        y = _run(top, x)
        with torch.enable_grad():
            lp = head_seed(y[rows, positions], direction)
        cot = None
        if stop > start:
            gy, cot = _grads(lp, [y, x], seeds)
            record(top.name, gy, start)
            record(names[-2], cot, start)
            del gy
        del y, lp
        for i in range(len(calls) - 2, lowest, -1):  # calls[i] maps h_{i-1} (the output of calls[i-1]) to h_i
            x = calls[i].args[0].detach().requires_grad_()
            y = _run(calls[i], x)
            if cot is not None:
                (cot,) = _grads(y, [x], cot)
                record(names[i - 1], cot, start)
            del y
    return out
