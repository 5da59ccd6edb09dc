"""Record files: schemas and the atomic parquet writer (polars only; importing this module does not import torch).

Layout: RUN_DIR/records/{kind}-rank{RRR}-{NNNNNN}.parquet, one file per kind per flush, one shard per process
rank; NNNNNN counts this rank's flushes of that kind (a new writer continues after the files already there, so
nothing written earlier is overwritten). Each file is written to a hidden temp file in the same folder, then
renamed with os.replace (atomic on POSIX): readers never see a partial file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import polars as pl

RECORDS_DIR = "records"
_KEY = {"step": pl.Int64, "stage": pl.Utf8, "rank": pl.Int32, "micro": pl.Int32}

SCHEMAS: dict[str, dict[str, pl.DataType]] = {
    # per (step, stage, rank, micro, point, bin, quantity); quantity in norm | norm_per_w | ratio
    "binstats": {
        **_KEY,
        "point": pl.Utf8,
        "point_index": pl.Int32,
        "bin": pl.Int32,
        "bin_lo": pl.Float64,
        "bin_hi": pl.Float64,
        "quantity": pl.Utf8,
        "count": pl.Int64,
        "sum": pl.Float64,
        "sumsq": pl.Float64,
        "min": pl.Float64,
        "max": pl.Float64,
        "nonfinite": pl.Int64,
    },
    # non-empty cells of the log-spaced histogram of each quantity
    "hist": {
        **_KEY,
        "point": pl.Utf8,
        "bin": pl.Int32,
        "quantity": pl.Utf8,
        "cell": pl.Int32,
        "lo": pl.Float64,
        "hi": pl.Float64,
        "count": pl.Int64,
    },
    # per point: envelope of ratio = ||delta|| / (|w| (1 - pi)) and spearman(||delta|| / |w|, 1 - pi)
    "bound": {
        **_KEY,
        "point": pl.Utf8,
        "point_index": pl.Int32,
        "n": pl.Int64,
        "ratio_min": pl.Float64,
        "ratio_max": pl.Float64,
        "spearman": pl.Float64,
        "nonfinite": pl.Int64,
        "direct_n": pl.Int64,
        "direct_ratio_min": pl.Float64,
        "direct_ratio_max": pl.Float64,
        "direct_spearman": pl.Float64,
    },
    # the exact checks at the LM head and the logits
    "checks": {
        **_KEY,
        "vocab_size": pl.Int64,
        "temperature": pl.Float64,
        "grad_dtype": pl.Utf8,
        "n_checked": pl.Int64,
        "identity_n": pl.Int64,
        "identity_max_rel_err": pl.Float64,
        "identity_mean_rel_err": pl.Float64,
        "identity_max_scaled_err": pl.Float64,
        "identity_logits_max_rel_err": pl.Float64,
        "logits_lo": pl.Float64,
        "logits_hi": pl.Float64,
        "logits_ratio_min": pl.Float64,
        "logits_ratio_max": pl.Float64,
        "logits_violations": pl.Int64,
        "head_sigma_max": pl.Float64,
        "head_bound": pl.Float64,
        "head_ratio_max": pl.Float64,
        "head_n": pl.Int64,
        "head_violations": pl.Int64,
        "tolerance": pl.Float64,
    },
    # the bounded token sample: one row per (sampled token, point)
    "tokens": {
        **_KEY,
        "row": pl.Int32,
        "pos": pl.Int32,
        "token_id": pl.Int64,
        "bin": pl.Int32,
        "pi_old": pl.Float64,
        "pi": pl.Float64,
        "advantage": pl.Float64,
        "w": pl.Float64,
        "point": pl.Utf8,
        "norm": pl.Float64,
        "ratio": pl.Float64,
        "direct_norm": pl.Float64,
        "direct_ratio": pl.Float64,
        "identity_rel_err": pl.Float64,
        "logits_ratio": pl.Float64,
    },
}
KINDS = tuple(SCHEMAS)
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


def write_atomic(df: pl.DataFrame, path: Path) -> None:
    """Write parquet to a temp file next to `path`, fsync, then os.replace: all or nothing."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        df.write_parquet(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


class RecordWriter:
    """Buffers records per kind and writes one parquet file per kind per flush, for one rank.

    `add(records)` takes kind -> columns (what a probe's sink receives); every `flush_every` adds it flushes.
    """

    def __init__(self, run_dir: str | os.PathLike, rank: int | None = None, flush_every: int = 1) -> None:
        if not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(f"records: flush_every must be an integer >= 1, got {flush_every!r}")
        self.run_dir = Path(run_dir)
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else int(rank)
        self.flush_every = flush_every
        self._buffer: dict[str, list[pl.DataFrame]] = {k: [] for k in KINDS}
        self._adds = 0
        self.written: list[Path] = []

    def add(self, records: dict[str, dict[str, list] | pl.DataFrame]) -> None:
        for kind, cols in records.items():
            self._buffer[kind].append(to_frame(kind, cols))
        self._adds += 1
        if self._adds % self.flush_every == 0:
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
