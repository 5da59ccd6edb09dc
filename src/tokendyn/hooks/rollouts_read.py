"""Reading a rollouts table (the schema is in `tokendyn.hooks.rollouts`): parquet or jsonl into a `Table`, and every
column converted to numpy per row, errors naming the column, the row (and the jsonl line) and what is accepted. The
cross-column rules are in `tokendyn.hooks.rollouts_check`. No torch model or tokenizer is needed."""

from __future__ import annotations

import json
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from tokendyn.common import UsageError

SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl"}

# column -> kind; the kinds' accepted forms are in ACCEPTS
COLUMNS = {
    "prompt_ids": "ids",
    "completion_ids": "ids",
    "prompt": "prompt",
    "completion": "text",
    "advantage": "advantage",
    "reward": "number",
    "group": "group",
    "old_logp": "numbers",
    "ref_logp": "numbers",
    "sampler_logp": "numbers",
    "prompt_mask": "mask",
    "completion_mask": "mask",
    "loss_mask": "mask",
    "temperature": "number",
}
ACCEPTS = {
    "ids": "a list of integers (token ids)",
    "mask": "a list of 0/1 (or booleans)",
    "numbers": "a list of numbers, one per completion token",
    "number": "a number",
    "advantage": "a number (per completion) or a list of numbers (one per completion token)",
    "group": "an integer or a string (the prompt's id)",
    "text": "a string",
    "prompt": "a string or a list of chat messages {role, content}",
}
PER_TOKEN = (
    "loss_mask",
    "old_logp",
    "ref_logp",
    "sampler_logp",
)  # as long as the completion (advantage too, when a list)
LOGP_TOL = 1e-6


class RolloutsError(UsageError):
    """A rollouts file that cannot be used; the message names the column, the row and what is accepted."""


def error(source: str, msg: str) -> RolloutsError:
    return RolloutsError(f"rollouts {source}: {msg}")


def rows_text(rows: Sequence[int], where) -> str:
    """The first three offending rows for a message ("row 3, row 7 (and 2 more)")."""
    shown = ", ".join(where(int(r)) for r in rows[:3])
    return shown + (f" (and {len(rows) - 3} more)" if len(rows) > 3 else "")


def short_value(value) -> str:
    """A value's repr cut to 40 characters, for a message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---- one column: python values (jsonl, dicts) or a polars Series (parquet, DataFrame) -> numpy per row ------------
def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool | np.bool_)


def _is_num(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool | np.bool_)


def _is_message(m) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _python_value(kind: str, v):
    """The normalised value, or None when v does not have the kind's form."""
    if kind in ("ids", "mask", "numbers") or (kind == "advantage" and isinstance(v, list | tuple)):
        if not isinstance(v, list | tuple):
            return None
        if kind == "ids":
            return np.asarray(v, dtype=np.int64) if all(_is_int(x) for x in v) else None
        if kind == "mask":
            ok = all(isinstance(x, bool | np.bool_) or (_is_int(x) and x in (0, 1)) for x in v)
            return np.asarray(v, dtype=bool) if ok else None
        return np.asarray(v, dtype=np.float64) if all(_is_num(x) for x in v) else None
    if kind in ("number", "advantage"):
        return float(v) if _is_num(v) else None
    if kind == "group":
        return v if isinstance(v, str) or _is_int(v) else None
    if kind == "text":
        return v if isinstance(v, str) else None
    if kind == "prompt":
        if isinstance(v, str):
            return v
        if isinstance(v, list | tuple) and v and all(_is_message(m) for m in v):
            return [{"role": m["role"], "content": m["content"]} for m in v]
        return None
    raise AssertionError(kind)


def column_from_python(name: str, values: list, source: str, where) -> list | np.ndarray:
    """Column ``name`` from python values (jsonl rows, dicts): numpy per row (lists) or one array (scalars)."""
    kind = COLUMNS[name]
    missing = [i for i, v in enumerate(values) if v is None]
    if missing:
        raise error(source, f"column '{name}' is missing or null in {rows_text(missing, where)}")
    out = []
    for i, v in enumerate(values):
        x = _python_value(kind, v)
        if x is None:
            raise error(
                source,
                f"column '{name}' must be {ACCEPTS[kind]}; {where(i)} has {short_value(v)} ({type(v).__name__})",
            )
        out.append(x)
    if kind == "advantage":
        lists = [isinstance(x, np.ndarray) for x in out]
        if any(lists) and not all(lists):
            i, j = lists.index(False), lists.index(True)
            raise error(
                source,
                f"column 'advantage' must be a number in every row or a list in every row; {where(i)} has a "
                f"number, {where(j)} a list",
            )
        if not any(lists):
            return np.asarray(out, dtype=np.float64)
    if kind == "number":
        return np.asarray(out, dtype=np.float64)
    return out


