"""Reference completions for the warm start: varied reasoning, then the official answer.

The reasoning is faithful (every stated role and truth value is the puzzle's solution) but
varied the way an LLM's is: several phrasings per sentence, the people considered in different
orders, optional sentences. That variety is what gives the warm-started policy an LLM-like
minority of uncertain tokens (``WARMSTART_NOTES.md``). Answer lines keep the official order,
which preserves name copying.
"""

from __future__ import annotations

import random

from ..tasks.kk.logic import evaluate, mentioned_people
from ..tasks.kk.render import Puzzle, content, role

OPENERS = (
    "",
    "Let me check each claim.",
    "Let's reason about who is telling the truth.",
    "I will go through the inhabitants one by one.",
    "Knights tell the truth and knaves lie, so each claim must match its speaker.",
    "Let's consider each person in turn.",
)
CLAIMS = (
    "{P} says {c}.",
    "{P} claims that {c}.",
    "According to {P}, {c}.",
    "{P}'s statement is that {c}.",
    "{P} said that {c}.",
)
CONCLUSIONS = (
    "So {P} is {r}.",
    "{P} must be {r}.",
    "This makes {P} {r}.",
    "Therefore {P} is {r}.",
    "{P} is {r}, so the claim is {t}.",
    "The claim is {t}, so {P} is {r}.",
    "Hence {P} is {r}.",
)
CLOSERS = (
    "",
    "This leads to a feasible solution.",
    "Everything is consistent.",
    "All claims check out.",
    "No contradiction remains.",
)


def search_order(p: Puzzle) -> list[int]:
    """The order of the official trace: person 0 first, then the people each placed person names."""
    order: list[int] = []
    queue = [0]
    while len(order) < p.people:
        if not queue:
            queue = [q for q in range(p.people) if q not in order][:1]
        q = queue.pop(0)
        if q in order:
            continue
        order.append(q)
        queue = [m for m in mentioned_people(p.statements[q]) if m not in order] + queue
    return order


def reasoning(p: Puzzle, rng: random.Random) -> str:
    """Faithful, varied reasoning for ``p``."""
    kind = rng.random()
    if kind < 0.4:
        order = list(range(p.people))
    elif kind < 0.7:
        order = search_order(p)
    else:
        order = rng.sample(range(p.people), p.people)
    sentences = [rng.choice(OPENERS)]
    for q in order:
        name, claim = p.names[q], content(p.statements[q], p.names)
        truth = "true" if evaluate(p.statements[q], p.solution) else "false"
        if rng.random() < 0.7:
            sentences.append(rng.choice(CLAIMS).format(P=name, c=claim))
        sentences.append(rng.choice(CONCLUSIONS).format(P=name, r=role(p.solution[q]), t=truth))
    sentences.append(rng.choice(CLOSERS))
    return " ".join(s for s in sentences if s)


def answer(p: Puzzle) -> str:
    """The official answer block body: "(1) A is a knight\\n(2) B is a knave"."""
    return p.solution_text_format


def completion(p: Puzzle, rng: random.Random) -> str:
    """Everything after the prompt's pre-filled ``<think>`` (the EOS token is appended by the caller)."""
    return f" {reasoning(p, rng)} </think>\n<answer> {answer(p)} </answer>"
