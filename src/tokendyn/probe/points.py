"""Probe points: the modules whose output hidden state is probed, with one stable name each.

Names (used in configs, records and figures alike):
  `layers.{i}.out`   output of decoder layer i (the residual stream after block i), i = 0..L-1
  `final_norm.out`   the input of the LM head: the output of the final norm, or of the projection after it where
                     the backbone has one (OPT's `project_out`, opt-350m style)
Families: Qwen2 / Llama / Mistral (`model.layers`, `model.norm`), GPT-2 (`transformer.h`, `transformer.ln_f`),
GPT-NeoX and OPT-style backbones; wrappers (DDP `.module`, PEFT `get_base_model()`) are unwrapped first. A backbone
with neither a final norm nor a projection (post-LN OPT) has no `final_norm.out`: its layers are probed, and the exact
checks at the LM head (which need the head's input) are off.
"""

from __future__ import annotations

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


def head_input_module(backbone: nn.Module) -> nn.Module | None:
    """The module whose output is the LM head's input: a projection after the final norm if there is one, else the
    final norm; None when the backbone has neither (the last layer's output feeds the head)."""
    for names in (_HEAD_PROJECTIONS, _NORM_ATTRS):
        found = next(
            (getattr(backbone, a) for a in names if isinstance(getattr(backbone, a, None), nn.Module)), None
        )
        if found is not None:
            return found
    return None


def discover_points(model: nn.Module) -> list[ProbePoint]:
    """All probe points of a causal LM, in forward order: `layers.0.out` .. `layers.{L-1}.out`, then `final_norm.out`
    (the LM head's input, see `head_input_module`) unless the backbone has no module there."""
    backbone = _backbone(unwrap_model(model))
    layers = next(
        getattr(backbone, a) for a in _LAYER_ATTRS if isinstance(getattr(backbone, a, None), nn.ModuleList)
    )
    points = [ProbePoint(layer_point(i), layer, i) for i, layer in enumerate(layers)]
    head_input = head_input_module(backbone)
    if head_input is not None:
        points.append(ProbePoint(FINAL_NORM, head_input, len(points)))
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


def head_transform_supported(model: nn.Module) -> bool:
    """True when logits are a plain affine map of the final hidden state (no softcapping or logit scaling)."""
    config = getattr(unwrap_model(model), "config", None)
    if config is None:
        return True
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr in (
        "final_logit_softcapping",
        "logit_scale",
        "output_multiplier",
        "lm_head_multiplier",
        "logits_scaling",
    ):
        value = getattr(text, attr, None)
        if value is not None and value != 1.0:
            return False
    return True
