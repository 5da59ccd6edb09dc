"""Reading and checking a rollouts table (the schema is in `tokendyn.hooks.rollouts`): every column converted to numpy
per row, every cross-column rule checked, errors naming the column, the row (and the jsonl line) and what is
accepted. No torch model or tokenizer is needed."""

from __future__ import annotations

import difflib
import json
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import torch

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
PER_TOKEN = ("loss_mask", "old_logp", "ref_logp")  # as long as the completion (advantage too, when a list)
LOGP_TOL = 1e-6


class RolloutsError(ValueError):
    """A rollouts file that cannot be used; the message names the column, the row and what is accepted."""


def error(source: str, msg: str) -> RolloutsError:
    return RolloutsError(f"rollouts {source}: {msg}")


def _rows_text(rows: Sequence[int], where) -> str:
    shown = ", ".join(where(int(r)) for r in rows[:3])
    return shown + (f" (and {len(rows) - 3} more)" if len(rows) > 3 else "")


def _short(value) -> str:
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


def _from_python(name: str, values: list, source: str, where) -> list | np.ndarray:
    kind = COLUMNS[name]
    missing = [i for i, v in enumerate(values) if v is None]
    if missing:
        raise error(source, f"column '{name}' is missing or null in {_rows_text(missing, where)}")
    out = []
    for i, v in enumerate(values):
        x = _python_value(kind, v)
        if x is None:
            raise error(
                source,
                f"column '{name}' must be {ACCEPTS[kind]}; {where(i)} has {_short(v)} ({type(v).__name__})",
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


def _from_series(name: str, s: pl.Series, source: str, where) -> list | np.ndarray:
    kind = COLUMNS[name]
    if s.null_count():
        rows = np.flatnonzero(s.is_null().to_numpy())
        raise error(source, f"column '{name}' is null in {_rows_text(rows, where)}")
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
                source, f"column '{name}' has null entries in {_rows_text(np.flatnonzero(bad), where)}"
            )
        if kind == "mask" and inner != pl.Boolean:
            bad = s.list.eval(~pl.element().is_in([0, 1])).list.any().fill_null(False).to_numpy()
            if bad.any():
                rows = np.flatnonzero(bad)
                raise error(source, f"column '{name}' must hold only 0 and 1; see {_rows_text(rows, where)}")
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
        return _from_python(name, s.to_list(), source, where)
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
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
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


def _suggest(names: Sequence[str], present: set[str]) -> str:
    hints = []
    for name in names:
        close = difflib.get_close_matches(name, sorted(present - set(COLUMNS)), n=1, cutoff=0.75)
        if close:
            hints.append(f"'{close[0]}' -> '{name}'?")
    return f" (rename {', '.join(hints)})" if hints else ""


def _pick_mode(t: Table) -> str:
    has = set(t.columns)
    found = f"found columns: {', '.join(sorted(has)) or '(none)'}"
    ids, text = {"prompt_ids", "completion_ids"} & has, {"prompt", "completion"} & has
    if len(ids) == 2:
        return "ids"
    if len(ids) == 1:
        (given,) = ids
        (other,) = {"prompt_ids", "completion_ids"} - ids
        raise error(t.source, f"'{given}' is given but '{other}' is missing (token mode needs both); {found}")
    if len(text) == 2:
        return "text"
    missing = sorted({"prompt", "completion"} - text) if text else ["prompt_ids", "completion_ids"]
    raise error(
        t.source,
        "no completions: give prompt_ids + completion_ids (lists of token ids) or prompt + completion (text); "
        f"{found}{_suggest(missing + ['prompt', 'completion'], has)}",
    )


def _pick_advantage(t: Table) -> str:
    has = set(t.columns)
    if "advantage" in has:
        return "advantage"
    if {"reward", "group"} <= has:
        return "grpo"
    found = f"found columns: {', '.join(sorted(has))}"
    if "reward" in has:
        raise error(
            t.source,
            f"'reward' needs 'group' (the prompt each completion answers) for GRPO advantages; {found}",
        )
    raise error(
        t.source,
        "no advantages: give 'advantage' (a number per completion, or a list per completion token) or 'reward' + "
        f"'group' (GRPO advantages are computed per group); {found}{_suggest(['advantage', 'reward', 'group'], has)}",
    )


