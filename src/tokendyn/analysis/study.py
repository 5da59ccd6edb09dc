"""The study's numbers with 95 % intervals: accuracy per puzzle size, per-bin token shares, update shares,
gradient norms and corrected correct ratios of several methods over several seeds, and the table of what
reproduces. Pure: numpy and polars over evaluation tables and record files, no torch.

Intervals are percentile bootstraps (B resamples, level 1 - a):

- accuracy: outcomes x[s, j] in {0, 1} of seed s (rows) on held-out puzzle j (columns, the same puzzles for
  every seed). A resample draws seeds S* and puzzles J* independently with replacement and takes
  theta* = mean_{s in S*, j in J*} x[s, j]; the interval is [q_{a/2}, q_{1-a/2}] of the theta*. A paired
  difference between two methods is the same bootstrap on d[s, j] = x_m[s, j] - x_ref[s, j].
- record statistics (shares, norms, correct ratios): units are the probed steps of each seed's run. A resample
  draws seeds with replacement, then, within each drawn seed, its steps with replacement (two levels), and
  recomputes the statistic from the drawn units (a ratio of sums for correct ratios, a mean otherwise).
"""

from __future__ import annotations

import polars as pl

from tokendyn.analysis.accuracy import accuracy_table, outcome_matrix, paired_difference
from tokendyn.analysis.bootstrap import LEVEL, N_BOOT, bootstrap_two_way, bootstrap_units
from tokendyn.analysis.reproduces import (
    CLAIMS,
    EXCLUDED,
    NO_DATA,
    NOT_REPRODUCED,
    NOT_RESOLVED,
    PAPER_CORRECT,
    REPRODUCED,
    VERDICT_RULE,
    paired_bins_table,
    reproduces_table,
    verdict,
)
from tokendyn.analysis.study_units import (
    PAIRED_MODE,
    PAIRED_RULES,
    Unit,
    load_units,
    method_bins_table,
)

# the study's parts, re-exported: the bootstrap (`tokendyn.analysis.bootstrap`), the accuracy
# (`tokendyn.analysis.accuracy`), the record statistics (`tokendyn.analysis.study_units`) and what reproduces
# (`tokendyn.analysis.reproduces`)
__all__ = [
    "LEVEL",
    "N_BOOT",
    "bootstrap_two_way",
    "bootstrap_units",
    "accuracy_table",
    "outcome_matrix",
    "paired_difference",
    "PAIRED_MODE",
    "PAIRED_RULES",
    "Unit",
    "load_units",
    "method_bins_table",
    "CLAIMS",
    "EXCLUDED",
    "NO_DATA",
    "NOT_REPRODUCED",
    "NOT_RESOLVED",
    "PAPER_CORRECT",
    "REPRODUCED",
    "VERDICT_RULE",
    "paired_bins_table",
    "reproduces_table",
    "verdict",
    "markdown",
]


def markdown(df: pl.DataFrame, digits: int = 3) -> str:
    """A GitHub markdown table of df (floats rounded)."""

    def fmt(v) -> str:
        if v is None:
            return "–"
        if isinstance(v, float):
            if v != v:
                return "nan"
            return f"{v:.{digits}g}" if 0 < abs(v) < 10**-digits else f"{v:.{digits}f}"
        return str(v)

    def cell(v) -> str:
        return fmt(v).replace("|", "\\|")  # a pipe inside a cell (||g_b||) would split the column

    head = "| " + " | ".join(cell(c) for c in df.columns) + " |"
    sep = "|" + "|".join("---" for _ in df.columns) + "|"
    body = ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.iter_rows()]
    return "\n".join([head, sep, *body])
