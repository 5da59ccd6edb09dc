"""`tokendyn view RUN_DIR [RUN_DIR ...] [--out FILE] [--spike STEP]`: the token view as one standalone page (default
RUN_DIR/view.html for one run; for several, view.html in the folder that holds them all). With `spikes` records it
opens at a spike's top token (``--spike STEP``: that spiking step's; default the first spike)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokendyn.figures.view import VIEW


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `view` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "view",
        help="a standalone page of every recorded token, coloured by share, Δπ, A, π_old, Lopti group",
        description="Read the `token_view` records (and `token_view_rules`, with the paired comparison) of each run "
        "and write one self-contained HTML page: each recorded completion as text, every token coloured by the "
        "quantity picked, hover or focus for its numbers, filters by bin and sign of A, run and step selectors. "
        "Nothing is fetched when it is opened.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories with token_view records")
    p.add_argument("--out", default=None, help=f"the page to write (default: RUN_DIR/{VIEW}, see above)")
    p.add_argument("--spike", default=None, metavar="STEP", help="open at the spike of this step (a step of the "
                   "runs' `spikes` records, as `tokendyn doctor` lists them; default: the first spike)")  # fmt: skip
    p.set_defaults(func=run)
    return p


def default_out(run_dirs: list[str]) -> Path:
    from tokendyn.figures.cli import default_out as figures_out

    return figures_out(run_dirs).parent / VIEW


def run(args: argparse.Namespace) -> int:
    from tokendyn.common import atomic_write
    from tokendyn.figures.cli import check_inputs
    from tokendyn.figures.data import MissingRecords, load_runs
    from tokendyn.figures.view import view_page
    from tokendyn.figures.view_spikes import SpikeChoiceError

    spike = args.spike
    if spike is not None:
        try:
            spike = int(spike)
        except ValueError:
            print(
                f"tokendyn view: error: --spike must be a spiking step (an integer), got {spike!r}",
                file=sys.stderr,
            )
            return 2
    out = Path(args.out) if args.out is not None else default_out(args.run_dirs)
    if out.suffix.lower() not in (".html", ".htm"):
        print(f"tokendyn view: error: --out must name an .html file, got {str(out)!r}", file=sys.stderr)
        return 2
    if not check_inputs("view", args.run_dirs, out):
        return 2
    import polars as pl

    try:
        page = view_page(load_runs(args.run_dirs), spike)
    except (MissingRecords, SpikeChoiceError) as exc:
        print(f"tokendyn view: error: {exc}", file=sys.stderr)
        return 2
    except (pl.exceptions.PolarsError, OSError) as exc:  # a record file that is not a readable parquet
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"tokendyn view: error: run_dirs: unreadable records ({first})", file=sys.stderr)
        return 2
    atomic_write(out, lambda tmp: Path(tmp).write_text(page, encoding="utf-8"))
    print(f"view: {out} ({len(page.encode('utf-8')) / 1e6:.2f} MB)")
    return 0
