"""``tokendyn warmstart --preset cpu --out DIR``."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("warmstart", help="train the embedded default policy from scratch on K&K")
    p.add_argument(
        "--preset",
        default="cpu",
        help="tiny (seconds, for tests) | cpu (the embedded default, = cpu_v8) | cpu_v1 .. cpu_v8 (every version) | gpu",
    )
    p.add_argument("--out", required=True, help="output directory (model, tokenizer, warmstart.json)")
    p.add_argument("--seed", type=int, default=0, help="training seed (>= 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--device",
        default="auto",
        help="auto (the gpu preset on CUDA when there is one, the others on the CPU) | cpu | cuda | cuda:N",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..common import check_writable
    from .warmstart import check_preset, resolve_device

    check_preset(args.preset)
    resolve_device(args.device, args.preset)
    if args.seed < 0:
        raise ValueError(f"seed: must be >= 0, got {args.seed}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {str(out)!r} exists and is not a directory")
    check_writable(out / "warmstart.json", "out")

    from .warmstart import warmstart

    report = warmstart(
        args.preset,
        out,
        seed=args.seed,
        threads=getattr(args, "threads", None),
        progress=not args.no_progress,
        device=args.device,
    )
    _print_report(report)
    print(f"policy and warmstart.json written to {out}")
    return 0


def _print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"warm start '{report['preset']}' (seed {report['seed']}, {report['parameters']:,} parameters, "
        f"{report['wall_time_s']:.0f} s)"
    )
    for col in ("people", "mode", "n", "format valid", "accuracy", "mean reward"):
        t.add_column(col, justify="right")
    for r in report["evaluation"]:
        t.add_row(
            str(r["people"]),
            r["mode"],
            str(r["n"]),
            f"{r['format_valid']:.0%}",
            f"{r['accuracy']:.0%}",
            f"{r['mean_reward']:+.2f}",
        )
    Console().print(t)
    shares = report["bin_shares_T0.7"]
    for k, v in shares.items():
        print(f"token share per pi bin {report['bins']} at T=0.7 ({k}): " + " / ".join(f"{x:.1%}" for x in v))
