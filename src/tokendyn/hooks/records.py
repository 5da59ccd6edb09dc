"""The record writer of a probed run (one shard per process rank); schemas and layout are in `tokendyn.records`."""

from __future__ import annotations

import os
import threading
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
    at the latest `flush_seconds` after the last flush once something is buffered (at the next add, or from a
    timer thread if no add comes; 0 = at every add): a kill loses at most the records added in the last
    `flush_seconds` (plus those of the micro-batch being recorded). `flush()` writes at once and disarms the timer.
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
        self._lock = threading.RLock()  # the timer thread and the caller share the buffer
        self._timer: threading.Timer | None = None
        self.written: list[Path] = []

    def add(self, records: dict[str, dict[str, list] | pl.DataFrame]) -> None:
        frames = [(kind, to_frame(kind, cols)) for kind, cols in records.items()]
        with self._lock:
            for kind, frame in frames:
                self._buffer[kind].append(frame)
            self._adds += 1
            wait = self.flush_seconds - (time.monotonic() - self._last_flush)
            if self._adds % self.flush_every == 0 or wait <= 0:
                self.flush()
            elif self._timer is None:
                self._timer = threading.Timer(wait, self._timed_flush)
                self._timer.daemon = True
                self._timer.start()

    def _timed_flush(self) -> None:
        with self._lock:
            self._timer = None
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
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._last_flush = time.monotonic()
            return self._write()

    def _write(self) -> list[Path]:
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
