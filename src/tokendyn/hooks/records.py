"""The record writer of a probed run (one shard per process rank); schemas and layout are in `tokendyn.records`."""

from __future__ import annotations

import os
import time
from pathlib import Path

import polars as pl

from tokendyn.records import (  # noqa: F401  (re-exported: the writer's public names)
    _NAME,
    KINDS,
    RECORDS_DIR,
    SCHEMAS,
    records_dir,
    shard_files,
    to_frame,
    write_atomic,
    write_frames,
)

FLUSH_SECONDS = 30.0  # default bound on the records a kill can lose: those added in the last 30 s


class RecordWriter:
    """Buffers records per kind and writes one parquet file per kind per flush, for one rank.

    `add(records)` takes kind -> columns (what a probe's sink receives). It flushes every `flush_every` adds, and
    also when `flush_seconds` have passed since the last flush (checked at each add; 0 = every add): a kill loses
    at most the records added in the last `flush_seconds` (plus those of the step being recorded).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        rank: int | None = None,
        flush_every: int = 1,
        flush_seconds: float = FLUSH_SECONDS,
    ) -> None:
        if not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(f"records: flush_every must be an integer >= 1, got {flush_every!r}")
        if (
            isinstance(flush_seconds, bool)
            or not isinstance(flush_seconds, int | float)
            or not flush_seconds >= 0
        ):
            raise ValueError(f"records: flush_seconds must be a number >= 0, got {flush_seconds!r}")
        self.run_dir = Path(run_dir)
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else int(rank)
        self.flush_every = flush_every
        self.flush_seconds = float(flush_seconds)
        self._buffer: dict[str, list[pl.DataFrame]] = {k: [] for k in KINDS}
        self._adds = 0
        self._last_flush = time.monotonic()
        self.written: list[Path] = []

    def add(self, records: dict[str, dict[str, list] | pl.DataFrame]) -> None:
        for kind, cols in records.items():
            self._buffer[kind].append(to_frame(kind, cols))
        self._adds += 1
        due = time.monotonic() - self._last_flush >= self.flush_seconds
        if self._adds % self.flush_every == 0 or due:
            self.flush()

    __call__ = add

    def _next_seq(self, kind: str) -> int:
        seqs = [
            int(m["seq"])
            for f in shard_files(self.run_dir, kind)
            if (m := _NAME.match(f.name)) and int(m["rank"]) == self.rank
        ]
        return max(seqs, default=-1) + 1

    def flush(self) -> list[Path]:
        """Write what is buffered; returns the files written."""
        self._last_flush = time.monotonic()
        out = []
        for kind, frames in self._buffer.items():
            frames = [f for f in frames if f.height]
            self._buffer[kind] = []
            if not frames:
                continue
            d = records_dir(self.run_dir)
            d.mkdir(parents=True, exist_ok=True)
            path = d / f"{kind}-rank{self.rank:03d}-{self._next_seq(kind):06d}.parquet"
            write_atomic(pl.concat(frames, how="vertical"), path)
            out.append(path)
        self.written.extend(out)
        return out
