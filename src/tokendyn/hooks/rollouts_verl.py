"""A verl rollout batch (a ``DataProto``) as a rollouts table (`tokendyn.hooks.rollouts`), read in one of two forms:

    DIR/             a tensordict directory: ``data.batch.memmap(DIR)`` (or ``.save(DIR)``) writes DIR/meta.json and
                     one raw ``<field>.memmap`` file per tensor. Read here from the JSON and the raw bytes alone:
                     nothing is unpickled, so no flag is needed. The non-tensor fields go beside them in the optional
                     DIR/non_tensor.json: {"non_tensor_batch": {"uid": [...]}, "meta_info": {"temperature": T}}.
    FILE.dp, .pkl    ``data.save_to_disk(FILE)``: verl pickles the whole DataProto (verl/protocol.py: save_to_disk is
                     ``pickle.dump(self, f)``; __getstate__ stores the batch as ``torch.save`` bytes, __setstate__
                     reads them back with ``torch.load(weights_only=False)``). Unpickling runs code from the file,
                     so it is read only when asked (``allow_pickle``, the CLI's --allow_pickle), by verl's own
                     ``DataProto.load_from_disk``.

tensordict's own loader (``TensorDict.load_memmap``) is not used: a sub-directory whose meta.json names a tensorclass
or a non-tensor stack is unpickled (tensordict/tensorclass.py: ``pickle.load`` of other.pickle and of pickle.pkl).
Here only plain tensor entries of a plain TensorDict are read; nested entries are left unread.

`dataproto_table` converts the fields (the formulas are in its docstring); errors name the field, the row and what
is accepted. verl itself is imported only to unpickle a DataProto file."""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import polars as pl
import torch

from tokendyn.hooks.rollouts_check import validate_table
from tokendyn.hooks.rollouts_read import Table, error, rows_text, short_value

# .dp: verl's own name for a saved DataProto (verl/utils/skip/rollout_skip.py, gen_batch.dp)
PICKLE_SUFFIXES = (".dp", ".pkl", ".pickle")
SIDECAR = "non_tensor.json"
TENSORDICT_TYPE = "<class 'tensordict._td.TensorDict'>"  # meta.json's _type of a plain TensorDict
# the dtypes read from a tensordict directory, by meta.json's name
READ_DTYPES = {
    f"torch.{name}": getattr(torch, name)
    for name in "bool uint8 int8 int16 int32 int64 float16 bfloat16 float32 float64".split()
}

# verl field -> (its shape, what it holds); B sequences, P prompt columns, R response columns
TENSOR_FIELDS = {
    "prompts": ("[B, P]", "prompt token ids, left-padded"),
    "responses": ("[B, R]", "response token ids, right-padded"),
    "attention_mask": ("[B, P + R]", "0/1 over cat(prompts, responses)"),
    "response_mask": ("[B, R]", "0/1, the scored response tokens (optional)"),
    "advantages": ("[B, R]", "the advantage of each response token"),
    "old_log_probs": ("[B, R]", "log pi_old per response token at the rollout temperature (optional)"),
    "ref_log_prob": ("[B, R]", "log pi_ref per response token (optional)"),
    "rollout_log_probs": ("[B, R]", "log mu per response token, the rollout engine's own (optional)"),
    "token_level_rewards": ("[B, R]", "rewards per response token (optional)"),
    "token_level_scores": ("[B, R]", "scores per response token (optional)"),
}
PER_TOKEN = {"advantages": "advantage", "old_log_probs": "old_logp", "ref_log_prob": "ref_logp",
             "rollout_log_probs": "sampler_logp"}  # fmt: skip
NEEDS = (
    "a verl PPO rollout batch needs prompts [B, P], responses [B, R], attention_mask [B, P + R] and advantages "
    "[B, R] (or token_level_rewards / token_level_scores [B, R] with the non-tensor uid, for GRPO advantages)"
)


# ---- the conversion (pure) ----------------------------------------------------------------------------------------
def _row(i: int) -> str:
    return f"row {i}"


