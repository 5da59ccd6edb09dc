"""Arithmetic data sets for TRL: rows of one or several difficulties, the training stream or the held-out split."""

from __future__ import annotations

from collections.abc import Iterable

from .generator import Problem, check_digits, heldout, train_problems
from .prompts import question, render_prompt

SPLITS = ("train", "heldout")


def trl_rows(problems: Iterable[Problem], tokenizer=None) -> list[dict]:
    """One row per problem: ``prompt`` (the rendered chat prompt, `render_prompt`), ``answer`` (a + b, what the
    reward reads), ``a``, ``b``, ``digits`` and ``question`` (the user message)."""
    return [
        {
            "prompt": render_prompt(p.a, p.b, tokenizer),
            "answer": p.answer,
            "a": p.a,
            "b": p.b,
            "digits": p.digits,
            "question": question(p.a, p.b),
        }
        for p in problems
    ]


def arith_problems(
    digits: list[int], split: str = "train", seed: int = 7, count: int | None = None
) -> list[Problem]:
    """Problems of each difficulty in ``digits``, grouped by difficulty: ``split="train"``: ``count`` (default
    1000) of `train_problems` (digits, seed); ``"heldout"``: the first ``count`` (default all) of `heldout`."""
    if split not in SPLITS:
        raise ValueError(f"split: must be one of {list(SPLITS)}, got {split!r}")
    if not digits:
        raise ValueError("digits: give at least one difficulty")
    out: list[Problem] = []
    for d in digits:
        d = check_digits(d)
        if split == "train":
            out.extend(train_problems(d, seed, 1000 if count is None else count))
        else:
            out.extend(heldout(d)[:count])
    return out


def arith_dataset(
    digits: list[int], split: str = "train", seed: int = 7, count: int | None = None, tokenizer=None
):
    """A ``datasets.Dataset`` of `trl_rows` over `arith_problems` (digits, split, seed, count) (the trainer
    shuffles)."""
    from datasets import Dataset

    return Dataset.from_list(trl_rows(arith_problems(digits, split, seed, count), tokenizer))
