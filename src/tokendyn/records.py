"""Record files on disk: every kind's schema, the file layout, the process rank, the record writer and the loader
shim for run directories written with retired names (polars only; no torch).

Shared by the producers (`tokendyn.probe`, `tokendyn.hooks`) and the readers (`tokendyn.analysis`, `tokendyn.figures`);
the one module that knows the file layout. Names (stages, points, parameter groups) are those of `tokendyn.vocab`.

Layout: RUN_DIR/records/{kind}-rank{RRR}-{NNNNNN}.parquet, one file per kind per flush, one shard per process
rank; NNNNNN counts this rank's flushes of that kind (a new writer continues after the files already there, so
nothing written earlier is overwritten). Each file is written to a hidden temp file in the same folder, then
renamed with os.replace (atomic on POSIX): readers never see a partial file.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import polars as pl

from tokendyn.common import atomic_write
from tokendyn.schemas import KINDS, SCHEMAS
from tokendyn.vocab import LOPTI_ORDERS, RETIRED, RETIRED_STAGE_COUNT, stage_name

# the schemas (`tokendyn.schemas`), re-exported
__all__ = ["KINDS", "SCHEMAS"]

RECORDS_DIR = "records"

_NAME = re.compile(r"^(?P<kind>[a-z_]+)-rank(?P<rank>\d+)-(?P<seq>\d+)\.parquet$")


def records_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / RECORDS_DIR


def shard_files(run_dir: str | os.PathLike, kind: str) -> list[Path]:
    """All shard files of one kind, every rank, in (rank, seq) order."""
    d = records_dir(run_dir)
    if not d.is_dir():
        return []
    found = []
    for f in d.iterdir():
        m = _NAME.match(f.name)
        if m and m["kind"] == kind:
            found.append((int(m["rank"]), int(m["seq"]), f))
    return [f for _, _, f in sorted(found)]


def to_frame(kind: str, columns: dict[str, list] | pl.DataFrame) -> pl.DataFrame:
    """A DataFrame with exactly the schema of `kind` (missing or extra columns are an error)."""
    if kind not in SCHEMAS:
        raise ValueError(f"records: unknown kind {kind!r}; known: {', '.join(KINDS)}")
    schema = SCHEMAS[kind]
    names = list(columns.columns if isinstance(columns, pl.DataFrame) else columns)
    if set(names) != set(schema):
        missing, extra = set(schema) - set(names), set(names) - set(schema)
        raise ValueError(
            f"records: {kind} columns differ from the schema: missing {sorted(missing)}, extra {sorted(extra)}"
        )
    if isinstance(columns, pl.DataFrame):
        return columns.select([pl.col(c).cast(t) for c, t in schema.items()])
    return pl.DataFrame({c: columns[c] for c in schema}, schema=schema, strict=False)


def _checked(kind: str, columns: dict[str, list] | pl.DataFrame) -> pl.DataFrame | dict[str, list]:
    """A frame of `kind` (`to_frame`), or, for column lists, a copy whose names and lengths were checked (built
    into a frame when the writer flushes)."""
    if isinstance(columns, pl.DataFrame):
        return to_frame(kind, columns)
    if kind not in SCHEMAS:
        raise ValueError(f"records: unknown kind {kind!r}; known: {', '.join(KINDS)}")
    if set(columns) != set(SCHEMAS[kind]):
        to_frame(kind, columns)  # raises, naming the missing and extra columns
    lengths = {len(v) for v in columns.values()}
    if len(lengths) > 1:
        raise ValueError(f"records: {kind} columns have unequal lengths {sorted(lengths)}")
    return {c: list(columns[c]) for c in SCHEMAS[kind]}


def process_rank() -> int:
    """This process's rank: torch.distributed's when a process group is up, else $RANK, else 0 (torch is only
    asked when something imported it already: records stay torch-free)."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0"))


def write_parquet(df: pl.DataFrame, path: str | os.PathLike) -> Path:
    """Write parquet atomically (`tokendyn.common.atomic_write`: a temp file beside ``path``, fsync, rename)."""
    return atomic_write(path, df.write_parquet)


def _next_seq(run_dir: str | os.PathLike, kind: str, rank: int) -> int:
    seqs = [
        int(m["seq"])
        for f in shard_files(run_dir, kind)
        if (m := _NAME.match(f.name)) and int(m["rank"]) == rank
    ]
    return max(seqs, default=-1) + 1


