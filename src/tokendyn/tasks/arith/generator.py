"""Addition problems a + b: the difficulty is the number of digits of both operands, the streams are seeded.

Operands of difficulty d are the integers with d digits: 0..9 for d = 1 (zero counts as one digit), else
10^(d-1)..10^d - 1. A problem's *key* is its unordered pair (min(a, b), max(a, b)): a + b and b + a have one
answer, so a split that separates problems separates keys. Each difficulty has one fixed held-out split
(`heldout`), drawn from seed `HELDOUT_SEED`; training problems (`train_problems`) never have a held-out key.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

MIN_DIGITS, MAX_DIGITS = 1, 3
HELDOUT_SEED = 1234
# problems in the held-out split of each difficulty: 1 digit has only 55 keys, 30 held out leaves 25 to train on
HELDOUT_SIZE = {1: 30, 2: 200, 3: 200}


@dataclass(frozen=True)
class Problem:
    """One problem ``a + b`` of difficulty ``digits``; ``answer`` = a + b."""

    a: int
    b: int
    digits: int

    @property
    def answer(self) -> int:
        return self.a + self.b

    @property
    def key(self) -> tuple[int, int]:
        """The unordered pair (min(a, b), max(a, b)): what the splits keep apart."""
        return (min(self.a, self.b), max(self.a, self.b))


def check_digits(d) -> int:
    """``d`` as an int, or a ValueError naming ``digits`` and the range MIN_DIGITS..MAX_DIGITS."""
    if not isinstance(d, int | np.integer) or isinstance(d, bool) or not MIN_DIGITS <= d <= MAX_DIGITS:
        raise ValueError(f"digits: must be an integer in {MIN_DIGITS}..{MAX_DIGITS}, got {d!r}")
    return int(d)


def operand_range(digits: int) -> tuple[int, int]:
    """(lowest, highest) operand of difficulty ``digits``, both included: (0, 9) for 1, (10^(d-1), 10^d - 1) else."""
    d = check_digits(digits)
    return (0 if d == 1 else 10 ** (d - 1), 10**d - 1)


def _draws(digits: int, seed: int):
    """An endless stream of uniform ordered pairs (a, b) of difficulty ``digits``: one numpy Generator seeded with
    [seed, digits], two ``integers`` calls per pair (a first)."""
    lo, hi = operand_range(digits)
    rng = np.random.default_rng([seed, digits])
    while True:
        yield int(rng.integers(lo, hi + 1)), int(rng.integers(lo, hi + 1))


@lru_cache(maxsize=8)
def heldout(digits: int) -> tuple[Problem, ...]:
    """The fixed held-out split of difficulty ``digits``: the first HELDOUT_SIZE[digits] draws of seed
    HELDOUT_SEED whose key is new (one orientation per key, in draw order)."""
    d = check_digits(digits)
    seen: set[tuple[int, int]] = set()
    out: list[Problem] = []
    for a, b in _draws(d, HELDOUT_SEED):
        p = Problem(a, b, d)
        if p.key not in seen:
            seen.add(p.key)
            out.append(p)
            if len(out) == HELDOUT_SIZE[d]:
                return tuple(out)
    raise AssertionError("unreachable: the draw stream is endless")


@lru_cache(maxsize=8)
def heldout_keys(digits: int) -> frozenset[tuple[int, int]]:
    """The keys of `heldout` (digits)."""
    return frozenset(p.key for p in heldout(digits))


def train_problems(digits: int, seed: int, count: int) -> list[Problem]:
    """``count`` training problems of difficulty ``digits``: the draws of ``seed`` in order, every draw whose key
    is held out skipped; draws are independent, so a problem may repeat (1 digit has only 25 training keys)."""
    d = check_digits(digits)
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        raise ValueError(f"count: must be an integer > 0, got {count!r}")
    banned = heldout_keys(d)
    out: list[Problem] = []
    for a, b in _draws(d, seed):
        p = Problem(a, b, d)
        if p.key not in banned:
            out.append(p)
            if len(out) == count:
                return out
    raise AssertionError("unreachable: the draw stream is endless")