def _grpo(rewards: np.ndarray, groups: list, source: str) -> np.ndarray:
    """`grpo_advantages` per group, whatever the row order: rows are gathered by group and scattered back."""
    from tokendyn.trainers.functional import grpo_advantages

    members: dict = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    sizes: dict[int, list] = {}
    for g, rows in members.items():
        sizes.setdefault(len(rows), []).append(g)
    if len(sizes) > 1:
        common = max(sizes, key=lambda k: len(sizes[k]))
        odd = [(g, k) for k, gs in sizes.items() if k != common for g in gs]
        shown = ", ".join(f"{g!r} has {k}" for g, k in odd[:3]) + (" ..." if len(odd) > 3 else "")
        raise error(
            source,
            f"column 'group': every group must have the same number of completions for GRPO advantages; most "
            f"groups have {common}, but {shown} (or give an 'advantage' column instead)",
        )
    (size,) = sizes
    order = np.asarray([i for rows in members.values() for i in rows])
    adv = grpo_advantages(torch.as_tensor(rewards[order], dtype=torch.float64), size).numpy()
    out = np.empty_like(adv)
    out[order] = adv
    return out


def _check_lengths(t: Table, cols: dict, mode: str) -> None:
    where = t.where
    pairs = [("prompt_mask", "prompt_ids"), ("completion_mask", "completion_ids")]
    per_token = [c for c in PER_TOKEN if c in cols]
    if isinstance(cols.get("advantage"), list):
        per_token.append("advantage")
    if mode == "ids":
        pairs += [(c, "completion_ids") for c in per_token]
        for name in ("prompt_ids", "completion_ids"):
            empty = [i for i, v in enumerate(cols[name]) if len(v) == 0]
            if empty:
                raise error(t.source, f"column '{name}' must not be empty; see {_rows_text(empty, where)}")
    for a, b in pairs:
        if a not in cols:
            continue
        bad = [i for i in range(t.n) if len(cols[a][i]) != len(cols[b][i])]
        if bad:
            i = bad[0]
            raise error(
                t.source,
                f"{where(i)}: {a} has {len(cols[a][i])} entries but {b} has {len(cols[b][i])} (they must be equal"
                f"{'' if len(bad) == 1 else f'; also {_rows_text(bad[1:], where)}'})",
            )


def _check_values(t: Table, cols: dict, mode: str) -> None:
    where, src = t.where, t.source
    for name in ("prompt_mask", "completion_mask"):
        for i, m in enumerate(cols.get(name, ())):
            m = m.astype(np.int8)
            # prompts are left-padded (0..0 1..1), completions right-padded (1..1 0..0)
            layout_ok = np.all(np.diff(m) >= 0) if name == "prompt_mask" else np.all(np.diff(m) <= 0)
            if not layout_ok:
                side = "left-padded (0s then 1s)" if name == "prompt_mask" else "right-padded (1s then 0s)"
                raise error(src, f"{where(i)}: {name} must be {side}, as TRL pads; got {_short(m.tolist())}")
            if name == "prompt_mask" and not m.any():
                raise error(src, f"{where(i)}: prompt_mask has no attended prompt token")
    n = t.n
    if mode == "ids":
        scored = [
            cols["loss_mask"][i]
            if "loss_mask" in cols
            else (
                cols["completion_mask"][i]
                if "completion_mask" in cols
                else np.ones(len(cols["completion_ids"][i]), bool)
            )
            for i in range(n)
        ]
        if "loss_mask" in cols and "completion_mask" in cols:
            bad = [i for i in range(n) if np.any(cols["loss_mask"][i] & ~cols["completion_mask"][i])]
            if bad:
                raise error(
                    src,
                    f"loss_mask scores tokens that completion_mask does not attend in {_rows_text(bad, where)}",
                )
        if not any(s.any() for s in scored):
            raise error(src, "no scored completion token (every loss_mask / completion_mask is 0)")
    else:
        scored = [None] * n

    def on_scored(i, v):
        return v if scored[i] is None else v[scored[i]]

    for name in ("old_logp", "ref_logp"):
        for i, v in enumerate(cols.get(name, ())):
            x = on_scored(i, v)
            bad = np.flatnonzero(~np.isfinite(x) | (x > LOGP_TOL))
            if bad.size:
                hint = " (probabilities? take the log)" if x[bad[0]] > LOGP_TOL else ""
                raise error(
                    src,
                    f"{where(i)}: {name} must be finite log-probabilities <= 0 on scored tokens; scored token "
                    f"{int(bad[0])} is {float(x[bad[0]])!r}{hint}",
                )
    adv = cols["advantage"] if "advantage" in cols else None
    if isinstance(adv, np.ndarray):
        bad = np.flatnonzero(~np.isfinite(adv))
        if bad.size:
            raise error(src, f"column 'advantage' must be finite; see {_rows_text(bad, where)}")
    elif adv is not None:
        bad = [i for i, v in enumerate(adv) if not np.isfinite(on_scored(i, v)).all()]
        if bad:
            raise error(
                src, f"column 'advantage' must be finite on scored tokens; see {_rows_text(bad, where)}"
            )
    if "reward" in cols and adv is None:
        bad = np.flatnonzero(~np.isfinite(cols["reward"]))
        if bad.size:
            raise error(src, f"column 'reward' must be finite; see {_rows_text(bad, where)}")


