"""Attaching probes to training: `instrument` (any loop) and the record writer (`tokendyn.hooks.records`).

`instrument` is imported lazily so that `tokendyn.hooks.records` can be read without torch."""

from __future__ import annotations

from typing import Any

__all__ = ["instrument"]


def __getattr__(name: str) -> Any:
    if name == "instrument":
        from tokendyn.hooks.loop import instrument

        return instrument
    raise AttributeError(f"module 'tokendyn.hooks' has no attribute {name!r}")
