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