def _found(tensors: Mapping) -> str:
    return f"found: {', '.join(sorted(tensors)) or '(none)'}"


def _field(
    tensors: Mapping, name: str, source: str, shape: tuple[int, ...] | None, kind: str
) -> torch.Tensor:
    """Field ``name`` as a CPU tensor, checked: 2-D (``shape`` when given), integer ids, 0/1 mask or floats."""
    x = tensors[name]
    dims, holds = TENSOR_FIELDS[name]
    if not isinstance(x, torch.Tensor):
        raise error(source, f"field '{name}' must be a tensor {dims} ({holds}); got {type(x).__name__}")
    x = x.detach().cpu()
    got = f"got shape {list(x.shape)} {str(x.dtype).removeprefix('torch.')}"
    if x.dim() != 2 or (shape is not None and tuple(x.shape) != shape):
        want = dims if shape is None else f"{dims} = {list(shape)}"
        raise error(source, f"field '{name}' must be a 2-D tensor {want} ({holds}); {got}")
    if kind == "ids" and (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool):
        raise error(source, f"field '{name}' must hold integer token ids; {got}")
    if kind == "mask":
        if x.is_floating_point() or x.is_complex():
            raise error(source, f"field '{name}' must be an integer or bool 0/1 tensor {dims}; {got}")
        bad = (~((x == 0) | (x == 1))).any(1).nonzero().flatten().tolist()
        if bad:
            raise error(source, f"field '{name}' must hold only 0 and 1; see {rows_text(bad, _row)}")
        x = x.bool()
    if kind == "float" and not x.is_floating_point():
        raise error(source, f"field '{name}' must be a float tensor {dims}; {got}")
    return x


def _check_layout(prompt_mask: torch.Tensor, response_mask: torch.Tensor, source: str) -> None:
    """The prompt part of attention_mask is left-padded (0s then 1s), the response part right-padded (1s then 0s)."""
    p = prompt_mask.shape[1]
    for part, mask, rising in (("prompt", prompt_mask, True), ("response", response_mask, False)):
        step = mask[:, 1:].int() - mask[:, :-1].int()
        bad = ((step < 0) if rising else (step > 0)).any(1).nonzero().flatten().tolist()
        if bad:
            cols = f"the first P = {p} columns" if rising else f"the last R = {mask.shape[1]} columns"
            side = "left-padded (0s then 1s)" if rising else "right-padded (1s then 0s)"
            raise error(
                source,
                f"field 'attention_mask': the {part} part ({cols}) must be {side}, as verl pads; row {bad[0]} "
                f"is {short_value(mask[bad[0]].int().tolist())}"
                + (f" (also {rows_text(bad[1:], _row)})" if len(bad) > 1 else ""),
            )


def _group_ids(values, n: int, source: str) -> list:
    """verl's uid (a numpy object array) as python str / int group ids."""
    if not isinstance(values, np.ndarray | list | tuple) or len(values) != n:
        size = len(values) if isinstance(values, np.ndarray | list | tuple) else type(values).__name__
        raise error(source, f"field 'uid' must hold one group id per sequence ({n}); got {size}")
    out = []
    for i, v in enumerate(values):
        v = v.item() if isinstance(v, np.generic) else v
        if not (isinstance(v, str) or (isinstance(v, numbers.Integral) and not isinstance(v, bool))):
            raise error(source, f"field 'uid' must hold str or int group ids; row {i} has {short_value(v)}")
        out.append(v)
    return out


def _temperature(meta_info: Mapping, source: str) -> float | None:
    t = meta_info.get("temperature") if isinstance(meta_info, Mapping) else None
    if t is None:
        return None
    if isinstance(t, bool) or not isinstance(t, numbers.Real) or not (math.isfinite(t) and t > 0):
        raise error(
            source, f"meta_info 'temperature' must be a number > 0 (the rollout temperature); got {t!r}"
        )
    return float(t)