def write_frames(
    run_dir: str | os.PathLike, frames: dict[str, pl.DataFrame], rank: int | None = None
) -> list[Path]:
    """Write each non-empty frame as RUN_DIR/records/{kind}-rank{rank:03d}-{seq:06d}.parquet (seq: this rank's next
    free number for that kind), atomically. Returns the files written."""
    rank = process_rank() if rank is None else int(rank)
    checked = {kind: to_frame(kind, df) for kind, df in frames.items()}
    out = []
    d = records_dir(run_dir)
    for kind, df in checked.items():
        if df.height == 0:
            continue
        path = d / f"{kind}-rank{rank:03d}-{_next_seq(run_dir, kind, rank):06d}.parquet"
        out.append(write_parquet(df, path))
    return out


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
        self.rank = process_rank() if rank is None else int(rank)
        self.flush_every = flush_every
        self.flush_seconds = float(flush_seconds)
        # per kind, in order: DataFrames, and runs of column dicts merged into one (built into a frame at flush:
        # one DataFrame per kind per flush instead of one per kind per micro-batch)
        self._buffer: dict[str, list[pl.DataFrame | dict[str, list]]] = {k: [] for k in KINDS}
        self._adds = 0
        self._last_flush = time.monotonic()
        self._lock = threading.RLock()  # the timer thread and the caller share the buffer
        self._timer: threading.Timer | None = None
        self.written: list[Path] = []

    def add(self, records: dict[str, dict[str, list] | pl.DataFrame]) -> None:
        """Buffer one micro-batch's records (kind -> columns), checked here: a kind or a column set other than its
        schema's, or columns of unequal lengths, raise now, not at the flush."""
        parts = [(kind, _checked(kind, cols)) for kind, cols in records.items()]
        with self._lock:
            for kind, part in parts:
                buf = self._buffer[kind]
                if isinstance(part, dict) and buf and isinstance(buf[-1], dict):
                    for c, values in part.items():
                        buf[-1][c].extend(values)
                else:
                    buf.append(part)
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

    def flush(self) -> list[Path]:
        """Write what is buffered; returns the files written."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._last_flush = time.monotonic()
            frames = {}
            for kind, parts in self._buffer.items():
                parts = [to_frame(kind, f) if isinstance(f, dict) else f for f in parts]
                parts = [f for f in parts if f.height]
                self._buffer[kind] = []
                if parts:
                    frames[kind] = pl.concat(parts, how="vertical")
            out = write_frames(self.run_dir, frames, rank=self.rank)
            self.written.extend(out)
            return out


# ---- reading, and run directories written with retired names (tokendyn.vocab.RETIRED) -----------------------------
def upgrade_columns(kind: str, lf: pl.LazyFrame, columns: Sequence[str]) -> pl.LazyFrame:
    """A record frame read from a file whose columns are ``columns``, with retired column names replaced by today's
    (`tokendyn.vocab.RETIRED`)."""
    rules = RETIRED.get(kind, {"columns": {}})
    renames = {old: new for old, new in rules["columns"].items() if old in columns and new not in columns}
    return lf.rename(renames) if renames else lf


def upgrade_values(kind: str, lf: pl.LazyFrame, lopti_order: str = "low_first") -> pl.LazyFrame:
    """Retired values replaced by today's (`tokendyn.vocab.RETIRED`; the old update stages stage1 / stage2, the first
    / second Lopti stage, become low / high by ``lopti_order``, the run's). Today's values are left as they are."""
    rules = RETIRED.get(kind, {"values": {}})
    for column, mapping in rules["values"].items():
        full = {**mapping, **{old: stage_name(n, lopti_order) for old, n in RETIRED_STAGE_COUNT.items()}}
        lf = lf.with_columns(pl.col(column).replace(full))
    return lf


def run_lopti_order(run_dir: str | os.PathLike) -> str:
    """The run's Lopti stage order from run.json's config (``low_first`` when absent)."""
    try:
        meta = json.loads((Path(run_dir) / "run.json").read_text())
    except (OSError, ValueError):
        return "low_first"
    order = (meta.get("config") or {}).get("lopti_order") if isinstance(meta, dict) else None
    return order if order in LOPTI_ORDERS else "low_first"


def _retired(kind: str, columns: Sequence[str]) -> bool:
    return bool(set(RETIRED.get(kind, {"columns": {}})["columns"]) & set(columns))


def scan_records(run_dir: str | os.PathLike, kind: str) -> pl.LazyFrame:
    """Every shard of ``kind`` (all ranks, all flushes) as one LazyFrame with the kind's schema; an empty frame if
    none. A column the schema gained after a shard was written reads as nulls, and a shard written with retired
    names (`upgrade_columns`, `upgrade_values`) is read in today's: run directories of older versions load."""
    if kind not in SCHEMAS:
        raise ValueError(f"unknown record kind {kind!r}; known: {', '.join(KINDS)}")
    schema = SCHEMAS[kind]
    files = shard_files(run_dir, kind)
    if not files:
        return pl.LazyFrame(schema=schema)
    current, old = [], []
    for f in files:  # glob=False: a run directory may contain [ ] * ? in its name
        renamed = RETIRED.get(kind, {}).get("columns")
        columns = pl.scan_parquet(f, glob=False).collect_schema().names() if renamed else []
        (old if _retired(kind, columns) else current).append((f, columns))
    parts = []
    if current:
        parts.append(
            pl.scan_parquet([str(f) for f, _ in current], schema=schema, glob=False, missing_columns="insert")
        )
    for f, columns in old:
        lf = upgrade_columns(kind, pl.scan_parquet(str(f), glob=False), columns)
        named = set(lf.collect_schema().names())
        parts.append(
            lf.select(
                [
                    pl.col(c).cast(t) if c in named else pl.lit(None, dtype=t).alias(c)
                    for c, t in schema.items()
                ]
            )
        )
    lf = parts[0] if len(parts) == 1 else pl.concat(parts, how="vertical")
    return upgrade_values(kind, lf, run_lopti_order(run_dir)) if RETIRED.get(kind, {}).get("values") else lf
