"""`tokendyn analyze RUN_DIR`: print the per-bin table and the bound report, write them as parquet."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from tokendyn.analysis.load import NoRecordsError, check_run_dir
from tokendyn.analysis.report import ANALYSIS_DIR, analyze_run, print_report


def _step_range(text: str) -> tuple[int | None, int | None]:
    first, sep, last = text.partition(":")
    try:
        lo = int(first) if first.strip() else None
        hi = (int(last) if last.strip() else None) if sep else lo
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--steps takes N, A:B, A: or :B (integers), got {text!r}") from exc
    return lo, hi


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `analyze` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "analyze",
        help="per-bin gradient table and (1-pi) bound report of a run",
        description="Read RUN_DIR/records/*.parquet (all ranks), print the per-bin table and the bound report, "
        f"and write them to RUN_DIR/{ANALYSIS_DIR}/ (or --out).",
    )
    p.add_argument("run_dir", help="run directory holding records/")
    p.add_argument("--steps", type=_step_range, default=None, help="steps to include: N, A:B, A: or :B")
    p.add_argument("--stage", default=None, help="only this stage (e.g. train, low, high)")
    p.add_argument("--by-step", action="store_true", help="per-bin table per step instead of pooled")
    p.add_argument(
        "--point", default=None, help="probe point shown in the per-bin table (default final_norm.out)"
    )
    p.add_argument("--out", default=None, help=f"output folder (default RUN_DIR/{ANALYSIS_DIR})")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        check_run_dir(args.run_dir)
    except NoRecordsError as exc:
        print(f"tokendyn analyze: error: {exc}", file=sys.stderr)
        return 2
    tables = analyze_run(
        args.run_dir, steps=args.steps, stage=args.stage, by_step=args.by_step, out_dir=args.out
    )
    print_report(tables, console, point=args.point)
    out = args.out or f"{args.run_dir.rstrip('/')}/{ANALYSIS_DIR}"
    console.print(f"wrote {', '.join(f'{n}.parquet' for n in tables)} to {out}")
    return 0
