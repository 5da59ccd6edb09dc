"""``tokendyn demo [--quick] [--policy NAME] [--out DIR]``: what ``make demo`` runs (the embedded default), or the
same three runs on the real LLM (``--policy smollm2-135m``)."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    from .demo import POLICIES

    p = sub.add_parser(
        "demo",
        help="GRPO vs +Reweight vs +Lopti with the probes on (the embedded default on K&K, or a real LLM on sums), "
        "then every figure and report.html",
    )
    p.add_argument(
        "--policy",
        default="default",
        choices=list(POLICIES),
        help="default: the embedded policy on K&K (about 8 min here); smollm2-135m: SmolLM2-135M-Instruct from its "
        "package on sums of one- and two-digit numbers (docs/results.md gives its time)",
    )
    p.add_argument("--out", default="runs/demo", help="output directory (three run directories and figures/)")
    p.add_argument(
        "--quick", action="store_true", help="a few minutes: fewer rollouts, sizes and evaluations"
    )
    p.add_argument(
        "--model",
        default=None,
        help="another policy directory or hub id, on K&K (default: the embedded default)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .demo import demo

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {str(out)!r} exists and is not a directory")
    report = demo(out, quick=args.quick, policy=args.policy, model=args.model)
    print(f"report: {report}")
    return 0
