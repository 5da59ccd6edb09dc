"""``tokendyn demo [--quick] [--out DIR]``: what ``make demo`` runs."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="GRPO vs +Reweight vs +Lopti on the embedded default with the probes on, "
        "then every figure and report.html",
    )
    p.add_argument("--out", default="runs/demo", help="output directory (three run directories and figures/)")
    p.add_argument(
        "--quick", action="store_true", help="a few minutes: fewer rollouts, sizes and evaluations"
    )
    p.add_argument("--model", default=None, help="policy directory or hub id (default: the embedded default)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .demo import demo

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {str(out)!r} exists and is not a directory")
    report = demo(out, quick=args.quick, model=args.model)
    print(f"report: {report}")
    return 0