def _temperature(t: Table, values: np.ndarray | None) -> float | None:
    if values is None:
        return None
    distinct = np.unique(values)
    if distinct.size > 1:
        raise error(
            t.source,
            f"column 'temperature' must hold one value (the sampling temperature), found {distinct[:4].tolist()}",
        )
    temp = float(distinct[0])
    if not (np.isfinite(temp) and temp > 0):
        raise error(t.source, f"column 'temperature' must be a number > 0, got {temp!r}")
    return temp


def validate_table(t: Table) -> dict:
    if t.n == 0:
        raise error(t.source, "holds no rows (one completion per row is expected)")
    mode = _pick_mode(t)
    adv_kind = _pick_advantage(t)
    use = ["prompt_ids", "completion_ids"] if mode == "ids" else ["prompt", "completion"]
    use += ["advantage"] if adv_kind == "advantage" else ["reward", "group"]
    use += [
        c
        for c in ("old_logp", "ref_logp", "loss_mask", "prompt_mask", "completion_mask", "temperature")
        if c in t.columns
    ]
    if mode == "text":
        masks = [c for c in ("prompt_mask", "completion_mask", "loss_mask") if c in t.columns]
        if masks:
            raise error(
                t.source, f"{', '.join(masks)} need token ids: give prompt_ids + completion_ids with them"
            )
    cols = {}
    for name in use:
        values = t.columns[name]
        conv = _from_series if isinstance(values, pl.Series) else _from_python
        cols[name] = conv(name, values, t.source, t.where)
    _check_lengths(t, cols, mode)
    _check_values(t, cols, mode)
    if adv_kind == "grpo":
        advantages, source = _grpo(cols["reward"], cols["group"], t.source), "grpo(reward, group)"
    else:
        advantages, source = cols["advantage"], "advantage"
    return dict(
        source=t.source,
        n=t.n,
        prompt_ids=cols.get("prompt_ids"),
        completion_ids=cols.get("completion_ids"),
        prompts=cols.get("prompt"),
        completions=cols.get("completion"),
        advantages=advantages,
        advantage_source=source,
        old_logp=cols.get("old_logp"),
        ref_logp=cols.get("ref_logp"),
        prompt_mask=cols.get("prompt_mask"),
        completion_mask=cols.get("completion_mask"),
        loss_mask=cols.get("loss_mask"),
        temperature=_temperature(t, cols.get("temperature")),
        rewards=cols.get("reward"),
        groups=cols.get("group"),
        ignored=tuple(sorted(set(t.columns) - set(use))),
    )
