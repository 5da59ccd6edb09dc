"""Natural-language rendering of K&K problems: the official formatter (``docs/kk.md`` §1.5-1.7).

Problem i of a stream of seed S is rendered with its own stream ``default_rng(S + i)``:
N names drawn without replacement from the 51 common names, then one saying template per
person, in person order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .logic import Problem, Statement, evaluate, mentioned_people

COMMON_NAMES = (
    "Emma Liam Olivia Noah Ava Ethan Sophia Mason Isabella William Mia James Charlotte Benjamin Amelia "
    "Lucas Harper Henry Evelyn Alexander Abigail Michael Emily Daniel Elizabeth Jacob Sofia Logan Avery "
    "Jackson Ella Sebastian Scarlett Jack Grace Aiden Chloe Owen Victoria Samuel Riley Matthew Aria "
    "Joseph Lily Luke Aurora David Zoey Oliver Penelope"
).split()

TEMPLATES = (
    "{n} said that {c}.",
    "{n} told you that {c}.",
    '{n} said, "{c}."',
    '{n} stated, "{c}".',
    'According to {n}, "{c}".',
    'In {n}\'s words: "{c}".',
    '{n} remarked, "{c}".',
    '"{c}," {n} declared.',
    '{n} was heard saying, "{c}".',
    "{n} expressed that {c}.",
    '"{c}" - {n}.',
    'As {n} put it, "{c}".',
    '{n} asserted: "{c}".',
    '"{c}," {n} mentioned.',
    '{n} commented, "{c}".',
    'In a statement by {n}: "{c}".',
    '{n} noted, "{c}".',
    '"{c}," {n} claimed.',
)

KNIGHT_KNAVE = {
    "Knave": "Knave",
    "Knight": "Knight",
    "a_knave": "a knave",
    "a_knight": "a knight",
    "knave": "knave",
    "knight": "knight",
}

QUIZ_PREFIX = (
    "A very special island is inhabited only by knights and knaves. "
    "Knights always tell the truth, and knaves always lie. "
)
QUIZ_POSTFIX = " So who is a knight and who is a knave?"
COT_HEAD = "Let's think step by step, by considering whether each person is lying and if that leads to contradiction."
COT_FOOT = "This leads to a feasible solution."
COT_FAIL = "All the configurations lead to contradictions."


def oxford_join(items: list[str]) -> str:
    """ "A, B, and C"; the ", and" is kept for two items too ("A, and B")."""
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + ", and " + items[-1]


def role(is_knight: bool) -> str:
    return "a knight" if is_knight else "a knave"


def content(statement: Statement, names: list[str]) -> str:
    """The claim's text; only the six depth-2 shapes of the generator are renderable."""
    op = statement[0]
    if op == "telling-truth":
        return f"{names[statement[1]]} is a knight"
    if op == "lying":
        return f"{names[statement[1]]} is a knave"
    if op == "not":
        inner = statement[1]
        word = "knight" if inner[0] == "telling-truth" else "knave"
        return f"{names[inner[1]]} is not a {word}"
    if op in ("and", "or"):
        return f" {op} ".join(content(s, names) for s in statement[1:])
    if op == "->":
        return f"If {content(statement[1], names)} then {content(statement[2], names)}"
    if op == "<=>":
        return f"{content(statement[1], names)} if and only if {content(statement[2], names)}"
    raise ValueError(f"cannot render operator {op!r}")


def draw_names_and_templates(n: int, seed: int) -> tuple[list[str], list[int]]:
    """Names (``choice(names, N, replace=False)``), then one template U(18) per person."""
    rng = np.random.default_rng(seed)
    names = [str(x) for x in rng.choice(COMMON_NAMES, size=n, replace=False)]
    templates = [int(rng.integers(0, len(TEMPLATES))) for _ in range(n)]
    return names, templates


def quiz_text(problem: Problem, names: list[str], templates: list[int]) -> str:
    parts = [QUIZ_PREFIX, f"You meet {len(problem)} inhabitants: {oxford_join(names)}."]
    for i, s in enumerate(problem):
        parts.append(" " + TEMPLATES[templates[i]].format(n=names[i], c=content(s, names)))
    parts.append(QUIZ_POSTFIX)
    return "".join(parts)


