"""Rollouts files, the input of `tokendyn probe`: one completion per row, read, validated and padded as TRL does.

A parquet or jsonl file (other columns are ignored):

    tokens      prompt_ids + completion_ids   lists of token ids (the sampler's own ids: preferred), or
                prompt + completion           text; prompt a string or a list of chat messages {role, content}
                                              (rendered with the tokenizer's chat template, as TRL does)
    advantage   advantage                     a number per completion, or a list of one number per completion token
                reward + group                a number and a group id (int or str) per completion; advantages are
                                              computed per group as `grpo_advantages`: (r - mean) / (std + 1e-6),
                                              unbiased std; every group must have the same size
    optional    old_logp                      list, log pi_old per completion token at the sampling temperature
                                              (absent: on-policy, pi_old = the model's own pi)
                ref_logp                      list, log pi_ref per completion token (needed only for beta > 0)
                sampler_logp                  list, log mu per completion token: the sampling engine's own log-probs
                                              (vLLM's, verl's rollout_log_probs) at the sampling temperature; the
                                              probe then records the `sampler` kind beside the trainer's pi_old
                prompt_mask, completion_mask  lists of 0/1, as long as prompt_ids / completion_ids: the attention mask
                                              of a padded row (prompt left-padded, completion right-padded)
                loss_mask                     list of 0/1 per completion token: the scored tokens (default: the
                                              completion_mask); every scored token must be attended
                temperature                   number, the same in every row (else the --temperature flag, default 1)

A verl rollout batch is read as such a table (`tokendyn.hooks.rollouts_verl`, docs/verl_dataproto.md): a tensordict
directory (``data.batch.memmap(DIR)``, read without unpickling), a ``DataProto.save_to_disk`` file (.dp, .pkl,
.pickle: a pickle, read only with ``allow_pickle``) or an in-memory DataProto.

Everything is checked by `read_rollouts` before any model is loaded; errors name the column, the row and what
is accepted. Per-token columns of a text file are checked against the tokenized completion by `Rollouts.encode`.
`dump_rollouts` writes a TRL training micro-batch as such a file, padding kept, so `Rollouts.batch` rebuilds the
same tensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import polars as pl
import torch

from tokendyn.hooks.rollouts_check import validate_table  # noqa: F401  (re-exported)
from tokendyn.hooks.rollouts_read import (  # noqa: F401  (re-exported)
    ACCEPTS,
    COLUMNS,
    PER_TOKEN,
    SUFFIXES,
    RolloutsError,
    Table,
    error,
    read_table,
    rows_table,
)
from tokendyn.hooks.rollouts_verl import PICKLE_SUFFIXES, from_dataproto, is_dataproto, kind_of, read_verl


# ---- the validated rollouts ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rollouts:
    """Validated rollouts, one entry per completion (numpy per row). ``prompt_ids``/``completion_ids`` are set in
    token mode (or after `encode`); ``prompts``/``completions`` in text mode. Masks are None when not given
    (unpadded rows). ``advantages``: (n,) or a list of per-token arrays. ``temperature``: the file's, or None."""

    source: str
    n: int
    prompt_ids: list[np.ndarray] | None
    completion_ids: list[np.ndarray] | None
    prompts: list | None
    completions: list[str] | None
    advantages: np.ndarray | list[np.ndarray]
    advantage_source: str  # "advantage" | "grpo(reward, group)"
    old_logp: list[np.ndarray] | None = None
    ref_logp: list[np.ndarray] | None = None
    sampler_logp: list[np.ndarray] | None = None
    prompt_mask: list[np.ndarray] | None = None
    completion_mask: list[np.ndarray] | None = None
    loss_mask: list[np.ndarray] | None = None
    temperature: float | None = None
    rewards: np.ndarray | None = None
    groups: list | None = None
    ignored: tuple[str, ...] = ()

    @property
    def mode(self) -> str:
        return "ids" if self.completion_ids is not None else "text"

    @property
    def per_token_advantages(self) -> bool:
        return not isinstance(self.advantages, np.ndarray)

    def scored(self, i: int) -> np.ndarray:
        """The scored-token mask of row i (token mode)."""
        if self.loss_mask is not None:
            return self.loss_mask[i]
        if self.completion_mask is not None:
            return self.completion_mask[i]
        return np.ones(len(self.completion_ids[i]), dtype=bool)

    def n_scored(self) -> int:
        return int(sum(int(self.scored(i).sum()) for i in range(self.n)))

    def encode(self, tokenizer) -> Rollouts:
        """Token mode: self. Text mode: prompts tokenized as TRL does (``tokenizer(text=prompt)``, or the chat
        template with the generation prompt for message lists), completions with ``add_special_tokens=False``;
        per-token columns must match the tokenized completion's length."""
        if self.mode == "ids":
            return self
        if tokenizer is None:
            raise error(self.source, "text prompts and completions need a tokenizer")
        where = lambda i: f"row {i}"  # noqa: E731
        prompt_ids, completion_ids = [], []
        for i, (p, c) in enumerate(zip(self.prompts, self.completions, strict=True)):
            if isinstance(p, str):
                ids = tokenizer(text=p)["input_ids"]
            else:
                ids = tokenizer.apply_chat_template(
                    p, add_generation_prompt=True, tokenize=True, return_dict=True
                )
                ids = ids["input_ids"]
            comp = tokenizer(text=c, add_special_tokens=False)["input_ids"]
            if not ids:
                raise error(self.source, f"{where(i)}: the prompt tokenizes to no tokens")
            if not comp:
                raise error(self.source, f"{where(i)}: the completion tokenizes to no tokens")
            prompt_ids.append(np.asarray(ids, dtype=np.int64))
            completion_ids.append(np.asarray(comp, dtype=np.int64))
        for name, values in self._per_token().items():
            for i, v in enumerate(values):
                if len(v) != len(completion_ids[i]):
                    raise error(
                        self.source,
                        f"{where(i)}: {name} has {len(v)} entries but the completion tokenizes to "
                        f"{len(completion_ids[i])} tokens; per-token columns need the sampler's token ids "
                        "(prompt_ids + completion_ids)",
                    )
        return replace(self, prompt_ids=prompt_ids, completion_ids=completion_ids)

    def _per_token(self) -> dict[str, list[np.ndarray]]:
        out = {name: getattr(self, name) for name in PER_TOKEN if getattr(self, name) is not None}
        if self.per_token_advantages:
            out["advantage"] = self.advantages
        return out

    def batch(self, rows: Sequence[int], pad_id: int = 0, device=None) -> dict[str, torch.Tensor]:
        """The rows as TRL pads them: prompts left-padded, completions right-padded with ``pad_id`` (mask 0); rows
        keep the padding they were given. Keys as TRL's loss inputs: prompt_ids, prompt_mask, completion_ids,
        completion_mask (attention), loss_mask (scored), advantages ((B,) or (B, C), float64), and
        old_per_token_logps / ref_per_token_logps when known (0 on padding). Needs token ids (`encode`)."""
        if self.completion_ids is None:
            raise ValueError("rollouts: batch() needs token ids; call encode(tokenizer) first")
        rows = [int(r) for r in rows]
        p_len = max(len(self.prompt_ids[r]) for r in rows)
        c_len = max(len(self.completion_ids[r]) for r in rows)

        def left(v, fill):
            return np.concatenate([np.full(p_len - len(v), fill, dtype=np.int64), v.astype(np.int64)])

        def right(v, fill, dtype=np.int64):
            return np.concatenate([v.astype(dtype), np.full(c_len - len(v), fill, dtype=dtype)])

        def stack(arrays, dtype=torch.long):
            return torch.as_tensor(np.stack(arrays), dtype=dtype, device=device)

        def given(mask, ids, r):
            return mask[r] if mask is not None else np.ones(len(ids[r]), dtype=np.int64)

        def per_token(values):
            return stack([right(values[r], 0.0, np.float64) for r in rows], torch.float64)

        out = {
            "prompt_ids": stack([left(self.prompt_ids[r], pad_id) for r in rows]),
            "prompt_mask": stack([left(given(self.prompt_mask, self.prompt_ids, r), 0) for r in rows]),
            "completion_ids": stack([right(self.completion_ids[r], pad_id) for r in rows]),
            "completion_mask": stack(
                [right(given(self.completion_mask, self.completion_ids, r), 0) for r in rows]
            ),
            "loss_mask": stack([right(self.scored(r), 0) for r in rows]),
        }
        if self.per_token_advantages:
            out["advantages"] = per_token(self.advantages)
        else:
            out["advantages"] = torch.as_tensor(self.advantages[rows], dtype=torch.float64, device=device)
        if self.old_logp is not None:
            out["old_per_token_logps"] = per_token(self.old_logp)
        if self.ref_logp is not None:
            out["ref_per_token_logps"] = per_token(self.ref_logp)
        if self.sampler_logp is not None:
            out["sampling_per_token_logps"] = per_token(self.sampler_logp)
        return out


