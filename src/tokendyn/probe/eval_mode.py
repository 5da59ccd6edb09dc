"""The analyses' modes of a model: every submodule in eval mode, and the layers that training checkpoints kept
checkpointed (`eval_mode`), so that an analysis draws no dropout and no RNG and holds what the checkpointed training
step holds."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.utils.checkpoint
from torch import nn


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The layers Hugging Face's gradient checkpointing is switched on for (``gradient_checkpointing_enable``): the
    modules whose ``gradient_checkpointing`` flag is set and none of whose submodules has it set (Hugging Face flags
    every module that carries the attribute; a model such as OPT flags its decoder as well as each decoder layer, and
    only the layers checkpoint). A flagged module that is not a ``GradientCheckpointingLayer`` checkpoints inside its
    own loop over its blocks (the older models' and remote code's way): its blocks are the layers then, the elements
    of its first ``nn.ModuleList`` of more than one module."""
    flagged = [m for m in model.modules() if _flagged(m)]
    out = []
    for m in flagged:
        if any(_flagged(sub) for sub in m.modules() if sub is not m):
            continue
        out.extend(_blocks(m))
    return out


def _blocks(module: nn.Module) -> list[nn.Module]:
    """``[module]`` for a ``GradientCheckpointingLayer``; else the blocks its own loop checkpoints (see above)."""
    if any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__):
        return [module]
    lists = [c for c in module.modules() if isinstance(c, nn.ModuleList) and len(c) > 1]
    return list(lists[0]) if lists else [module]


def _flagged(module: nn.Module) -> bool:
    return getattr(module, "gradient_checkpointing", False) is True


@contextmanager
def eval_mode(model: nn.Module, checkpoint: bool = True) -> Iterator[nn.Module]:
    """Every submodule in eval mode (no dropout, no layer drop), each one's flag restored on exit.

    Memory: where training checkpoints its layers (``model.gradient_checkpointing_enable()``) and ``checkpoint``,
    those layers keep checkpointing in the analyses' gradient passes, non-reentrant whatever training uses (the
    analyses differentiate with ``torch.autograd.grad``, which reentrant checkpointing refuses): an analysis then holds
    each layer's input and one layer's recomputation, as the checkpointed training step does, instead of every
    layer's activations. Each such layer stays in eval mode, its ``forward`` wrapped in the checkpoint for the
    duration (a layer flagged training would run its own dropout: OPT's decoder layers apply theirs in their
    ``forward``, and OPT's decoder draws its layer drop from torch's RNG whenever it is flagged training)."""
    flags = [(m, m.training) for m in model.modules()]
    found = checkpointed_layers(model)
    layers = [m for m in found if not _wrapped(m)] if checkpoint else []  # (nested: wrapped once)
    own = [
        (m, m.__dict__.get("forward")) for m in layers
    ]  # (an instance attribute of the layer's own, if any)
    # nested without checkpointing (a JVP inside an analysis): an outer call's wrappers are taken off meanwhile
    outer = [] if checkpoint else [(m, m.__dict__["forward"]) for m in found if _wrapped(m)]
    model.eval()
    for m in layers:
        m.forward = functools.partial(_checkpoint, m.forward)
    for m, wrapper in outer:
        m.forward = wrapper.args[0]
    try:
        yield model
    finally:
        for m, flag in flags:
            m.training = flag
        for m, wrapper in outer:
            m.forward = wrapper
        for m, forward in own:
            if forward is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = forward


def _wrapped(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _checkpoint


def _checkpoint(function, *args, **kwargs):
    """Non-reentrant ``torch.utils.checkpoint``; a forward under `tokendyn.probe.float64.exact_float64` is
    recomputed under it too (the backward's recomputation does not see the mode of the forward)."""
    from tokendyn.probe.float64 import same_mode

    return torch.utils.checkpoint.checkpoint(same_mode(function), *args, use_reentrant=False, **kwargs)
