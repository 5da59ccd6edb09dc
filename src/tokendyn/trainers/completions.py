"""Reference completions for the warm start: varied reasoning, then the official answer.

The reasoning is faithful (every stated role and truth value is the puzzle's solution) but
varied the way an LLM's is: several phrasings per sentence, the people considered in different
orders, optional sentences. That variety is what gives the warm-started policy an LLM-like
minority of uncertain tokens. Answer lines keep the official order,
which preserves name copying.
"""

from __future__ import annotations

import random

from ..tasks.kk.logic import evaluate, mentioned_people
from ..tasks.kk.render import Puzzle, content, oxford_join, role

# the reasoning opens by restating who is there: a contiguous copy of the prompt's name list, the
# easiest copying pattern for a small transformer to learn (name copying is what a from-scratch
# policy learns last)
ROLL_CALLS = (
    "We meet {n} inhabitants: {names}.",
    "There are {n} inhabitants: {names}.",
    "The {n} inhabitants are {names}.",
    "So we have {n} inhabitants: {names}.",
)
OPENERS = (
    "",
    "Let me check each claim.",
    "Let's reason about who is telling the truth.",
    "I will go through the inhabitants one by one.",
    "Knights tell the truth and knaves lie, so each claim must match its speaker.",
    "Let's consider each person in turn.",
    "Let me work out each role.",
    "Each claim tells us something.",
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
    "{P} is {r}.",
    "{P} has to be {r}.",
    "{P} can only be {r}.",
    "{P} turns out to be {r}.",
    "{P}'s claim is {t}, which makes {P} {r}.",
)
# how the next person is brought up: a choice an LLM makes freely (the sentence opener)
LEADS = (
    "",
    "",
    "Next,",
    "Now",
    "Then",
    "Also,",
    "Looking at {P},",
    "As for {P},",
    "Consider {P}:",
    "What about {P}?",
)
CLOSERS = (
    "",
    "This leads to a feasible solution.",
    "Everything is consistent.",
    "All claims check out.",
    "No contradiction remains.",
    "That settles it.",
    "So the roles are clear.",
)


# the first version's phrasings are the first entries of each list (preset cpu_v1 regenerates the first default)
V1_OPENERS, V1_CONCLUSIONS, V1_CLOSERS = OPENERS[:6], CONCLUSIONS[:7], CLOSERS[:5]


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


def people_order(p: Puzzle, rng: random.Random, index_below: float, search_below: float, lo: int, hi: int):
    """The people discussed, in order: index order (probability index_below), the official search order (up to
    search_below) or a random order, cut to a random count in lo..hi."""
    kind = rng.random()
    if kind < index_below:
        order = list(range(p.people))
    elif kind < search_below:
        order = search_order(p)
    else:
        order = rng.sample(range(p.people), p.people)
    return order[: rng.randint(lo, hi)]


def _opening(p: Puzzle, rng: random.Random, openers: tuple[str, ...]) -> list[str]:
    """The first two sentences of every style: the roll call (the prompt's name list, copied), then an opener."""
    return [rng.choice(ROLL_CALLS).format(n=p.people, names=oxford_join(list(p.names))), rng.choice(openers)]


def _led(lead: str, sentence: str, name: str) -> str:
    """``sentence`` after ``lead`` ("As for X," / "Consider X:" / ""), lower-cased after a comma or colon unless it
    opens with the name."""
    if lead.endswith((",", ":")) and not sentence.startswith(name):
        sentence = sentence[0].lower() + sentence[1:]
    return " ".join(x for x in (lead, sentence) if x)


def reasoning_v1(p: Puzzle, rng: random.Random) -> str:
    """Faithful, varied, short reasoning for ``p`` (first version): the roll call, then conclusions about 1-3 people
    (each stated role is the solution's), some with the claim they rest on."""
    order = people_order(p, rng, 0.4, 0.7, 1, min(3, p.people))
    sentences = _opening(p, rng, V1_OPENERS)
    for q in order:
        name, claim = p.names[q], content(p.statements[q], p.names)
        truth = "true" if evaluate(p.statements[q], p.solution) else "false"
        if rng.random() < 0.25:
            sentences.append(rng.choice(CLAIMS).format(P=name, c=claim))
        sentences.append(rng.choice(V1_CONCLUSIONS).format(P=name, r=role(p.solution[q]), t=truth))
    sentences.append(rng.choice(V1_CLOSERS))
    return " ".join(s for s in sentences if s)