def read_rollouts(
    source: str | os.PathLike | pl.DataFrame | Sequence[dict] | Rollouts, *, allow_pickle: bool = False
) -> Rollouts:
    """Read and validate a rollouts file (.parquet or .jsonl), a polars DataFrame, a list of row dicts, or a verl
    batch: a tensordict directory, a DataProto file (a pickle: unpickled only with ``allow_pickle=True``, as it runs
    code from the file) or a DataProto object. Raises `RolloutsError` naming the column (or verl field), the row and
    the accepted forms; no model or tokenizer is needed."""
    if isinstance(source, Rollouts):
        return source
    if is_dataproto(source):
        return Rollouts(**from_dataproto(source))
    if isinstance(source, pl.DataFrame):
        return Rollouts(
            **validate_table(Table("(DataFrame)", source.height, {c: source[c] for c in source.columns}))
        )
    if isinstance(source, list | tuple):
        if not all(isinstance(r, dict) for r in source):
            raise RolloutsError("rollouts: a list of rollouts must hold one dict per completion")
        return Rollouts(**validate_table(rows_table(list(source), "(rows)")))
    path = Path(source)
    if kind_of(path) is not None:
        return Rollouts(**read_verl(path, allow_pickle=allow_pickle))
    if not path.suffix and not path.exists():
        raise error(str(path), "no such file or directory")
    if path.suffix.lower() not in SUFFIXES:
        raise error(
            str(path),
            f"unknown file type {path.suffix or '(no suffix)'!r}; use .parquet or .jsonl, a verl DataProto file "
            f"({', '.join(PICKLE_SUFFIXES)}; a pickle, read with --allow_pickle) or a tensordict directory",
        )
    return Rollouts(**validate_table(read_table(path)))


