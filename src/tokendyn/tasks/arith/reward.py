"""The exact scorer of a + b: reward 1.0 when the first integer of the completion equals a + b, else 0.0.

What is parsed (`first_integer`): the first match of ``-?[0-9]+(\\.[0-9]+)?`` in the completion text, i.e. the first
run of ASCII digits, with a ``-`` right before it taken as its sign and a ``.`` followed by digits as a fractional
part. A match with a fractional part is not an integer (``"8.5"``, ``"8.0"``: no integer, reward 0); a ``.`` not
followed by a digit ends the number (``"8."`` is 8). Nothing else is read: ``"The answer is 8"`` is 8,
``"3 + 5 = 8"`` is 3 (the prompt asks for the number only), ``"08"`` is 8, ``"1,998"`` is 1 (no thousands
separators), ``"eight"`` and ``""`` have none (reward 0).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]+)?")


def first_integer(text: str) -> int | None:
    """The integer value of the first match of ``-?[0-9]+(\\.[0-9]+)?`` in ``text``; None when there is no match
    or the match has a fractional part."""
    m = _NUMBER.search(text)
    if m is None or m.group(1) is not None:
        return None
    return int(m.group(0))


def score(completion: str, answer: int) -> float:
    """1.0 if ``first_integer(completion) == answer``, else 0.0."""
    return 1.0 if first_integer(completion) == int(answer) else 0.0


def arith_reward(completions: Sequence[str], answer: Sequence[int], **_) -> list[float]:
    """TRL reward function: `score` of each completion against the dataset's ``answer`` column (a + b)."""
    return [score(c, a) for c, a in zip(completions, answer, strict=True)]


def arith_accuracy(completions: Sequence[str], answer: Sequence[int], **_) -> list[float]:
    """The same values as `arith_reward` (its reward is the accuracy), logged under its own name with weight 0."""
    return arith_reward(completions, answer)
