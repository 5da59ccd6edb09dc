"""Property tests: every generated puzzle has exactly one solution; the reference answer and
the warm start's reference completion both score 3; fresh data never repeats a held-out structure."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tokendyn.tasks.kk.datasets import fresh_puzzles, heldout_structures, puzzles
from tokendyn.tasks.kk.logic import is_consistent, solutions
from tokendyn.tasks.kk.prompts import render_prompt
from tokendyn.tasks.kk.reward import score
from tokendyn.trainers.completions import STYLES, completion

SEEDS = st.integers(min_value=0, max_value=2**31 - 1).filter(lambda s: s != 1234)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 8), seed=SEEDS, start=st.integers(0, 30))
def test_unique_solution_and_reference_scores_3(n, seed, start):
    (p,) = puzzles(n, seed, start, 1)
    assert solutions(p.statements) == [p.solution]
    assert is_consistent(p.statements, p.solution)
    prompt = render_prompt(p.quiz)
    assert (
        score(prompt, f"ok</think><answer> {p.solution_text_format} </answer>", p.solution_text_format) == 3
    )
    for style in STYLES:  # every warm-start reasoning style's reference completion earns the full reward
        assert score(prompt, completion(p, random.Random(seed), style), p.solution_text_format) == 3, style


@settings(max_examples=10, deadline=None)
@given(n=st.integers(3, 7), seed=SEEDS)
def test_fresh_data_excludes_heldout_structures(n, seed):
    banned = heldout_structures(n)
    items = fresh_puzzles(n, seed, 50)
    assert len(items) == 50
    assert not any(p.statements in banned for p in items)


def test_fresh_data_rejects_the_official_seed():
    import pytest

    with pytest.raises(ValueError, match="seed: fresh data must not use the official seed"):
        fresh_puzzles(3, 1234, 10)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 7), seed=SEEDS)
def test_v6_is_v5_with_free_interjection_endings(n, seed):
    """Style v6 draws v5's text first, then one ending per interjection: with every ending put back to ".", v6 is v5
    word for word; every interjection ends in one of INTERJECTION_ENDS, and nothing else changed."""
    from tokendyn.trainers.completions import INTERJECTION_ENDS, INTERJECTIONS, reasoning_v5, reasoning_v6

    (p,) = puzzles(n, seed, 0, 1)
    v5 = reasoning_v5(p, random.Random(seed)).split(" ")
    v6 = reasoning_v6(p, random.Random(seed)).split(" ")
    words = {w[:-1] for w in INTERJECTIONS if w}
    assert len(v5) == len(v6)
    for a, b in zip(v5, v6, strict=True):
        if a.endswith(".") and a[:-1] in words:
            assert b[: len(a) - 1] == a[:-1] and b[len(a) - 1 :] in INTERJECTION_ENDS
        else:
            assert a == b


def test_v6_endings_are_free_choices():
    """Over 200 puzzles each ending is drawn about a third of the time (binomial 3 s.e. band)."""
    from tokendyn.trainers.completions import INTERJECTION_ENDS, INTERJECTIONS, reasoning_v6

    words = {w[:-1] for w in INTERJECTIONS if w}
    rng = random.Random(7)
    counts = dict.fromkeys(INTERJECTION_ENDS, 0)
    for p in puzzles(3, 99, 0, 200):
        for token in reasoning_v6(p, rng).split(" "):
            for end in sorted(INTERJECTION_ENDS, key=len, reverse=True):
                if token.endswith(end) and token[: -len(end)] in words:
                    counts[end] += 1
                    break
    total = sum(counts.values())
    assert total > 500
    for end, c in counts.items():
        assert abs(c / total - 1 / 3) < 3 * (2 / 9 / total) ** 0.5, (end, counts)
