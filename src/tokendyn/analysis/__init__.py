"""Polars over the records: per-bin statistics, bound verification. Needs no torch model, only record files."""

from tokendyn.analysis.load import NoRecordsError, load
from tokendyn.analysis.report import analyze_run, print_report
from tokendyn.analysis.run import Run, RunDirError, load_run
from tokendyn.analysis.tables import bin_table, bound_report, checks_summary

__all__ = [
    "NoRecordsError",
    "Run",
    "RunDirError",
    "analyze_run",
    "bin_table",
    "bound_report",
    "checks_summary",
    "load",
    "load_run",
    "print_report",
]
