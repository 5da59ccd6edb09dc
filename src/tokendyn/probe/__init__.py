"""Measurements on one model and one batch: per-token activation-gradient norms binned by probability, and the
(1 - pi) bound. Knows nothing of TRL; see `GradientProbe`."""

from tokendyn.probe.bins import DEFAULT_EDGES, BinSpec, assign_bins
from tokendyn.probe.points import FINAL_NORM, ProbePoint, discover_points, select_points
from tokendyn.probe.probe import GradientProbe
from tokendyn.probe.reduce import StepResult
from tokendyn.probe.stats import BinStats, LogHistogram

__all__ = [
    "DEFAULT_EDGES",
    "FINAL_NORM",
    "BinSpec",
    "BinStats",
    "GradientProbe",
    "LogHistogram",
    "ProbePoint",
    "StepResult",
    "assign_bins",
    "discover_points",
    "select_points",
]