def solution_text(solution: tuple[bool, ...], names: list[str]) -> str:
    """ "A is a knight, B is a knave, and C is a knave." """
    return oxford_join([f"{nm} is {role(k)}" for nm, k in zip(names, solution, strict=True)]) + "."


def solution_text_format(solution: tuple[bool, ...], names: list[str]) -> str:
    """The reward's ground truth: "(1) A is a knight\\n(2) B is a knave" (no trailing period)."""
    return "\n".join(
        f"({i + 1}) {nm} is {role(k)}" for i, (nm, k) in enumerate(zip(names, solution, strict=True))
    )


def _satisfiable(claim_holds, assignment: dict[int, bool], n: int) -> bool:
    """Is there a completion of the unassigned people under which ``claim_holds`` is true?"""
    free = [p for p in range(n) if p not in assignment]
    for bits in range(1 << len(free)):
        full = dict(assignment)
        for j, p in enumerate(free):
            full[p] = not (bits >> j) & 1  # knight first
        if claim_holds([full[p] for p in range(n)]):
            return True
    return False


def chain_of_thought(problem: Problem, names: list[str]) -> tuple[list[str], bool]:
    """The official backtracking trace (``docs/kk.md`` §1.7): steps, and whether it succeeded."""
    n = len(problem)
    order = list(range(n))
    to_try: dict[int, list[bool]] = {p: [True, False] for p in range(n)}
    assignment: dict[int, bool] = {}
    steps: list[str] = []
    cursor = 0
    while cursor < n:
        p = order[cursor]
        if not to_try[p]:
            exhausted = []
            while cursor >= 0 and not to_try[order[cursor]]:
                q = order[cursor]
                to_try[q] = [True, False]
                assignment.pop(q, None)
                exhausted.append(names[q])
                cursor -= 1
            if cursor < 0:
                return steps, False
            back = order[cursor]
            assignment.pop(back, None)
            steps.append(
                f"We have exhausted all possibilities for {_list_people(exhausted)}, "
                f"so let us go back and reconsider {names[back]}."
            )
            continue
        value = to_try[p].pop(0)
        assignment[p] = value
        conflict = None
        for q in sorted(assignment):
            truth = assignment[q]
            if not _satisfiable(lambda a, s=problem[q], t=truth: evaluate(s, a) == t, assignment, n):
                conflict = q
                break
        if conflict is None:
            false = "" if value else "false "
            steps.append(
                f"Assume {names[p]} is {role(value)}. No contradiction is found in their "
                f"{false}claim that {content(problem[p], names)}."
            )
            cursor += 1
            rest = order[cursor:]
            first = [q for q in mentioned_people(problem[p]) if q in rest]
            order[cursor:] = first + [q for q in rest if q not in first]
        else:
            del assignment[p]
            who = "their own" if conflict == p else names[conflict]
            false = "" if assignment.get(conflict, value) else "false "
            steps.append(
                f"{names[p]} cannot be {role(value)}, because this would contradict the {false}claim of "
                f"{who} that {content(problem[conflict], names)}."
            )
    return steps, True


def _list_people(people: list[str]) -> str:
    if len(people) == 1:
        return people[0]
    if len(people) == 2:
        return f"{people[0]} and {people[1]}"
    return ", ".join(people[:-1]) + ", and " + people[-1]


@dataclass
class Puzzle:
    """One rendered K&K puzzle, with every field of the official records."""

    index: int
    statements: Problem
    solution: tuple[bool, ...]
    names: list[str]
    quiz: str
    cot_steps: list[str] = field(default_factory=list)

    @property
    def people(self) -> int:
        return len(self.statements)

    @property
    def solution_text(self) -> str:
        return solution_text(self.solution, self.names)

    @property
    def solution_text_format(self) -> str:
        return solution_text_format(self.solution, self.names)

    @property
    def statements_repr(self) -> str:
        return repr(self.statements)


def render(index: int, problem: Problem, solution: tuple[bool, ...], seed: int) -> Puzzle:
    """Render stream position ``index`` of seed ``seed`` (formatter stream ``seed + index``)."""
    names, templates = draw_names_and_templates(len(problem), seed + index)
    steps, _ = chain_of_thought(problem, names)
    return Puzzle(index, problem, tuple(solution), names, quiz_text(problem, names, templates), steps)
