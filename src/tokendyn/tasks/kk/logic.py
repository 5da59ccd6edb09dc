"""Knights-and-Knaves statements: representation, evaluation and the brute-force solver.

A statement is a nested tuple, exactly as the official generator writes it:
``('telling-truth', j)`` (person j is a knight), ``('lying', j)`` (person j is a knave),
``('not', s)``, ``('and', s1, s2)``, ``('or', s1, s2)``, ``('->', s1, s2)``, ``('<=>', s1, s2)``.
A problem is a tuple of N statements; statement i is said by person i. An assignment is a
tuple of N bools (True = knight).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

Statement = tuple
Problem = tuple[Statement, ...]


def evaluate(statement: Statement, assignment: Sequence[bool]) -> bool:
    """Truth value of ``statement`` under ``assignment`` (material implication for ``->``)."""
    op = statement[0]
    if op == "telling-truth":
        return bool(assignment[statement[1]])
    if op == "lying":
        return not assignment[statement[1]]
    if op == "not":
        return not evaluate(statement[1], assignment)
    if op == "and":
        return all(evaluate(s, assignment) for s in statement[1:])
    if op == "or":
        return any(evaluate(s, assignment) for s in statement[1:])
    if op == "->":
        return (not evaluate(statement[1], assignment)) or evaluate(statement[2], assignment)
    if op == "<=>":
        return evaluate(statement[1], assignment) == evaluate(statement[2], assignment)
    raise ValueError(f"unknown operator {op!r} in statement {statement!r}")


def is_consistent(problem: Problem, assignment: Sequence[bool]) -> bool:
    """A knight's statement is true and a knave's is false: a_i == eval(S_i, a) for every i."""
    return all(bool(assignment[i]) == evaluate(s, assignment) for i, s in enumerate(problem))


def solutions(problem: Problem) -> list[tuple[bool, ...]]:
    """All consistent assignments, by brute force over the 2^N candidates."""
    n = len(problem)
    return [a for a in itertools.product((True, False), repeat=n) if is_consistent(problem, a)]


def mentioned_people(statement: Statement) -> list[int]:
    """People named in ``statement``, in order of first mention."""
    if statement[0] in ("telling-truth", "lying"):
        return [statement[1]]
    seen: list[int] = []
    for child in statement[1:]:
        for p in mentioned_people(child):
            if p not in seen:
                seen.append(p)
    return seen
