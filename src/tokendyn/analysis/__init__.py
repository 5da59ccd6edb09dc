"""Polars over the records: per-bin statistics, bound verification. Needs no torch model, only record files."""

from tokendyn.analysis.load import NoRecordsError, load
from tokendyn.analysis.report import analyze_run, print_report
from tokendyn.analysis.tables import bin_table, bound_report, checks_summary

__all__ = [
    "NoRecordsError",
    "analyze_run",
    "bin_table",
    "bound_report",
    "checks_summary",
    "load",
    "print_report",
]
