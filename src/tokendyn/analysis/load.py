"""Lazy loading of record files: all rank shards of one kind, as one polars LazyFrame."""

from __future__ import annotations

import os
from pathlib import Path

import polars as pl

from tokendyn.common import UsageError
from tokendyn.records import records_dir, scan_records, shard_files
from tokendyn.vocab import point_order, select_names


class NoRecordsError(UsageError, FileNotFoundError):
    """The run directory is missing or holds no record files."""


def check_run_dir(run_dir: str | os.PathLike, kind: str = "binstats") -> Path:
    """The run directory, or a NoRecordsError that says what is missing."""
    path = Path(run_dir)
    if not path.is_dir():
        raise NoRecordsError(f"run directory {str(path)!r} does not exist")
    if not shard_files(path, kind):
        raise NoRecordsError(
            f"no {kind} records in {str(records_dir(path))!r} (expected files like {kind}-rank000-000000.parquet; "
            "train with the probe on, e.g. --probe_every 1, or use tokendyn.hooks.instrument)"
        )
    return path


def load(run_dir: str | os.PathLike, kind: str) -> pl.LazyFrame:
    """Every shard of `kind` (all ranks, all flushes) concatenated lazily; an empty frame with the schema if none.
    Runs recorded by an older version load (`tokendyn.records.scan_records`)."""
    return scan_records(run_dir, kind)


def select_steps(
    lf: pl.LazyFrame, steps: tuple[int | None, int | None] | None = None, stage: str | None = None
) -> pl.LazyFrame:
    """Keep steps in [first, last] (either end may be None) and one stage (None: all)."""
    if steps is not None:
        first, last = steps
        if first is not None:
            lf = lf.filter(pl.col("step") >= first)
        if last is not None:
            lf = lf.filter(pl.col("step") <= last)
    if stage is not None:
        lf = lf.filter(pl.col("stage") == stage)
    return lf


def _steps_text(steps: tuple[int | None, int | None]) -> str:
    first, last = steps
    if first == last:
        return str(first)
    return f"{'' if first is None else first}:{'' if last is None else last}"


def check_selection(
    run_dir: str | os.PathLike,
    steps: tuple[int | None, int | None] | None = None,
    stage: str | None = None,
    points: str | None = None,
) -> None:
    """A selection (`--steps`, `--stage`, `--points`) that matches no binstats row of the run is a `SelectionError`
    naming what the run holds; an analysis of nothing would print empty tables and overwrite earlier outputs."""
    have = load(run_dir, "binstats").select("step", "stage", "point").unique().collect()
    where = str(run_dir)
    stages = sorted(have["stage"].unique().to_list())
    recorded = sorted(have["point"].unique().to_list(), key=point_order)
    if stage is not None and stage not in stages:
        raise SelectionError(
            f"--stage: {stage!r} matches no records in {where}; its stages: {', '.join(stages)}"
        )
    if points is not None:
        try:
            select_names(recorded, points)
        except ValueError as exc:
            raise SelectionError(f"--{exc} (in {where})") from None
    if steps is None:
        return
    picked = have if stage is None else have.filter(pl.col("stage") == stage)
    inside = select_steps(picked.lazy(), steps).collect()
    if not inside.height:
        all_steps = picked["step"]
        what = "" if stage is None else f" of stage {stage!r}"
        raise SelectionError(
            f"--steps: {_steps_text(steps)} matches no records{what} in {where}; its steps{what}: "
            f"{all_steps.min()}..{all_steps.max()} ({all_steps.n_unique()} recorded)"
        )


class SelectionError(UsageError):
    """An analysis selection that matches nothing."""