def dataproto_table(tensors: Mapping, non_tensors: Mapping, meta_info: Mapping, source: str) -> Table:
    """The rollouts table of a verl rollout batch: ``tensors`` = ``DataProto.batch``, ``non_tensors`` =
    ``.non_tensor_batch``, ``meta_info`` = ``.meta_info``. One row per sequence b; with P = prompts.shape[1],
    a = attention_mask[b], K_b = {t < R : a[P + t] = 1} (the response tokens kept, in order):

        prompt_ids[b]     = [prompts[b, j]             for j < P if a[j] = 1]
        completion_ids[b] = [responses[b, t]           for t in K_b]
        advantage[b]      = [advantages[b, t]          for t in K_b]                 (float64, per token)
        old_logp[b]       = [old_log_probs[b, t]       for t in K_b]                 (when given)
        ref_logp[b]       = [ref_log_prob[b, t]        for t in K_b]                 (when given)
        sampler_logp[b]   = [rollout_log_probs[b, t]   for t in K_b]                 (when given)
        loss_mask[b]      = [response_mask[b, t]       for t in K_b]                 (when given)
        reward[b]         = sum_t token_level_rewards[b, t] (else token_level_scores) (when given; verl's GRPO score,
                                                                                      compute_grpo_outcome_advantage)
        group[b]          = uid[b]                                                   (when given)
        temperature[b]    = meta_info["temperature"]                                 (when given)

    The rows are unpadded, so every kept token is attended: verl's response_mask (the tokens its loss scores, 0 on
    e.g. tool output) is tokendyn's loss_mask, and no prompt_mask / completion_mask is needed. Pure: no I/O.
    Raises `RolloutsError` naming the field: a missing or non-2-D field, a shape other than [B, P], [B, R],
    [B, P + R], a mask that is not 0/1, an attention_mask whose prompt part is not left-padded or whose response
    part is not right-padded, a response_mask of 1 on padding, a uid of the wrong length."""
    for name in ("prompts", "responses", "attention_mask"):
        if name not in tensors:
            raise error(source, f"field '{name}' is missing; {NEEDS}; {_found(tensors)}")
    prompts = _field(tensors, "prompts", source, None, "ids")
    b, p = prompts.shape
    responses = _field(tensors, "responses", source, None, "ids")
    if responses.shape[0] != b:
        raise error(
            source,
            f"field 'responses' has {responses.shape[0]} rows but prompts has {b} (one row per sequence in both)",
        )
    r = responses.shape[1]
    attention = _field(tensors, "attention_mask", source, (b, p + r), "mask")
    prompt_mask, kept = attention[:, :p], attention[:, p:]
    _check_layout(prompt_mask, kept, source)

    rows = range(b)
    ids = prompts.long().numpy(), responses.long().numpy()
    pm, km = prompt_mask.numpy(), kept.numpy()
    cols: dict[str, pl.Series | list] = {
        "prompt_ids": pl.Series("prompt_ids", [ids[0][i][pm[i]] for i in rows]),
        "completion_ids": pl.Series("completion_ids", [ids[1][i][km[i]] for i in rows]),
    }
    for name, column in PER_TOKEN.items():
        if name in tensors:
            x = _field(tensors, name, source, (b, r), "float").to(torch.float64).numpy()
            cols[column] = pl.Series(column, [x[i][km[i]] for i in rows])
    if "response_mask" in tensors:
        scored = _field(tensors, "response_mask", source, (b, r), "mask")
        on_pad = (scored & ~kept).any(1).nonzero().flatten().tolist()
        if on_pad:
            raise error(
                source,
                f"field 'response_mask' is 1 where attention_mask is 0 (padding) in "
                f"{rows_text(on_pad, _row)}; verl scores only attended response tokens",
            )
        sm = scored.numpy()
        cols["loss_mask"] = pl.Series("loss_mask", [sm[i][km[i]] for i in rows])
    reward = next((n for n in ("token_level_rewards", "token_level_scores") if n in tensors), None)
    if reward is not None:
        x = _field(tensors, reward, source, (b, r), "float").to(torch.float64)
        cols["reward"] = pl.Series("reward", x.sum(1).numpy())
    if "uid" in non_tensors:
        cols["group"] = _group_ids(non_tensors["uid"], b, source)
    if "advantage" not in cols and not ("reward" in cols and "group" in cols):
        raise error(source, f"field 'advantages' is missing; {NEEDS}; {_found(tensors)}")
    temperature = _temperature(meta_info, source)
    if temperature is not None:
        cols["temperature"] = pl.Series("temperature", [temperature] * b, dtype=pl.Float64)
    return Table(source, b, cols)