def reasoning(p: Puzzle, rng: random.Random) -> str:
    """Faithful, varied, short reasoning for ``p`` (second version): the roll call, then conclusions about most
    people (each stated role is the solution's), each brought up with a varied opener, some with the claim they rest
    on.

    Where an LLM is genuinely free the targets vary: which person to examine next (index order, the official
    search order, or a random order), how many people are discussed (2..N), the opener and the phrasing of each
    sentence. Those choice points are the policy's low-probability tokens."""
    order = people_order(p, rng, 0.3, 0.5, min(2, p.people), p.people)
    sentences = _opening(p, rng, OPENERS)
    for q in order:
        name, claim = p.names[q], content(p.statements[q], p.names)
        truth = "true" if evaluate(p.statements[q], p.solution) else "false"
        lead = rng.choice(LEADS).format(P=name)
        if rng.random() < 0.2:
            sentences.append(" ".join(x for x in (lead, rng.choice(CLAIMS).format(P=name, c=claim)) if x))
            lead = ""
        conclusion = rng.choice(CONCLUSIONS).format(P=name, r=role(p.solution[q]), t=truth)
        sentences.append(_led(lead, conclusion, name))
    sentences.append(rng.choice(CLOSERS))
    return " ".join(s for s in sentences if s)


def reasoning_v3(p: Puzzle, rng: random.Random) -> str:
    """Varied reasoning that restates claims and decides nothing (third version): the roll call, then the claims
    of 2..N people in a free order, each brought up with a varied lead and phrasing; the roles are decided in the
    answer alone.

    The free choices (who is next, the lead, the phrasing, how many claims, the closer) are the policy's
    low-probability tokens, as an LLM's sentence openers and orderings are; the rest is copying from the prompt,
    which a small model learns, so no sentence can contradict the answer."""
    order = people_order(p, rng, 0.3, 0.5, min(2, p.people), p.people)
    sentences = _opening(p, rng, OPENERS)
    for q in order:
        lead = rng.choice(LEADS).format(P=p.names[q])
        claim = rng.choice(CLAIMS).format(P=p.names[q], c=content(p.statements[q], p.names))
        sentences.append(_led(lead, claim, p.names[q]))
    sentences.append(rng.choice(CLOSERS))
    return " ".join(s for s in sentences if s)


# v4: a short interjection after a sentence, as an LLM thinking aloud writes one (a free choice, decided by nothing)
INTERJECTIONS = (
    "",
    "",
    "Hmm.",
    "Okay.",
    "Right.",
    "Noted.",
    "Good.",
    "Well.",
    "Sure.",
    "Alright.",
    "Indeed.",
    "Fine.",
)


def reasoning_v4(p: Puzzle, rng: random.Random) -> str:
    """v3 with an interjection (or none) after the roll call and after every claim: more free choices per token."""
    sentences = reasoning_v3(p, rng).split(". ")
    out = []
    for i, sentence in enumerate(sentences):
        out.append(sentence + ("." if i < len(sentences) - 1 else ""))
        if i < len(sentences) - 1:
            out.append(rng.choice(INTERJECTIONS))
    return " ".join(x for x in out if x)


def reasoning_v5(p: Puzzle, rng: random.Random) -> str:
    """v4 with an interjection slot before every sentence of v4's text after the first (v4's own interjections
    included): up to three interjections between two sentences."""
    sentences = reasoning_v4(p, rng).split(". ")
    out = []
    for i, sentence in enumerate(sentences):
        if i > 0:
            out.append(rng.choice(INTERJECTIONS))
        out.append(sentence + ("." if i < len(sentences) - 1 else ""))
    return " ".join(x for x in out if x)


# v6: an interjection ends in one of these (its word a free choice, now its punctuation too: an LLM thinking aloud
# writes "Hmm." as often as "Hmm..." or "Okay!"), so the token after the word is no longer certain
INTERJECTION_ENDS = (".", "!", "...")
INTERJECTION_WORDS = frozenset(
    w[:-1] for w in INTERJECTIONS if w
)  # "Hmm", "Okay", ... (the words, no full stop)


def reasoning_v6(p: Puzzle, rng: random.Random) -> str:
    """v5 with each interjection's full stop redrawn from ``INTERJECTION_ENDS`` (one draw per interjection, after
    v5's text is drawn)."""
    out = []
    for token in reasoning_v5(p, rng).split(" "):
        if token.endswith(".") and token[:-1] in INTERJECTION_WORDS:
            token = token[:-1] + rng.choice(INTERJECTION_ENDS)
        out.append(token)
    return " ".join(out)


def answer(p: Puzzle) -> str:
    """The official answer block body: "(1) A is a knight\\n(2) B is a knave"."""
    return p.solution_text_format


# reference reasoning per style: v1 (1-3 people), v2 (2..N people, varied openers), v3 (claims restated, no roles), v4
# (v3 with interjections), v5 (v4 with twice the interjections), v6 (v5, interjections ending in . ! or ...)
REASONING = {
    "v1": reasoning_v1,
    "v2": reasoning,
    "v3": reasoning_v3,
    "v4": reasoning_v4,
    "v5": reasoning_v5,
    "v6": reasoning_v6,
}
STYLES = tuple(REASONING)


def completion(p: Puzzle, rng: random.Random, style: str = "v1") -> str:
    """Everything after the prompt's pre-filled ``<think>`` (the EOS token is appended by the caller); ``style``
    picks the reasoning (`REASONING`)."""
    if style not in REASONING:
        raise ValueError(f"style: must be one of {list(STYLES)}, got {style!r}")
    think = REASONING[style](p, rng)
    return f" {think} </think>\n<answer> {answer(p)} </answer>"
