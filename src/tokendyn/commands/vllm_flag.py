"""The vLLM switch, spelled as every command takes it: ``--use_vllm``, TRL's ``GRPOConfig`` field, which
``tokendyn train`` and ``examples/trl_script.py`` take as it is (every config field is a flag there). Its grammar is
TRL's: ``--use_vllm`` alone means true, ``--use_vllm true|false`` says it. An older spelling (``study --sampler
vllm``) stays as an alias that sets the same value and names the new spelling on one line of stderr."""

from __future__ import annotations

import argparse
import sys

TRUE = ("true", "yes", "y", "t", "1")
FALSE = ("false", "no", "n", "f", "0")


def to_bool(text: str) -> bool:
    """``--use_vllm``'s value, as TRL's parser reads a boolean field: true/yes/y/t/1 or false/no/n/f/0 (any case)."""
    word = text.strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise argparse.ArgumentTypeError(f"must be true or false, got {text!r}")


def add_use_vllm(p: argparse.ArgumentParser, help: str) -> None:
    """``--use_vllm [true|false]`` on ``p`` (default false)."""
    p.add_argument(
        "--use_vllm", nargs="?", const=True, default=False, type=to_bool, metavar="{true,false}", help=help
    )


class Renamed(argparse.Action):
    """An old spelling of ``--use_vllm``: each of its values sets ``use_vllm`` (``mapping``: value -> bool) and
    prints one line naming the spelling to use instead."""

    def __init__(self, option_strings, dest, mapping: dict[str, bool], **kwargs):
        self.mapping = mapping
        super().__init__(option_strings, dest, choices=list(mapping), **kwargs)

    def __call__(self, parser, namespace, value, option_string=None):
        new = "--use_vllm" if self.mapping[value] else "--use_vllm false (the default)"
        print(f"{parser.prog}: note: `{option_string} {value}` is now spelled `{new}`", file=sys.stderr)
        setattr(namespace, self.dest, self.mapping[value])


def add_sampler_alias(p: argparse.ArgumentParser) -> None:
    """``--sampler {generate,vllm}``, the study's old spelling: vllm is ``--use_vllm``, generate its default."""
    p.add_argument(
        "--sampler",
        dest="use_vllm",
        action=Renamed,
        mapping={"generate": False, "vllm": True},
        default=False,
        help=argparse.SUPPRESS,
    )