USED = set(TENSOR_FIELDS) | {"uid"}


# ---- reading --------------------------------------------------------------------------------------------------------
def kind_of(path: Path) -> str | None:
    """The kind of verl batch at ``path``: "pickle" (a DataProto file, by its suffix), "tensordict" (a directory),
    or None (not a verl batch)."""
    if path.is_dir():
        return "tensordict"
    return "pickle" if path.suffix.lower() in PICKLE_SUFFIXES else None


def load_pickle(path: Path, allow_pickle: bool) -> tuple[Mapping, Mapping, Mapping]:
    """(batch, non_tensor_batch, meta_info) of a ``DataProto.save_to_disk`` file, unpickled by verl's own
    ``DataProto.load_from_disk`` only when ``allow_pickle``; else a `RolloutsError` naming the flag."""
    source = str(path)
    if not path.is_file():
        raise error(source, "no such file")
    if not allow_pickle:
        raise error(
            source,
            "is a pickle (verl's DataProto.save_to_disk), and unpickling runs code from the file: read it only if "
            "you trust it, with --allow_pickle (read_rollouts(..., allow_pickle=True)), or save data.batch with "
            "TensorDict.memmap(DIR), read without unpickling (docs/verl_dataproto.md)",
        )
    try:
        from verl import DataProto
    except ImportError as exc:
        raise error(source, f"reading a verl DataProto file needs verl installed ({exc})") from None
    try:
        data = DataProto.load_from_disk(str(path))
    except Exception as exc:  # pickle and torch.load raise many types for a file that is not a DataProto
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise error(source, f"cannot be read as a verl DataProto ({type(exc).__name__}: {first})") from None
    if not isinstance(data, DataProto):
        raise error(source, f"holds a pickled {type(data).__name__}, not a verl DataProto")
    batch = dict(data.batch.items()) if data.batch is not None else {}
    return batch, dict(data.non_tensor_batch or {}), dict(data.meta_info or {})


def _json(path: Path, source: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(source, f"{path.name} cannot be read as JSON ({type(exc).__name__}: {exc})") from None


def _raw_tensor(path: Path, name: str, entry: Mapping, source: str) -> torch.Tensor:
    """One tensor of a tensordict directory from meta.json's {dtype, shape} and the raw bytes of ``<name>.memmap``
    (what ``TensorDict.memmap`` writes, native byte order; no file for an empty tensor)."""
    if entry.get("type") is not None or entry.get("is_nested"):
        what = f"a nested entry ({entry['type']})" if entry.get("type") else "a nested (ragged) tensor"
        raise error(
            source, f"field '{name}' is {what} in meta.json; a padded tensor {TENSOR_FIELDS[name][0]} is read"
        )
    dtype, shape = READ_DTYPES.get(entry.get("dtype")), entry.get("shape")
    if dtype is None or not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)):
        raise error(
            source,
            f"field '{name}': meta.json gives dtype {entry.get('dtype')!r}, shape {shape!r}; expected a shape "
            f"list and one of {', '.join(READ_DTYPES)}",
        )
    file = path / f"{name}.memmap"
    numel = math.prod(shape)
    size = numel * torch.empty((), dtype=dtype).element_size()
    if numel == 0 and not file.exists():
        return torch.empty(shape, dtype=dtype)
    got = file.stat().st_size if file.is_file() else None
    if got != size:
        have = "no such file" if got is None else f"{got} bytes"
        raise error(source, f"field '{name}': {file.name} must hold {size} bytes ({shape} {dtype}); {have}")
    raw = torch.from_numpy(np.fromfile(file, dtype=np.uint8))
    return raw.view(dtype).reshape(shape)


