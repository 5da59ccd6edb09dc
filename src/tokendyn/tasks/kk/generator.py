"""The official K&K problem sampler (Xie et al. 2024, ``lib_kk.py``), draw for draw.

Every random choice is one call on a numpy ``Generator``; the order of the calls is the
official one (``docs/kk.md`` §1.3-1.4), so seed 1234 regenerates the released
data byte for byte. Problem i of a stream is the i-th accepted candidate (counting from 0).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .logic import Problem, Statement, solutions

MIN_PEOPLE, MAX_PEOPLE = 2, 8
DEPTH, WIDTH = 2, 2
MAX_RETRIES = 1000  # per problem, as the official sampler


def check_people(n: int) -> int:
    if not isinstance(n, int | np.integer) or isinstance(n, bool) or not MIN_PEOPLE <= n <= MAX_PEOPLE:
        raise ValueError(f"people: must be an integer in {MIN_PEOPLE}..{MAX_PEOPLE}, got {n!r}")
    return int(n)


def _atom(rng: np.random.Generator, speaker: int, n: int) -> Statement:
    """An atom; "I am a knave" (('lying', speaker)) is rejected and redrawn."""
    while True:
        kind = ("telling-truth", "lying")[int(rng.integers(0, 2))]
        who = int(rng.integers(0, n))
        if not (kind == "lying" and who == speaker):
            return (kind, who)


def _statement(rng: np.random.Generator, speaker: int, n: int, depth: int) -> Statement:
    """One statement; the shape draw d ~ U(6) happens even at depth 1 (it matters for replay)."""
    d = int(rng.integers(0, 6))
    if depth == 1 or d == 0:
        return _atom(rng, speaker, n)
    if d == 1:
        return ("not", _statement(rng, speaker, n, depth - 1))
    if d in (2, 3):
        op = "and" if d == 2 else "or"
        k = int(rng.integers(2, WIDTH + 1))  # always 2, but the call is made as in the original
    else:
        op = "->" if d == 4 else "<=>"
        k = 2
    children: list[Statement] = []
    while len(children) < k:
        child = _statement(rng, speaker, n, depth - 1)
        if child not in children:
            children.append(child)
    return (op, *children)


def sample_problem(rng: np.random.Generator, n: int) -> Problem:
    """One candidate problem: a statement per speaker, in speaking order."""
    return tuple(_statement(rng, p, n, DEPTH) for p in range(n))


def problem_stream(n: int, seed: int = 1234) -> Iterator[tuple[Problem, tuple[bool, ...]]]:
    """Valid problems of one stream, in order: (statements, unique solution).

    A candidate is accepted when it has exactly one solution and is not identical to an
    already accepted problem. The stream ends, as the original, after 1000 failed retries.
    """
    n = check_people(n)
    rng = np.random.default_rng(seed)
    accepted: set[Problem] = set()
    while True:
        for _ in range(MAX_RETRIES):
            problem = sample_problem(rng, n)
            sols = solutions(problem)
            if len(sols) == 1 and problem not in accepted:
                accepted.add(problem)
                yield problem, sols[0]
                break
        else:
            return


def generate_problems(
    n: int, seed: int, start: int, count: int
) -> list[tuple[int, Problem, tuple[bool, ...]]]:
    """Stream positions start..start+count-1 as (index, statements, solution)."""
    if start < 0:
        raise ValueError(f"start: must be >= 0, got {start}")
    if count <= 0:
        raise ValueError(f"count: must be > 0, got {count}")
    out = []
    for i, (problem, sol) in enumerate(problem_stream(n, seed)):
        if i >= start + count:
            break
        if i >= start:
            out.append((i, problem, sol))
    if len(out) < count:
        raise ValueError(
            f"count: the {n}-person stream of seed {seed} ends after {start + len(out)} distinct puzzles; "
            f"asked for positions {start}..{start + count - 1}"
        )
    return out
