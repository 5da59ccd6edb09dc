"""The two-stage bootstrap over training seeds and problems (`tokendyn.analysis.seeds`): its draws against the
closed-form variance of the scheme, its limits, and the paired differences of a study's outcomes."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from tokendyn.analysis import seeds as S


def _outcomes(rng, seeds=4, problems=60, base=0.5, seed_sd=0.1):
    p = np.clip(
        base + seed_sd * rng.standard_normal((seeds, 1)) + 0.3 * rng.standard_normal((1, problems)), 0, 1
    )
    return (rng.random((seeds, problems)) < p).astype(float)


@pytest.mark.parametrize("shape", [(4, 60), (2, 200), (8, 25), (1, 100)])
def test_draws_have_the_closed_form_variance_of_the_scheme(shape):
    """Var*(theta*) of 20,000 draws within 4 % of (1/S)[mean_s (m_s - m)^2 + mean_s v_s / P], and E* = the mean."""
    rng = np.random.default_rng(1)
    x = _outcomes(rng, *shape)
    draws = S.hierarchical_draws(x, n_boot=20_000, seed=3)
    want = S.hierarchical_variance(x)
    assert abs(draws.var() / want - 1) < 0.04
    assert abs(draws.mean() - x.mean()) < 4 * np.sqrt(want / 20_000)


def test_closed_form_variance_against_a_brute_force_enumeration():
    """The closed form, by enumerating every (seed draw, problem draw) of a 2 x 2 matrix exactly."""
    import itertools

    x = np.array([[0.0, 1.0], [1.0, 1.0]])
    thetas = []
    for rows in itertools.product(range(2), repeat=2):
        for cols in itertools.product(range(2), repeat=4):
            thetas.append(
                np.mean([x[rows[0], cols[0]], x[rows[0], cols[1]], x[rows[1], cols[2]], x[rows[1], cols[3]]])
            )
    assert S.hierarchical_variance(x) == pytest.approx(np.var(thetas), abs=1e-15)


def test_a_seed_effect_widens_the_interval_that_problems_alone_would_give():
    """Seeds that differ (0.3 vs 0.7): the interval is wider than the problems-only bootstrap of the pooled
    outcomes; equal seeds: about the same."""
    rng = np.random.default_rng(0)
    spread = np.vstack([(rng.random(200) < p).astype(float) for p in (0.3, 0.7, 0.35, 0.65)])
    _, lo, hi = S.hierarchical_interval(spread, 4000)
    pooled = spread.reshape(1, -1)  # one "seed" of 800 problems: problems only
    _, plo, phi = S.hierarchical_interval(pooled, 4000)
    assert hi - lo > 3 * (phi - plo)


def test_constant_and_bad_inputs():
    assert S.hierarchical_interval(np.full((3, 5), 0.25), 500) == (0.25, 0.25, 0.25)
    with pytest.raises(ValueError, match="x: must be a non-empty 2-d array"):
        S.hierarchical_interval(np.zeros(5))
    with pytest.raises(ValueError, match="x: must be finite"):
        S.hierarchical_interval(np.array([[0.0, np.nan]]))
    spread = S.seed_spread(np.array([[1.0, 0.0], [1.0, 1.0]]))
    assert spread == {"seeds": 2, "mean": 0.75, "sd": pytest.approx(np.std([0.5, 1.0], ddof=1)), "min": 0.5,
                      "max": 1.0}  # fmt: skip


def _evals(table):
    """{(method, seed): outcomes over problems} -> a study's evaluation rows at rollout 10."""
    rows = [
        {"method": m, "seed": s, "rollout": 10, "digits": 2, "problem": j, "correct": int(c)}
        for (m, s), outs in table.items()
        for j, c in enumerate(outs)
    ]
    return pl.DataFrame(rows)


def test_paired_difference_pairs_by_seed_and_problem_over_the_shared_seeds():
    rng = np.random.default_rng(5)
    a = {s: (rng.random(50) < 0.6).astype(int) for s in range(4)}
    b = {s: (rng.random(50) < 0.4).astype(int) for s in range(3)}  # seed 3 of b not finished
    evals = _evals({**{("lopti", s): v for s, v in a.items()}, **{("grpo", s): v for s, v in b.items()}})
    d, lo, hi, n = S.paired_difference(evals, "lopti", "grpo", 10, n_boot=2000)
    x = np.vstack([a[s] - b[s] for s in range(3)]).astype(float)
    assert n == 3 and d == pytest.approx(x.mean())
    assert (lo, hi) == pytest.approx(S.hierarchical_interval(x, 2000)[1:])
    # problems shuffled within one method's rows: the pairing is by problem id, not by row order
    shuffled = evals.sample(fraction=1.0, shuffle=True, seed=1)
    assert S.paired_difference(shuffled, "lopti", "grpo", 10, n_boot=2000) == (d, lo, hi, n)


@pytest.mark.parametrize(
    ("method", "lo", "hi", "word"),
    [
        ("lopti", 0.01, 0.1, "reproduced"),
        ("lopti", -0.2, -0.05, "reversed"),
        ("reweight", -0.01, 0.02, "paper's effect excluded; sign not resolved"),
        ("reweight", -0.01, 0.15, "not resolved at this size"),
        ("lopti", -0.194, 0.018, "paper's effect excluded; sign not resolved"),
        ("dppo_tv", -0.01, 0.02, "not resolved at this size"),
        ("dppo_tv", 0.01, 0.02, "better than GRPO"),
        ("w_reinforce", -0.3, -0.01, "worse than GRPO"),
        ("w_reinforce", float("nan"), 0.0, "no data"),
    ],
)
def test_verdicts(method, lo, hi, word):
    assert S.verdict(method, lo, hi) == word


def test_one_seed_gets_no_verdict_whatever_its_interval():
    """A difference from one training seed is an interval over problems only: 'one seed', never a verdict, even
    when that interval excludes 0."""
    evals = _evals({("lopti", 0): [1] * 40, ("grpo", 0): [0] * 40})
    table = S.differences_table(evals, [("lopti", "grpo")], 10, n_boot=500)
    assert table["verdict"].to_list() == [S.ONE_SEED] and table["lo"][0] == 1.0
    two = _evals({("lopti", s): [1] * 40 for s in (0, 1)} | {("grpo", s): [0] * 40 for s in (0, 1)})
    assert S.differences_table(two, [("lopti", "grpo")], 10, n_boot=500)["verdict"].to_list() == [
        "reproduced"
    ]
