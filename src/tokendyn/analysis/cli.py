"""`tokendyn analyze RUN_DIR`: print the per-bin table and the bound report, write them as parquet."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from tokendyn.analysis.compare import compare, run_label
from tokendyn.analysis.load import NoRecordsError, SelectionError, check_run_dir, check_selection
from tokendyn.analysis.report import ANALYSIS_DIR, analyze_run, print_report
from tokendyn.analysis.tables import unreached


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
    p.add_argument(
        "run_dir", nargs="+", help="run directories holding records/ (several: tables side by side)"
    )
    p.add_argument("--steps", type=_step_range, default=None, help="steps to include: N, A:B, A: or :B")
    p.add_argument("--stage", default=None, help="only this stage (e.g. train, low, high)")
    p.add_argument("--by-step", action="store_true", help="per-bin table per step instead of pooled")
    p.add_argument(
        "--points",
        default=None,
        help="probe points shown in the per-bin table, by name or glob as ProbeConfig.points "
        "(e.g. 'layers.*.out'; default final_norm.out)",
    )
    p.add_argument("--out", default=None, help=f"output folder (default RUN_DIR/{ANALYSIS_DIR})")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(Console().width, 140))
    run_dirs = list(args.run_dir)
    try:
        for d in run_dirs:  # every directory and the selection are checked before any work
            check_run_dir(d)
            check_selection(d, args.steps, args.stage, args.points)
    except (NoRecordsError, SelectionError) as exc:
        print(f"tokendyn analyze: error: {exc}", file=sys.stderr)
        return 2
    if args.out and len(run_dirs) > 1:
        print(
            "tokendyn analyze: error: --out takes one run directory (each run writes its own analysis/)",
            file=sys.stderr,
        )
        return 2
    errors = 0
    for d in run_dirs:
        console.rule(f"[bold]{run_label(d)}")
        tables = analyze_run(d, steps=args.steps, stage=args.stage, by_step=args.by_step, out_dir=args.out)
        print_report(tables, console, points=args.points)
        out = args.out or f"{d.rstrip('/')}/{ANALYSIS_DIR}"
        written = [f"{n}.parquet" for n, df in tables.items() if df.height]
        skipped = [n for n, df in tables.items() if not df.height]
        console.print(
            f"wrote {', '.join(written)} to {out}"
            + (f" (nothing to write for: {', '.join(skipped)})" if skipped else "")
        )
        errors += len(unreached(tables["bound"])) if "bound" in tables else 0
    side = compare(run_dirs)
    if side:
        console.rule("[bold]rebalancing, side by side")
        for title, frame in side.items():
            print_frame(console, title, frame)
    if errors:
        print(
            f"tokendyn analyze: error: {errors} probe point(s) recorded nothing where tokens were scored",
            file=sys.stderr,
        )
        return 1
    return 0


def print_frame(console: Console, title: str, frame) -> None:
    """A polars frame as a rich table (floats with 3 decimals)."""
    from rich.table import Table

    table = Table(title=title)
    for col in frame.columns:
        table.add_column(col, justify="left" if col == frame.columns[0] else "right")
    for row in frame.iter_rows():
        table.add_row(*[f"{v:.3g}" if isinstance(v, float) else ("-" if v is None else str(v)) for v in row])
    console.print(table)