def load_tensordict_dir(path: Path) -> tuple[Mapping, Mapping, Mapping, list[str]]:
    """(batch, non_tensor_batch, meta_info, names not read) of a tensordict directory, from JSON and raw bytes
    only: meta.json must describe a plain TensorDict with one batch dimension; only verl's fields (`TENSOR_FIELDS`)
    are read; DIR/non_tensor.json, when present, gives non_tensor_batch (lists) and meta_info."""
    source = str(path)
    if not (path / "meta.json").is_file():
        raise error(
            source,
            "is a directory without meta.json; a directory is read as a tensordict directory "
            "(TensorDict.memmap(DIR) of a verl DataProto.batch)",
        )
    meta = _json(path / "meta.json", source)
    if not isinstance(meta, dict) or meta.get("_type") != TENSORDICT_TYPE:
        found = meta.get("_type") if isinstance(meta, dict) else type(meta).__name__
        raise error(
            source,
            f"meta.json must describe a plain TensorDict (_type {TENSORDICT_TYPE!r}); got {found!r}: other types are "
            "unpickled by tensordict's loader and are not read",
        )
    shape = meta.get("shape")
    if not (isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int)):
        raise error(
            source, f"meta.json: the TensorDict must have one batch dimension [B]; its shape is {shape!r}"
        )
    entries = {k: v for k, v in meta.items() if isinstance(v, dict)}
    tensors = {k: _raw_tensor(path, k, v, source) for k, v in entries.items() if k in TENSOR_FIELDS}
    non_tensors, meta_info = {}, {}
    if (path / SIDECAR).is_file():
        side = _json(path / SIDECAR, source)
        ok = isinstance(side, dict) and set(side) <= {"non_tensor_batch", "meta_info"}
        ok = ok and all(isinstance(side.get(k, {}), dict) for k in ("non_tensor_batch", "meta_info"))
        if not ok or not all(isinstance(v, list) for v in side.get("non_tensor_batch", {}).values()):
            raise error(
                source,
                f'{SIDECAR} must be {{"non_tensor_batch": {{"uid": [...]}}, "meta_info": {{"temperature": T}}}} '
                f"(both optional, lists per sequence); got {short_value(side)}",
            )
        non_tensors = {k: np.asarray(v, dtype=object) for k, v in side.get("non_tensor_batch", {}).items()}
        meta_info = side.get("meta_info", {})
    return tensors, non_tensors, meta_info, sorted(set(entries) - set(TENSOR_FIELDS))


def _validated(table: Table, unused: set[str]) -> dict:
    """`validate_table` of the converted table; verl fields that were not used are reported as ignored."""
    fields = validate_table(table)
    fields["ignored"] = tuple(sorted(set(fields["ignored"]) | unused))
    return fields


def read_verl(path: Path, allow_pickle: bool = False) -> dict:
    """The validated `Rollouts` fields of a verl batch on disk: a tensordict directory (no unpickling) or a
    DataProto file (unpickled only with ``allow_pickle``). Raises `RolloutsError` naming the field."""
    if kind_of(path) == "tensordict":
        tensors, non_tensors, meta_info, unread = load_tensordict_dir(path)
    else:
        (tensors, non_tensors, meta_info), unread = load_pickle(path, allow_pickle), []
    table = dataproto_table(tensors, non_tensors, meta_info, str(path))
    return _validated(table, (set(tensors) | set(non_tensors) | set(unread)) - USED)


def from_dataproto(data, source: str = "(DataProto)") -> dict:
    """The validated `Rollouts` fields of an in-memory verl DataProto (no file, no verl import)."""
    tensors = dict(data.batch.items()) if data.batch is not None else {}
    non_tensors, meta_info = dict(data.non_tensor_batch or {}), dict(data.meta_info or {})
    table = dataproto_table(tensors, non_tensors, meta_info, source)
    return _validated(table, (set(tensors) | set(non_tensors)) - USED)


def is_dataproto(source) -> bool:
    """Whether ``source`` looks like a verl DataProto (its three attributes), checked without importing verl."""
    return all(hasattr(source, a) for a in ("batch", "non_tensor_batch", "meta_info"))
