"""A forward that is float64 end to end, and a model in float64 for the length of an analysis.

transformers casts to float32 inside models whatever their dtype: Llama / Qwen2 / Mistral / Qwen3's RMSNorm
(``hidden_states.to(torch.float32)``), Gemma's (``x.float()``), the rotary embedding (``inv_freq.float() @
positions.float()``), the eager attention's softmax (``softmax(..., dtype=torch.float32)``). In a float64 model each
of these rounds to float32 and back, so two float64 computations of the same update differ by 1e-7 .. 3e-4 relative
(a 1e-16 difference flips a float32 rounding), and fully masked rows of the eager softmax turn NaN.

`exact_float64()` is a ``TorchFunctionMode`` that, while it is active, makes every float32 in a torch call a float64:
``Tensor.float()`` is ``Tensor.double()``, a ``torch.float32`` argument (``.to(torch.float32)``, ``dtype=``,
``.type(torch.float32)``) is ``torch.float64``, and so is the default dtype (a tensor made without one). A model
in float64 then computes in float64 at every op (tests/test_step_resolution.py checks every op's dtype on the
configuration matrix's architectures). It changes nothing outside the ``with``; a recomputation in a later backward
(gradient checkpointing) runs under it through `same_mode`.

`as_float64(model)`: float64 copies of the model's floating parameters and buffers in place of them for the length
of a ``with``, and that forward mode on, for analyses whose result must not depend on the model's dtype (a
counterfactual step smaller than the rounding of theta + delta theta in float32 or bf16:
`tokendyn.effects.change.InPlaceUpdate`). Device memory: the float64 copy, 8 bytes per parameter, beside the model,
whose own parameters are not touched (an optimizer, DDP's hooks or a view into them see nothing).

A model sharded with FSDP2 (`fully_shard`: DTensor parameters) is never copied whole: within `as_float64` its
forwards (without grad: pi is measured, a step's gradient is taken in the model's own dtype) gather each
`fully_shard` unit's float64 parameters from float64 shards just before that unit runs and drop them after it
(`_sharded_float64`), so the float64 point costs 8 bytes a parameter / world size, plus one unit's float64
parameters whole while it runs; FSDP2's own hooks (its all-gather in the parameters' dtype, its mixed-precision
casts) are paused meanwhile.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


def _widen(x):
    if x is torch.float32:
        return torch.float64
    if isinstance(x, list | tuple):
        return type(x)(_widen(v) for v in x)
    if isinstance(x, dict):
        return {k: _widen(v) for k, v in x.items()}
    return x


class _Float64Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            return torch.Tensor.double(*args, **kwargs)
        return func(*_widen(args), **_widen(kwargs))


def active() -> bool:
    """Whether an `exact_float64` mode is on."""
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(m, _Float64Mode) for m in _get_current_function_mode_stack())


def same_mode(function):
    """``function`` run under `exact_float64` if that mode is on now (for a recomputation that runs later, in a
    backward, outside it: ``torch.utils.checkpoint``); else ``function`` itself."""
    if not active():
        return function

    @functools.wraps(function)
    def within(*args, **kwargs):
        with exact_float64():
            return function(*args, **kwargs)

    return within


@contextmanager
def exact_float64():
    """Within the ``with``, every torch call's float32 is float64 and so is the default dtype (a tensor made
    without one), module docstring."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with _Float64Mode():
            yield
    finally:
        torch.set_default_dtype(default)


def original(t: torch.Tensor) -> torch.Tensor:
    """The model's own parameter that the float64 copy ``t`` stands in for within `as_float64` (else ``t``)."""
    return getattr(t, "float64_original", t)


@contextmanager
def as_float64(model: nn.Module, values: dict[int, torch.Tensor] | None = None):
    """The model in float64 within the ``with``, computing in float64 at every op (`exact_float64`), autocast off
    (module docstring). Every floating parameter and buffer is replaced, in its module, by a float64 copy (a new
    ``nn.Parameter`` with the same ``requires_grad``; a tensor shared by two modules, a tied embedding, by one copy);
    on exit, also on an exception, the original objects are put back. The originals are never touched: their
    values, ``.grad``, version counters and gradient accumulators (where DDP's and other hooks live; assigning a
    float64 ``.data`` would reset them) stay as they were. FSDP2-sharded parameters (DTensors): `_sharded_float64`.
    ``values``: id(parameter) -> a float64 tensor of its shape that stands in for it as it is (no copy: a point
    other than the model's own, e.g. a step made in float64 from it, `tokendyn.effects.change.InPlaceUpdate`;
    FSDP2: this rank's shard of it)."""
    from tokendyn.probe.parallel import fsdp_modules

    if fsdp_modules(model):
        with _sharded_float64(model, values):
            yield model
        return
    made: dict[int, torch.Tensor] = {}
    entries: list[tuple[dict, str, torch.Tensor]] = []
    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(table.items()):
                if t is None or not t.is_floating_point():
                    continue
                if id(t) not in made:
                    given = values.get(id(t)) if values is not None and is_param else None
                    copy = t.detach().to(torch.float64, copy=True) if given is None else given.detach()
                    if is_param:
                        copy = nn.Parameter(copy, requires_grad=t.requires_grad)
                        copy.float64_original = t  # (`original`: an optimizer's groups name the originals)
                    made[id(t)] = copy
                entries.append((table, name, t))
    try:
        for table, name, t in entries:
            table[name] = made[id(t)]
        device = entries[0][2].device.type if entries else "cpu"
        with torch.autocast(device_type=device, enabled=False), exact_float64():
            yield model
    finally:
        for table, name, t in entries:
            table[name] = t


