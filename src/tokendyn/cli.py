"""``tokendyn <command>``: one entry point; each command lives next to the code it drives.

Commands are registered lazily so that ``tokendyn --help`` and input validation stay fast
(torch and TRL are imported only by the commands that need them).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tokendyn.common import UsageError  # re-exported: the CLI's input error type

# command name -> module exposing ``register(subparsers)`` (which sets ``func`` on its parser)
COMMANDS = {
    "kk": "tokendyn.tasks.kk.cli",
    "warmstart": "tokendyn.trainers.warmstart_cli",
    "eval": "tokendyn.trainers.eval_cli",
    "train": "tokendyn.trainers.train_cli",
    "analyze": "tokendyn.analysis.cli",
    "figures": "tokendyn.figures.cli",
    "probe": "tokendyn.hooks.offline_cli",
    "demo": "tokendyn.commands.demo_cli",
}


# commands whose flags are parsed by the command itself (every GRPOConfig field is a flag)
PASSTHROUGH = {"train"}


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors ("tokendyn probe: error: argument --batch_size: invalid int value: 'x'"),
    like every other input error; subcommand parsers inherit it."""

    def error(self, message: str):
        print(f"{self.prog}: error: {' '.join(message.split())} (--help for usage)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="tokendyn", description="Which tokens drive the update in RL on LLMs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS.values():
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] in PASSTHROUGH:  # parses its own flags (TRL-style dataclass parser)
        args = argparse.Namespace(
            command=argv[0], argv=argv[1:], func=importlib.import_module(COMMANDS[argv[0]]).run
        )
    else:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help (0) or a usage error, already printed on one line (2)
            return int(exc.code or 0)
    try:
        return int(args.func(args) or 0)
    except (UsageError, ValueError, FileNotFoundError) as exc:  # UsageError: every input error
        print(f"tokendyn {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
