"""The run a diagnosis reads: its records (any stack: TRL live, verl's actor, `tokendyn probe` offline, `instrument`),
which stack wrote it (for the spelling of what to try) and small helpers over its record kinds."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import polars as pl

from tokendyn.analysis.run import Run
from tokendyn.analysis.study import bootstrap_units

STACKS = ("trl", "verl", "probe")


def stack_of(meta: dict) -> str:
    """``verl`` (run.json ``source: verl``), ``probe`` (``tokendyn probe`` offline or ``instrument``: a loop tokendyn
    does not drive), else ``trl`` (`tokendyn train`, the demo, the study)."""
    if meta.get("source") == "verl":
        return "verl"
    if meta.get("source") == "instrument" or meta.get("method") == "offline probe" or "rollouts" in meta:
        return "probe"
    return "trl"


@dataclass
class RunContext:
    """One run directory, loaded once."""

    run: Run

    @property
    def stack(self) -> str:
        return stack_of(self.run.meta)

    @property
    def config(self) -> dict:
        return self.run.config

    def has(self, kind: str) -> bool:
        return kind in self.run.kinds

    def frame(self, kind: str) -> pl.DataFrame:
        """Every row of ``kind`` (no rows when the run has none)."""
        return self.run[kind].collect() if self.has(kind) else pl.DataFrame()

    @cached_property
    def sampler(self) -> pl.DataFrame:
        from tokendyn.analysis.mismatch_seeds import sampler_rows

        return sampler_rows(self.run.path) if self.has("sampler") else pl.DataFrame()

    @cached_property
    def paired(self) -> pl.DataFrame:
        return self.frame("paired")

    @cached_property
    def probed_steps(self) -> list[int]:
        """The optimizer steps the probe recorded (binstats), sorted."""
        if not self.has("binstats"):
            return []
        return sorted(self.run["binstats"].select("step").unique().collect()["step"].to_list())


def steps_interval(values: np.ndarray, statistic) -> tuple[float, float, float]:
    """(estimate, lo, hi) of ``statistic(idx)`` over one run's probed steps resampled with replacement (95 %
    percentile interval, `tokendyn.analysis.study.bootstrap_units` with one seed; NaN bounds for one step)."""
    return bootstrap_units([np.arange(len(values))], statistic, min_units=2)
