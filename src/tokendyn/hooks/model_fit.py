"""What a model can take, read from its config before any weights load, and how it is fed a padded batch.

`model_limits` and `check_fits`: every token id below the vocabulary, every row within the positions (errors name
the row, the column and the limit). `positions_from_masks`: position ids from the attention masks, as the sampler
built them, for every forward of a model (the offline probe's default).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

from torch import nn

from tokendyn.hooks.rollouts import Rollouts, RolloutsError


def model_limits(config, embeddings: int | None = None) -> tuple[int, int | None]:
    """(vocabulary size, positions) of a model from its config (no weights needed): the ids must be < vocabulary
    (or < the embedding rows, when known and fewer) and a row's attended tokens <= positions
    (``max_position_embeddings`` / ``n_positions``; None when the config has no such limit)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(text.vocab_size)
    if embeddings is not None:
        vocab = min(vocab, int(embeddings))
    positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    return vocab, None if positions is None else int(positions)


def check_fits(rollouts: Rollouts, vocab: int, positions: int | None) -> None:
    """Every token id in [0, vocab) and every row (its attended prompt + completion tokens) within the model's
    positions; the error names the row, the column and the limit."""
    for name in ("prompt_ids", "completion_ids"):
        for i, ids in enumerate(getattr(rollouts, name)):
            if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                raise RolloutsError(
                    f"rollouts {rollouts.source}: row {i}: {name} holds ids outside the model's vocabulary "
                    f"[0, {vocab}) (min {int(ids.min())}, max {int(ids.max())}); wrong model or tokenizer?"
                )
    if positions is None:
        return
    for i in range(rollouts.n):
        p = rollouts.prompt_mask[i].sum() if rollouts.prompt_mask is not None else rollouts.prompt_ids[i].size
        c = (
            rollouts.completion_mask[i].sum()
            if rollouts.completion_mask is not None
            else rollouts.completion_ids[i].size
        )
        if p + c > positions:
            raise RolloutsError(
                f"rollouts {rollouts.source}: row {i}: prompt + completion is {int(p + c)} tokens ({int(p)} + "
                f"{int(c)}) but the model has {positions} positions (max_position_embeddings); shorten the row "
                "or use a model with a longer context"
            )


def _forward_accepts(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


POSITIONS = ("mask", "model")


@contextlib.contextmanager
def positions_from_masks(model: nn.Module, mode: str = "mask") -> Iterator[None]:
    """mode "mask": every forward of ``model`` that is given an attention mask and no position ids gets them from
    the mask, as `generate` (and verl, OpenRLHF) build them for left-padded rows: position = the number of attended
    tokens before it, padding at 1. Without this, models with absolute position embeddings (GPT-2) read a
    left-padded row at shifted positions (rotary models are nearly, not exactly, invariant to the shift).
    mode "model": the model's own default, unchanged (0..S-1 for most families; what TRL's training forward
    uses, so a batch dumped from TRL training is reproduced exactly)."""
    if mode not in POSITIONS:
        raise ValueError(f"positions: must be one of {', '.join(POSITIONS)}, got {mode!r}")
    if mode == "model" or not _forward_accepts(model, "position_ids"):
        yield
        return

    def add_positions(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if kwargs.get("position_ids") is not None or mask is None or mask.dim() != 2:
            return None
        positions = mask.long().cumsum(-1) - 1
        positions = positions.masked_fill(mask == 0, 1)
        return args, {**kwargs, "position_ids": positions}

    handle = model.register_forward_pre_hook(add_positions, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


_ABSOLUTE = (
    "wpe",
    "embed_positions",
    "position_embeddings",
)  # GPT-2, OPT, BERT-style learned position tables


def absolute_positions(model: nn.Module) -> bool:
    """True when the model looks positions up in a learned table (GPT-2's ``wpe``, OPT's ``embed_positions``): a
    position past its end is an index error, not merely an untrained context as with rotary embeddings."""
    return any(
        isinstance(m, nn.Embedding) and name.rsplit(".", 1)[-1] in _ABSOLUTE
        for name, m in model.named_modules()
    )
