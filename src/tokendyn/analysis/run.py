"""`load_run`: one run directory as its config and one polars LazyFrame per record kind: the entry point to the
records for a user, and the one `tokendyn analyze` and `tokendyn figures` read through.

    import tokendyn
    run = tokendyn.load_run("runs/demo/grpo")
    run.config["lopti_eta"], run.method          # run.json: the trainer config, the method's name
    run.kinds                                     # the kinds on disk, e.g. ["binstats", "hist", ..., "metrics"]
    run["binstats"].filter(pl.col("point") == "final_norm.out").collect()

A record kind is every shard of that kind (all ranks, all flushes: ``RUN_DIR/records/{kind}-rankNNN-NNNNNN.parquet``)
scanned lazily with the schema of `tokendyn.records.SCHEMAS` (docs/records.md documents every column); ``metrics``
is the training log ``RUN_DIR/metrics.parquet`` (one row per logged step). No torch import.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from tokendyn.analysis.load import load
from tokendyn.common import UsageError
from tokendyn.records import KINDS, records_dir, shard_files

METRICS = "metrics"  # the training log: RUN_DIR/metrics.parquet


class RunDirError(UsageError):
    """A path given as a run directory is not one."""


@dataclass(frozen=True)
class Run:
    """A run directory: ``meta`` is run.json (empty when absent), ``kinds`` the record kinds it holds (in the order
    of `tokendyn.records.KINDS`, then ``metrics``)."""

    path: Path
    meta: dict = field(default_factory=dict)
    kinds: tuple[str, ...] = ()

    @property
    def config(self) -> dict:
        """The trainer config of run.json (every TokendynGRPOConfig field); empty for a run written by
        ``instrument`` or ``tokendyn probe`` without one."""
        return self.meta.get("config") or {}

    @property
    def method(self) -> str:
        """The method's name ("GRPO", "GRPO + Reweight(a=0.3)", ...), else the folder's name."""
        return self.meta.get("method") or self.path.name

    def __getitem__(self, kind: str) -> pl.LazyFrame:
        """The records of ``kind`` as a LazyFrame (with the kind's full schema; no rows when the run has none)."""
        if kind == METRICS:
            f = self.path / "metrics.parquet"
            return pl.scan_parquet(f, glob=False) if f.is_file() else pl.LazyFrame()
        if kind not in KINDS:
            raise KeyError(f"unknown record kind {kind!r}; known: {', '.join((*KINDS, METRICS))}")
        return load(self.path, kind)

    def frames(self) -> dict[str, pl.LazyFrame]:
        """Every kind the run holds, as {kind: LazyFrame}."""
        return {k: self[k] for k in self.kinds}


def _read_meta(path: Path) -> dict:
    f = path / "run.json"
    if not f.is_file():
        return {}
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def load_run(run_dir: str | os.PathLike) -> Run:
    """The run directory at ``run_dir``: a `RunDirError` when it does not exist or holds neither run.json,
    metrics.parquet nor records."""
    p = Path(run_dir)
    if not p.is_dir():
        raise RunDirError(f"run directory {str(p)!r} does not exist or is not a directory")
    kinds = [k for k in KINDS if shard_files(p, k)]
    if (p / "metrics.parquet").is_file():
        kinds.append(METRICS)
    has_records = records_dir(p).is_dir() and any(records_dir(p).glob("*.parquet"))
    if not ((p / "run.json").is_file() or kinds or has_records):
        raise RunDirError(
            f"{str(p)!r} is not a run directory: no run.json, metrics.parquet or records/*.parquet in it "
            "(train with `tokendyn train ... --probe_every N`, or record a loop with tokendyn.hooks.instrument)"
        )
    return Run(p, _read_meta(p), tuple(kinds))