# ---- writing a TRL micro-batch ------------------------------------------------------------------------------------
def _rows(x: torch.Tensor) -> list:
    return x.detach().cpu().tolist()


def dump_rollouts(inputs: dict, path: str | os.PathLike, temperature: float) -> Path:
    """Write a TRL GRPO loss micro-batch (prompt_ids, prompt_mask, completion_ids, completion_mask, advantages,
    optional old_per_token_logps, ref_per_token_logps, tool_mask) as a rollouts file (.parquet or .jsonl), padding
    kept as is: `read_rollouts(path).batch(range(B))` rebuilds the same ids, masks and values. ``tool_mask``
    becomes loss_mask = completion_mask * tool_mask (the tokens TRL scores). Written atomically."""
    from tokendyn.common import atomic_write

    path = Path(path)
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"dump_rollouts: unknown file type {path.suffix!r}; use .parquet or .jsonl")
    if not float(temperature) > 0:
        raise ValueError(f"dump_rollouts: temperature must be > 0, got {temperature!r}")
    need = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
    missing = [k for k in need if inputs.get(k) is None]
    if missing:
        raise ValueError(f"dump_rollouts: the batch lacks {missing}; expected TRL's loss inputs")
    b = int(inputs["completion_ids"].shape[0])
    adv = inputs["advantages"].detach().to(torch.float64)
    cols: dict[str, list] = {
        "prompt_ids": _rows(inputs["prompt_ids"]),
        "prompt_mask": _rows(inputs["prompt_mask"].long()),
        "completion_ids": _rows(inputs["completion_ids"]),
        "completion_mask": _rows(inputs["completion_mask"].long()),
        "advantage": _rows(adv),
    }
    if inputs.get("tool_mask") is not None:
        cols["loss_mask"] = _rows((inputs["completion_mask"] * inputs["tool_mask"]).long())
    for key, name in (("old_per_token_logps", "old_logp"), ("ref_per_token_logps", "ref_logp"),
                      ("sampling_per_token_logps", "sampler_logp")):  # fmt: skip
        if inputs.get(key) is not None:
            cols[name] = _rows(inputs[key].detach().to(torch.float64))
    cols["temperature"] = [float(temperature)] * b
    if kind == "parquet":
        df = pl.DataFrame(cols)
        return atomic_write(path, lambda tmp: df.write_parquet(tmp))

    def write_jsonl(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            for i in range(b):
                f.write(json.dumps({k: v[i] for k, v in cols.items()}) + "\n")

    return atomic_write(path, write_jsonl)