def _split(s: pl.Series, dtype) -> list[np.ndarray]:
    lengths = s.list.len().to_numpy()
    flat = s.explode().to_numpy().astype(dtype, copy=False)
    return np.split(flat, np.cumsum(lengths)[:-1])


def column_from_series(name: str, s: pl.Series, source: str, where) -> list | np.ndarray:
    """Column ``name`` from a polars Series (parquet, DataFrame), as `column_from_python`."""
    kind = COLUMNS[name]
    if s.null_count():
        rows = np.flatnonzero(s.is_null().to_numpy())
        raise error(source, f"column '{name}' is null in {rows_text(rows, where)}")
    if isinstance(s.dtype, pl.Array):
        s = s.cast(pl.List(s.dtype.inner))
    dtype = s.dtype
    inner = dtype.inner if isinstance(dtype, pl.List) else None

    def wrong() -> RolloutsError:
        return error(source, f"column '{name}' must be {ACCEPTS[kind]}; the file's type is {dtype}")

    if inner is not None and kind in ("ids", "mask", "numbers", "advantage"):
        if kind == "ids" and not inner.is_integer():
            raise wrong()
        if kind == "mask" and not (inner.is_integer() or inner == pl.Boolean):
            raise wrong()
        if kind in ("numbers", "advantage") and not inner.is_numeric():
            raise wrong()
        bad = s.list.eval(pl.element().is_null()).list.any().fill_null(False).to_numpy()
        if bad.any():
            raise error(
                source, f"column '{name}' has null entries in {rows_text(np.flatnonzero(bad), where)}"
            )
        if kind == "mask" and inner != pl.Boolean:
            bad = s.list.eval(~pl.element().is_in([0, 1])).list.any().fill_null(False).to_numpy()
            if bad.any():
                rows = np.flatnonzero(bad)
                raise error(source, f"column '{name}' must hold only 0 and 1; see {rows_text(rows, where)}")
        return _split(s, {"ids": np.int64, "mask": bool}.get(kind, np.float64))
    if kind in ("number", "advantage") and dtype.is_numeric():
        return s.cast(pl.Float64).to_numpy()
    if kind == "group" and (
        dtype.is_integer() or dtype in (pl.String, pl.Categorical) or isinstance(dtype, pl.Enum)
    ):
        return s.cast(pl.String).to_list() if not dtype.is_integer() else s.to_list()
    if kind in ("text", "prompt") and dtype == pl.String:
        return s.to_list()
    if kind == "prompt" and inner is not None and isinstance(inner, pl.Struct):
        return column_from_python(name, s.to_list(), source, where)
    raise wrong()


# ---- the table ---------------------------------------------------------------------------------------------------
@dataclass
class Table:
    source: str
    n: int
    columns: dict[str, list | pl.Series]
    lines: list[int] | None = None  # jsonl: the line of each row

    def where(self, i: int) -> str:
        return f"row {i}" if self.lines is None else f"row {i} (line {self.lines[i]})"


def _read_jsonl(path: Path, source: str) -> Table:
    rows, lines = [], []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise error(
                    source,
                    f"line {lineno} is not UTF-8 text (byte {exc.start} of the line); jsonl must be UTF-8",
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(
                    source, f"line {lineno} is not valid JSON ({exc.msg}, column {exc.colno})"
                ) from None
            if not isinstance(obj, dict):
                raise error(
                    source, f"line {lineno} must be a JSON object (one completion), got {type(obj).__name__}"
                )
            rows.append(obj)
            lines.append(lineno)
    return rows_table(rows, source, lines)


def rows_table(rows: list[dict], source: str, lines: list[int] | None = None) -> Table:
    names = {k for r in rows for k in r}
    cols = {name: [r.get(name) for r in rows] for name in names}
    return Table(source, len(rows), cols, lines)


def read_table(path: Path) -> Table:
    source = str(path)
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise error(source, f"unknown file type {path.suffix or '(no suffix)'!r}; use .parquet or .jsonl")
    if not path.is_file():
        raise error(source, "no such file")
    if kind == "jsonl":
        return _read_jsonl(path, source)
    try:
        df = pl.read_parquet(path)
    except Exception as exc:  # polars raises several error types for unreadable files
        raise error(
            source, f"cannot be read as parquet ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        ) from None
    return Table(source, df.height, {c: df[c] for c in df.columns})
