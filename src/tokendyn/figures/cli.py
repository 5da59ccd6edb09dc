"""`tokendyn figures RUN_DIR [RUN_DIR ...] [--out DIR] [--format png|svg|pdf]`: every figure the records allow, the
tables, and one self-contained report.html; several runs are drawn side by side / overlaid."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tokendyn.figures.report import FORMATS, REPORT


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `figures` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "figures",
        help="the paper's figures and report.html from one or more run directories",
        description="Read RUN_DIR/records/*.parquet, RUN_DIR/metrics.parquet and RUN_DIR/run.json of each run, draw "
        "every figure the records allow (runs side by side / overlaid, named by method), write the tables as CSV "
        f"and one self-contained {REPORT}. Figures whose record kinds are missing are skipped with a note.",
    )
    p.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (written by tokendyn train)"
    )
    p.add_argument(
        "--out",
        default=None,
        help="output folder, created (default: RUN_DIR/figures for one run; for several, figures/ in the folder "
        "that holds them all)",
    )
    p.add_argument(
        "--format", default="png", choices=FORMATS, help="file format of the figures (default png)"
    )
    p.set_defaults(func=run)
    return p


def default_out(run_dirs: list[str]) -> Path:
    """RUN_DIR/figures for one run; for several, figures/ in their deepest common folder."""
    paths = [Path(d).resolve() for d in run_dirs]
    if len(paths) == 1:
        return paths[0] / "figures"
    return Path(os.path.commonpath(paths)) / "figures"


def check_inputs(command: str, run_dirs: list[str], out: str | os.PathLike) -> bool:
    """Every run directory, then the output path, checked before any work; False (the error printed in one line,
    naming the command) when one is bad."""
    from tokendyn.common import check_writable
    from tokendyn.figures.data import RunDirError, check_run_dir

    try:
        for d in run_dirs:
            check_run_dir(d)
        check_writable(out, "--out")
    except (RunDirError, ValueError) as exc:
        print(f"tokendyn {command}: error: {exc}", file=sys.stderr)
        return False
    return True


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.out is None:
        args.out = str(default_out(args.run_dirs))
    if not check_inputs("figures", args.run_dirs, args.out):
        return 2

    from tokendyn.common import progress_bar
    from tokendyn.figures.report import FIGURES, TABLES, build_report

    console = Console()
    with progress_bar("figures", len(FIGURES) + len(TABLES)) as tick:
        result = build_report(args.run_dirs, args.out, fmt=args.format, progress=tick)
    for name, note in result.notes.items():
        console.print(f"[yellow]{name}[/yellow]: {note}", highlight=False)
    console.print(
        f"wrote {len(result.figures)} figures ({args.format}) and {len(result.tables)} tables to {args.out}",
        highlight=False,
    )
    print(f"report: {result.path}")
    return 0
