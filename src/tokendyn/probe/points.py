"""Probe points: the modules whose output hidden state is probed, with one stable name each.

Names (used in configs, records and figures alike):
  `layers.{i}.out`   output of decoder layer i (the residual stream after block i), i = 0..L-1
  `final_norm.out`   the input of the LM head: the output of the final norm, or of the projection after it where
                     the backbone has one (OPT's `project_out`, opt-350m style)
Families: Qwen2 / Llama / Mistral (`model.layers`, `model.norm`), GPT-2 (`transformer.h`, `transformer.ln_f`),
GPT-NeoX and OPT-style backbones; wrappers (DDP `.module`, PEFT `get_base_model()`) are unwrapped first.
Between the last layer and the LM head a backbone may run a final norm, a projection, or both (OPT with
`project_out`: norm, then projection); `final_norm.out` is the output of the last of them. A post-LN backbone (config
`do_layer_norm_before=False`, OPT-style) with neither feeds the last layer's output to the head: there
`final_norm.out` names that same tensor (an alias of `layers.{L-1}.out`), so the exact checks at the LM head run too.
A backbone with neither and no such config has no `final_norm.out` (the checks are off, and the probe notes it).

`replay_chain` lists every module call from the first layer to the head's input, the unprobed ones between (OPT's
final norm before `project_out`) named `head_chain.{attr}`: the direct gradients replay along it.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from tokendyn.vocab import FINAL_NORM, layer_point, select_names

_LAYER_ATTRS = ("layers", "h", "blocks")
_NORM_ATTRS = ("norm", "ln_f", "final_layer_norm", "final_layernorm")
_NESTED = ("decoder", "language_model")
_HEAD_PROJECTIONS = ("project_out",)  # applied after the final norm, before the LM head


@dataclass(frozen=True)
class ProbePoint:
    """One probed place: its stable name, its module, and its index in the default order."""

    name: str
    module: nn.Module
    index: int


def unwrap_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model under DDP / FSDP (`.module`) and PEFT (`get_base_model()`) wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
    return model


def _backbone(model: nn.Module) -> nn.Module:
    base = getattr(model, "base_model", None)
    candidate = base if isinstance(base, nn.Module) else model
    for _ in range(3):
        if any(isinstance(getattr(candidate, a, None), nn.ModuleList) for a in _LAYER_ATTRS):
            return candidate
        nested = next(
            (getattr(candidate, a) for a in _NESTED if isinstance(getattr(candidate, a, None), nn.Module)),
            None,
        )
        if nested is None:
            break
        candidate = nested
    raise ValueError(
        f"probe points: cannot find the decoder layers of {type(model).__name__}; supported: backbones with "
        f"{'/'.join(_LAYER_ATTRS)} (a ModuleList) and a final norm named {'/'.join(_NORM_ATTRS)}"
    )


def head_chain(backbone: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules run between the last decoder layer and the LM head, in forward order, as (attribute, module):
    the final norm if there is one, then a projection if there is one (OPT's `project_out`); empty when the last
    layer's output feeds the head."""
    chain = []
    for names in (_NORM_ATTRS, _HEAD_PROJECTIONS):
        found = next((a for a in names if isinstance(getattr(backbone, a, None), nn.Module)), None)
        if found is not None:
            chain.append((found, getattr(backbone, found)))
    return chain


def head_input_module(backbone: nn.Module) -> nn.Module | None:
    """The module whose output is the LM head's input: the last of `head_chain`; for a post-LN backbone without
    one (`post_ln_head_input`), the last decoder layer; else None."""
    chain = head_chain(backbone)
    if chain:
        return chain[-1][1]
    return _layers(backbone)[-1] if post_ln_head_input(backbone) else None


def post_ln_head_input(backbone: nn.Module) -> bool:
    """True when the last decoder layer's output is itself the LM head's input: no final norm and no projection, and
    the config says the layers normalise their own outputs (``do_layer_norm_before=False``, post-LN OPT)."""
    config = getattr(backbone, "config", None)
    return not head_chain(backbone) and getattr(config, "do_layer_norm_before", None) is False


def _layers(backbone: nn.Module) -> nn.ModuleList:
    return next(
        getattr(backbone, a) for a in _LAYER_ATTRS if isinstance(getattr(backbone, a, None), nn.ModuleList)
    )


def discover_points(model: nn.Module) -> list[ProbePoint]:
    """All probe points of a causal LM, in forward order: `layers.0.out` .. `layers.{L-1}.out`, then `final_norm.out`
    (the LM head's input, see `head_input_module`) unless the backbone has no module there."""
    backbone = _backbone(unwrap_model(model))
    points = [ProbePoint(layer_point(i), layer, i) for i, layer in enumerate(_layers(backbone))]
    head_input = head_input_module(backbone)
    if head_input is not None:
        points.append(ProbePoint(FINAL_NORM, head_input, len(points)))
    return points


def replay_chain(model: nn.Module) -> list[ProbePoint]:
    """Every module call from the first decoder layer to the LM head's input, in forward order (the input of each is
    the output of the one before): the layers, then `head_chain` with its last module named `final_norm.out` and
    the others `head_chain.{attr}`. A post-LN head input (`post_ln_head_input`) adds nothing: `final_norm.out` is
    the last layer's output there."""
    backbone = _backbone(unwrap_model(model))
    points = [ProbePoint(layer_point(i), layer, i) for i, layer in enumerate(_layers(backbone))]
    chain = head_chain(backbone)
    for j, (attr, module) in enumerate(chain):
        name = FINAL_NORM if j == len(chain) - 1 else f"head_chain.{attr}"
        points.append(ProbePoint(name, module, len(points)))
    return points


def select_points(points: Sequence[ProbePoint], selection: str | Sequence[str] | None) -> list[ProbePoint]:
    """Pick points by exact name or glob pattern (`tokendyn.vocab.select_names`); None or "all" keeps all, in the
    forward order."""
    chosen = set(select_names([p.name for p in points], selection, "probe points"))
    return [p for p in points if p.name in chosen]


def output_head(model: nn.Module) -> nn.Module:
    """The LM head (output embeddings): logits = h W^T + b."""
    model = unwrap_model(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"probe: {type(model).__name__} exposes no output embeddings (LM head)")
    return head


_SCALES = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


def _text_config(model: nn.Module):
    config = getattr(unwrap_model(model), "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def logit_softcap(model: nn.Module) -> float | None:
    """c of a soft-capped LM head (logits = c tanh(h W^T / c)): the config's `final_logit_softcapping` where the
    model's forward applies it (Gemma 2 does; a Qwen2 config carrying the key does not), else None."""
    value = getattr(_text_config(model), "final_logit_softcapping", None)
    if not value:
        return None
    try:
        applies = "final_logit_softcapping" in inspect.getsource(type(unwrap_model(model)).forward)
    except (OSError, TypeError):
        applies = True  # no source to read: trust the config (the identity check would show a wrong cap)
    return float(value) if applies else None


def head_transform_supported(model: nn.Module, softcap: bool = False) -> bool:
    """True when logits are a plain affine map of the final hidden state (no logit scaling in the config; with
    ``softcap``, a soft cap the forward applies is allowed: the probe's head checks model it,
    `head.HeadShard.capped`)."""
    text = _text_config(model)
    if text is None:
        return True
    if not softcap and getattr(text, "final_logit_softcapping", None):
        return False
    return all(getattr(text, attr, None) in (None, 1.0) for attr in _SCALES)
