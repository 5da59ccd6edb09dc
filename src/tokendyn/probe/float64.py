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
    float64 ``.data`` would reset them) stay as they were. Refused for sharded parameters (FSDP2's DTensor).
    ``values``: id(parameter) -> a float64 tensor of its shape that stands in for it as it is (no copy: a point
    other than the model's own, e.g. a step made in float64 from it, `tokendyn.effects.change.InPlaceUpdate`)."""
    from tokendyn.probe.parallel import local

    made: dict[int, torch.Tensor] = {}
    entries: list[tuple[dict, str, torch.Tensor]] = []
    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(table.items()):
                if t is None or not t.is_floating_point():
                    continue
                if local(t) is not t:
                    raise ValueError(
                        "as_float64: a sharded (FSDP2) model cannot be copied to float64 in place"
                    )
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
