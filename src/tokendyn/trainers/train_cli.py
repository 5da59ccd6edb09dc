"""``tokendyn train``: GRPO (+Reweight, +Lopti) on K&K with TRL-style flags.

Every field of :class:`RunArguments` and of :class:`TokendynGRPOConfig` (TRL's ``GRPOConfig``
and the paper's remedies) is a flag; ``--config run.yaml`` sets any of them (flags win).
"""

from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="GRPO / +Reweight / +Lopti on K&K (every GRPOConfig field is a flag; "
        "`tokendyn train --help` lists them)",
        add_help=False,
    )
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=run)


def parse(argv: list[str]):
    """(RunArguments, TokendynGRPOConfig) from flags and an optional ``--config`` YAML."""
    import torch
    from trl import TrlParser

    from .config import TokendynGRPOConfig
    from .runner import EMBEDDED_DEFAULTS, RunArguments

    parser = TrlParser((RunArguments, TokendynGRPOConfig), prog="tokendyn train")
    defaults = dict(EMBEDDED_DEFAULTS)
    if not torch.cuda.is_available():
        defaults["use_cpu"] = True
    parser.set_defaults(**defaults)
    run_args, cfg = parser.parse_args_and_config(argv)
    return run_args, cfg


def run(args: argparse.Namespace) -> int:
    from ..common import check_writable

    try:
        run_args, cfg = parse(args.argv)
    except SystemExit as exc:  # argparse already printed the message (or --help)
        return int(exc.code or 0)
    check_writable(cfg.output_dir + "/run.json", "output_dir")

    from rich.console import Console

    from .runner import method_name, train

    console = Console()
    console.print(
        f"[bold]tokendyn train[/bold]: {method_name(cfg)} on K&K {run_args.people} -> {cfg.output_dir}"
    )
    meta = train(run_args, cfg)
    s = meta["summary"]
    console.print(
        f"finished in {meta['wall_time_s']:.0f} s; mean train reward {_fmt(s['mean_train_reward'])}, "
        f"mean train accuracy {_fmt(s['mean_train_accuracy'])}, mean held-out accuracy "
        f"{_fmt(s['mean_heldout_accuracy'])}"
    )
    print(f"run directory: {cfg.output_dir} (run.json, metrics.parquet)")
    return 0


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    sys.exit(run(argparse.Namespace(argv=sys.argv[1:])))
