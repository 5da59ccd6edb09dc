"""``tokendyn <command>``: one entry point; each command lives next to the code it drives.

Commands are registered lazily so that ``tokendyn --help`` and input validation stay fast
(torch and TRL are imported only by the commands that need them).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import sys

from tokendyn.common import UsageError  # re-exported: the CLI's input error type
from tokendyn.version import __version__

# command name -> module exposing ``register(subparsers)`` (which sets ``func`` on its parser), in the order
# `tokendyn --help` lists them: the demo first (where a new user starts), then a run's own steps, then the rest
COMMANDS = {
    "demo": "tokendyn.commands.demo_cli",
    "train": "tokendyn.trainers.train_cli",
    "figures": "tokendyn.figures.cli",
    "view": "tokendyn.figures.view_cli",
    "analyze": "tokendyn.analysis.cli",
    "doctor": "tokendyn.commands.doctor",
    "probe": "tokendyn.hooks.offline_cli",
    "study": "tokendyn.commands.study_cli",
    "kk": "tokendyn.tasks.kk.cli",
    "warmstart": "tokendyn.trainers.warmstart_cli",
    "eval": "tokendyn.trainers.eval_cli",
    "model-path": "tokendyn.commands.model_path_cli",
}

# the line `tokendyn --help` opens with, below the description
START_HERE = (
    "start here: `tokendyn demo --quick` (a smoke-size demo), then `tokendyn demo`;\n"
    "each prints the path of the report.html it writes"
)


# commands whose flags are parsed by the command itself (every GRPOConfig field is a flag)
PASSTHROUGH = {"train"}

# commands that compute (torch or polars): each takes --threads (train takes it as a RunArguments field)
THREADED = ("warmstart", "eval", "train", "analyze", "figures", "view", "probe", "demo", "study")

# the environment variables read by the thread pools, at their import: torch (OpenMP, MKL) and polars
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "POLARS_MAX_THREADS")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors ("tokendyn probe: error: argument --batch_size: invalid int value: 'x'"),
    like every other input error; subcommand parsers inherit it. A mistyped command gets a suggestion."""

    def error(self, message: str):
        message = " ".join(message.split())
        wrong = re.search(r"invalid choice: '([^']*)'", message)
        if wrong and self.prog == "tokendyn":
            close = difflib.get_close_matches(wrong.group(1), list(COMMANDS), n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            message = f"unknown command {wrong.group(1)!r}{hint} (commands: {', '.join(COMMANDS)})"
        print(f"{self.prog}: error: {message} (--help for usage)", file=sys.stderr)
        sys.exit(2)


def positive_int(text: str) -> int:
    """argparse type of ``--threads``: an integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {n}")
    return n


def add_threads(p: argparse.ArgumentParser) -> None:
    """``--threads N``: CPU threads of torch and polars (default: their own choice, usually every core)."""
    if any("--threads" in a.option_strings for a in p._actions):
        return
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="CPU threads of torch and polars (default: every core)",
    )


def threads_from_argv(argv: list[str]) -> int | None:
    """The value of ``--threads N`` / ``--threads=N`` in ``argv`` (None: absent or not a positive integer; the
    parser reports a bad value). Read before any command module is imported: the pools size themselves at import."""
    for i, a in enumerate(argv):
        text = a.partition("=")[2] if a.startswith("--threads=") else None
        if a == "--threads" and i + 1 < len(argv):
            text = argv[i + 1]
        if text is not None:
            try:
                return positive_int(text)
            except argparse.ArgumentTypeError:
                return None
    return None


def set_threads(n: int | None) -> None:
    """Size the thread pools: environment variables for pools not yet started, and torch's if it is imported."""
    if n is None:
        return
    for var in THREAD_VARIABLES:
        os.environ[var] = str(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)


def quiet_dependencies() -> None:
    """Dependency warnings a user cannot act on (deprecations inside transformers/TRL/torch, TRL's experimental
    notices) and transformers' per-file loading bars are dropped; tokendyn's own warnings and bars still show."""
    import warnings

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # "Loading weights", "Writing model shards"
    for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    for module in ("transformers", "trl", "torch", "accelerate", "datasets", "huggingface_hub", "matplotlib"):
        warnings.filterwarnings("ignore", module=rf"{module}(\.|$)")
    warnings.formatwarning = one_line_warning
    if "transformers" in sys.modules:  # imported already (in a test): its bars read the variable at import
        sys.modules["transformers"].utils.logging.disable_progress_bar()


def one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A warning as the CLI prints it: ``warning: <message>`` on one line (no file name and source line)."""
    return f"warning: {' '.join(str(message).split())}\n"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="tokendyn",
        description=f"Which tokens drive the update in RL on LLMs.\n\n{START_HERE}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tokendyn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS.values():
        importlib.import_module(module).register(sub)
    for name in THREADED:
        if name not in PASSTHROUGH:
            add_threads(sub.choices[name])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_dependencies()
    set_threads(threads_from_argv(argv))
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
