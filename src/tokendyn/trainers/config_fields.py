"""The generated fields of `TokendynGRPOConfig`: one ``probe_<name>`` flag per `ProbeConfig` field and one per
registered rule parameter TRL's `GRPOConfig` lacks, each with a CLI-friendly type; and the number check the
config's validation shares."""

from __future__ import annotations

import math
import types
import typing
from dataclasses import field, fields
from functools import partial

from tokendyn.config import ProbeConfig
from tokendyn.probe.rules import params as rule_params


def is_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


PROBE_PREFIX = "probe_"


def _none_or(kind: type):
    """An argparse type reading ``none`` (any case) as None, anything else as ``kind``: `--probe_check_tokens none`."""

    def parse(text: str):
        return None if str(text).strip().lower() == "none" else kind(text)

    parse.__name__ = f"{kind.__name__}_or_none"
    return parse


def _cli_type(annotation):
    """The HfArgumentParser-friendly type of a ProbeConfig field: tuples become lists (``nargs="+"``); an optional
    number takes ``none`` on the command line."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is tuple:
        return list[args[0]]
    if isinstance(annotation, types.UnionType) and any(typing.get_origin(a) is tuple for a in args):
        return list[next(typing.get_args(a)[0] for a in args if typing.get_origin(a) is tuple)] | None
    if isinstance(annotation, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and rest[0] in (int, float):
            return _none_or(rest[0])
    return annotation


def with_probe_fields(cls):
    """Add one field ``probe_<name>`` per `ProbeConfig` field to ``cls`` (before ``@dataclass``): same default, same
    help text, a CLI-friendly type. The trainer's probe options are derived from ProbeConfig, never written twice."""
    hints = typing.get_type_hints(ProbeConfig)
    annotations = cls.__dict__.get("__annotations__", {})
    for f in fields(ProbeConfig):
        name = PROBE_PREFIX + f.name
        meta = {"help": f.metadata["help"] + f" (`ProbeConfig.{f.name}`)"}
        if isinstance(f.default, tuple):
            value = field(default_factory=partial(list, f.default), metadata=meta)
        else:
            value = field(default=f.default, metadata=meta)
        annotations[name] = _cli_type(hints[f.name])
        setattr(cls, name, value)
    cls.__annotations__ = annotations
    return cls


def with_rule_fields(cls):
    """Add one field per registered rule parameter that TRL's `GRPOConfig` does not have (`tokendyn.probe.rules`:
    name, published default, help) to ``cls`` (before ``@dataclass``): a new rule's parameters need no line here."""
    annotations = cls.__dict__.get("__annotations__", {})
    for p in rule_params():
        if not p.trl:
            annotations[p.name] = float
            setattr(cls, p.name, field(default=p.default, metadata={"help": p.help}))
    cls.__annotations__ = annotations
    return cls
