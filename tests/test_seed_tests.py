"""The checks over training seeds (`tokendyn.analysis.seed_tests`) against independent references: scipy's values
(scipy is not in the venv: the numbers below were computed with scipy 1.17.1's stats.t and stats.ttest_rel / its
confidence_interval, and are quoted), mpmath's regularized incomplete beta, the closed forms of df 1 and 2, and a
Holm adjustment worked by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tokendyn.analysis import seed_tests as T

# df -> (t_{0.975, df}, P(|T| >= 2.5)), scipy 1.17.1: stats.t.ppf(0.975, df), 2 * stats.t.sf(2.5, df)
SCIPY_T = {
    1: (12.706204736174694, 0.24223788318168682),
    2: (4.302652729749462, 0.12961172022151082),
    3: (3.1824463052837078, 0.08770664700806556),
    4: (2.7764451051977934, 0.06676654481198814),
    5: (2.5705818356363146, 0.05449009934237626),
    7: (2.364624251592784, 0.04099221858575289),
    10: (2.228138851986274, 0.03144684423660882),
    30: (2.0422724563012378, 0.01811564906806669),
    100: (1.9839715185235518, 0.014045789124077172),
}


@pytest.mark.parametrize("df", sorted(SCIPY_T))
def test_t_quantile_and_tail_against_scipy(df):
    q, p = SCIPY_T[df]
    assert T.t_quantile(0.975, df) == pytest.approx(q, rel=1e-12)
    assert T.t_quantile(0.025, df) == pytest.approx(-q, rel=1e-12)
    assert T.t_two_sided_p(2.5, df) == pytest.approx(p, rel=1e-11)


@pytest.mark.parametrize("df", [1, 2, 3, 6, 9, 17, 40])
@pytest.mark.parametrize("t", [0.05, 0.7, 1.9, 3.3, 11.0])
def test_t_central_against_mpmath_incomplete_beta(df, t):
    """P(|T| < t) = 1 - I_{df / (df + t^2)}(df / 2, 1 / 2), in 50-digit arithmetic."""
    import mpmath

    mpmath.mp.dps = 50
    x = mpmath.mpf(df) / (df + mpmath.mpf(t) ** 2)
    want = 1 - mpmath.betainc(mpmath.mpf(df) / 2, mpmath.mpf(1) / 2, 0, x, regularized=True)
    assert T.t_central(t, df) == pytest.approx(float(want), rel=1e-13, abs=1e-15)


@pytest.mark.parametrize("t", [0.3, 1.0, 4.0, 50.0])
def test_t_central_against_the_closed_forms_of_df_1_and_2(t):
    assert T.t_central(t, 1) == pytest.approx(2 * math.atan(t) / math.pi, rel=1e-14)  # Cauchy
    assert T.t_central(t, 2) == pytest.approx(t / math.sqrt(2 + t * t), rel=1e-14)


def test_paired_t_against_scipy_ttest_rel():
    """Four seeds' accuracies of two methods: scipy.stats.ttest_rel(a, b) and its 95 % confidence_interval."""
    a, b = np.array([0.565, 0.55, 0.52, 0.545]), np.array([0.54, 0.51, 0.48, 0.52])
    r = T.paired_t(a - b)
    assert r["n"] == 4 and r["mean"] == pytest.approx(0.0325, rel=1e-14)
    assert r["t"] == pytest.approx(7.5055534994651, rel=1e-12)
    assert r["p"] == pytest.approx(0.004900523592442466, rel=1e-10)
    assert (r["lo"], r["hi"]) == pytest.approx((0.01871960326722185, 0.04628039673277815), rel=1e-12)
    # seven seeds, the interval holding 0: scipy.stats.ttest_1samp(d, 0)
    r = T.paired_t([0.03, -0.01, 0.05, 0.02, 0.04, -0.005, 0.015])
    assert r["p"] == pytest.approx(0.054291944163477046, rel=1e-10)
    assert (r["lo"], r["hi"]) == pytest.approx((-0.0005071206805375809, 0.04050712068053758), rel=1e-10)


def test_paired_t_limits():
    one = T.paired_t([0.2])
    assert one["n"] == 1 and math.isnan(one["lo"]) and math.isnan(one["p"])
    same = T.paired_t([0.1, 0.1, 0.1])
    assert (same["lo"], same["hi"], same["p"]) == (pytest.approx(0.1), pytest.approx(0.1), 0.0)
    assert T.paired_t([0.0, 0.0])["p"] == 1.0


def test_holm_by_hand():
    """p = (0.01, 0.04, 0.03, 0.005): sorted 0.005, 0.01, 0.03, 0.04 -> 4 * 0.005 = 0.02, 3 * 0.01 = 0.03,
    2 * 0.03 = 0.06, max(0.06, 1 * 0.04) = 0.06; NaN rows stay NaN and are not counted."""
    assert T.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    got = T.holm([0.01, float("nan"), 0.04, 0.03, 0.005])
    assert math.isnan(got[1]) and [got[i] for i in (0, 2, 3, 4)] == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert T.holm([0.6, 0.7]) == [1.0, 1.0] and T.holm([0.02]) == [0.02]


def test_sign_agreement():
    assert T.sign_agreement([0.02, 0.03, 0.01, 0.04]) == (4, 4)
    assert T.sign_agreement([0.02, -0.03, 0.05, 0.04]) == (3, 4)
    assert T.sign_agreement([0.0, 0.02]) == (1, 2)


def test_a_row_is_resolved_only_when_every_check_agrees():
    sides = T.check_sides(0.01, 0.05, 0.002, 0.06, 0.03, 0.01, 4, 4)
    assert T.agreed_side(sides) == 1
    split = T.check_sides(0.01, 0.05, -0.01, 0.07, 0.03, 0.12, 3, 4)
    assert T.agreed_side(split) is None
    assert (
        T.disagreement(split, 0.12, 3, 4)
        == "not resolved: bootstrap above 0; t-interval, Holm p 0.12, signs 3/4 not"
    )
    assert T.agreed_side(T.check_sides(-0.02, 0.05, -0.03, 0.06, 0.01, 0.5, 2, 4)) == 0