def _is_fsdp_hook(hook) -> bool:
    return getattr(hook, "__module__", "").startswith("torch.distributed.fsdp")


def _no_hook(*args, **kwargs) -> None:
    return None


@contextmanager
def _sharded_float64(model: nn.Module, values: dict[int, torch.Tensor] | None):
    """`as_float64` for a model sharded with FSDP2: every forward within the ``with`` computes in float64, without
    grad, at the float64 point whose shards are ``values`` (id(parameter) -> this rank's float64 shard, or the whole
    float64 tensor of a parameter FSDP2 does not shard; default the parameters' own, upcast), every rank calling the
    same forwards (each gather is a collective).

    As FSDP2 gathers a unit's parameters before the unit runs, so here: before each `fully_shard` module runs, each
    of its sharded parameters is gathered whole in float64 from its float64 shard (``DTensor.full_tensor``) and
    stands in for it in every module that holds it; after the unit (its outermost call), the sharded parameters are
    put back and the gathered copies dropped. FSDP2's own forward hooks are paused meanwhile (they would gather in
    the parameters' dtype and cast to its mixed-precision dtype); parameters FSDP2 does not shard and the buffers are
    float64 copies (or ``values``) throughout. Everything is put back on exit, also on an exception. Memory: the
    float64 shards (8 bytes a parameter / world size) and one unit's float64 parameters whole at a time (the root
    unit's, e.g. the embeddings and the head, through the whole forward, as FSDP2 holds them)."""
    from torch.distributed.tensor import DTensor

    from tokendyn.probe.parallel import fsdp_modules, local, reshard

    reshard(model)  # (the sharded parameters registered, none gathered)
    paused: list[tuple[dict, object, object]] = []
    swapped: list[tuple[dict, str, torch.Tensor]] = []  # (table, name, the original): put back on exit
    held: dict[int, list] = {}  # id(unit) -> [calls in progress, what its gather replaced]
    handles = []

    def given(p: torch.Tensor) -> torch.Tensor:
        v = values.get(id(p)) if values is not None else None
        return local(p).detach().to(torch.float64) if v is None else v.detach()

    def unit_parameters(unit):
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                info = fp._module_info
                places = [(info.module, info.param_name)]
                places += list(zip(info.shared_modules, info.shared_param_names, strict=True))
                yield fp.sharded_param, places

    def before(unit, args):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "as_float64: an FSDP2-sharded model computes in float64 only without grad (pi is measured there; "
                "a step's gradient is taken in the model's own dtype)"
            )
        entry = held.setdefault(id(unit), [0, []])
        entry[0] += 1
        if entry[0] > 1:  # (a unit called within its own forward: gathered already)
            return
        for p, places in unit_parameters(unit):
            shard = given(p)
            whole = DTensor.from_local(
                shard, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            ).full_tensor()
            whole = nn.Parameter(whole, requires_grad=False)
            for module, name in places:
                entry[1].append((module._parameters, name, module._parameters[name]))
                module._parameters[name] = whole

    def put_back(replaced: list) -> None:
        for table, name, t in reversed(replaced):
            table[name] = t

    def after(unit, args, output):
        entry = held.get(id(unit))
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                put_back(held.pop(id(unit))[1])

    try:
        made: dict[int, torch.Tensor] = {}
        for module in model.modules():
            for hooks in (module._forward_pre_hooks, module._forward_hooks):
                for key, hook in list(hooks.items()):
                    if _is_fsdp_hook(hook):
                        paused.append((hooks, key, hook))
                        hooks[key] = _no_hook
            for table, is_param in ((module._parameters, True), (module._buffers, False)):
                for name, t in list(table.items()):
                    if t is None or not t.is_floating_point() or local(t) is not t:
                        continue
                    if id(t) not in made:  # (a parameter FSDP2 does not shard, a buffer: float64 throughout)
                        copy = given(t) if is_param else t.detach().to(torch.float64, copy=True)
                        made[id(t)] = nn.Parameter(copy, requires_grad=False) if is_param else copy
                    swapped.append((table, name, t))
                    table[name] = made[id(t)]
        for unit in fsdp_modules(model):
            handles.append(unit.register_forward_pre_hook(before))
            handles.append(unit.register_forward_hook(after, prepend=True, always_call=True))
        # autocast off on the mesh's device (the shards themselves may be offloaded to the CPU)
        mesh = next((p.device_mesh for p in model.parameters() if local(p) is not p), None)
        device = mesh.device_type if mesh is not None else "cpu"
        with torch.autocast(device_type=device, enabled=False), exact_float64():
            yield model
    finally:
        for handle in handles:
            handle.remove()
        for _, replaced in held.values():
            put_back(replaced)
        put_back(swapped)
        for hooks, key, hook in paused:
            hooks[key] = hook
