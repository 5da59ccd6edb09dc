"""Checks over training seeds that hold at small n, beside the two-stage bootstrap (`tokendyn.analysis.seeds`).

A percentile bootstrap over S seeds has few distinct resamples (35 at S = 4) and covers less than its nominal level
there. These checks take the training seed as the unit, the seed-level quantity of a paired row being

    d_s = mean_j (a[s, j] - b[s, j])          (method minus base at the same seed s, over the problems j)

over the n seeds both methods have (a seed only one of them has is left out, and listed):

- the paired t-interval: dbar +- t_{(1+level)/2, n-1} * sd(d) / sqrt(n), sd with ddof 1, and the two-sided p-value
  of t = dbar / (sd(d) / sqrt(n)) on n - 1 degrees of freedom (`paired_t`);
- the seeds that agree in sign: how many d_s have the sign of dbar (`sign_agreement`);
- Holm-Bonferroni across a family of rows (those sharing a baseline at one rollout): sort the m p-values,
  p_(1) <= ... <= p_(m); adjusted p_(i) = max_{k <= i} min(1, (m - k + 1) p_(k)) (`holm`).

Student's t distribution by the finite series of Abramowitz & Stegun 26.7.3-26.7.4 (integer df, exact in float64):
with theta = atan(|t| / sqrt(df)), A(t | df) = P(|T| < |t|) =

    df = 1:        2 theta / pi
    df odd > 1:    (2 / pi) [theta + sin(theta) (cos(theta) + (2/3) cos^3 + (2*4)/(3*5) cos^5 + ...
                                                  + (2*4...(df-3)) / (3*5...(df-2)) cos^(df-2)(theta))]
    df even:       sin(theta) [1 + (1/2) cos^2 + (1*3)/(2*4) cos^4 + ... + (1*3...(df-3)) / (2*4...(df-2)) cos^(df-2)]

and its quantile by bisection on A.
"""

from __future__ import annotations

import math

import numpy as np

LEVEL = 0.95
ALPHA = 1.0 - LEVEL


def t_central(t: float, df: int) -> float:
    """A(t | df) = P(|T| < |t|) for Student's t with integer ``df`` >= 1 (module docstring, A&S 26.7.3-4)."""
    if int(df) != df or df < 1:
        raise ValueError(f"df: an integer >= 1, got {df}")
    df = int(df)
    if math.isinf(t):
        return 1.0
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2:  # odd
        if df == 1:
            return 2.0 * theta / math.pi
        term, total = c, c
        for k in range(3, df - 1, 2):  # term_k = term_{k-2} * (k-1)/k * cos^2
            term *= (k - 1) / k * c * c
            total += term
        return min(1.0, 2.0 / math.pi * (theta + s * total))
    term, total = 1.0, 1.0
    for k in range(2, df - 1, 2):  # term_k = term_{k-2} * (k-1)/k * cos^2
        term *= (k - 1) / k * c * c
        total += term
    return min(1.0, s * total)


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) = 1 - A(t | df)."""
    return max(0.0, 1.0 - t_central(t, df))


def t_quantile(q: float, df: int) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom: the t with P(T <= t) = q, by bisection on
    A(t | df) = |2q - 1| (to float64 resolution)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"q: in (0, 1), got {q}")
    target = abs(2.0 * q - 1.0)
    lo, hi = 0.0, 1.0
    while t_central(hi, df) < target:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if t_central(mid, df) < target:
            lo = mid
        else:
            hi = mid
    t = 0.5 * (lo + hi)
    return t if q >= 0.5 else -t


def paired_t(d, level: float = LEVEL) -> dict[str, float]:
    """The paired t-test on per-seed differences ``d`` (module docstring): n, mean, the ``level`` t-interval
    [lo, hi], t and the two-sided p. n < 2: NaN interval and p. Every d_s equal: the interval is [dbar, dbar] and
    p is 0 (dbar != 0) or 1 (dbar = 0)."""
    d = np.asarray(d, dtype=np.float64)
    n = int(d.size)
    mean = float(d.mean()) if n else float("nan")
    out = {"n": n, "mean": mean, "lo": float("nan"), "hi": float("nan"), "t": float("nan"), "p": float("nan")}
    if n < 2:
        return out
    sd = float(d.std(ddof=1))
    if sd == 0.0:
        return {**out, "lo": mean, "hi": mean, "t": math.copysign(math.inf, mean) if mean else 0.0,
                "p": 0.0 if mean else 1.0}  # fmt: skip
    se = sd / math.sqrt(n)
    half = t_quantile((1.0 + level) / 2.0, n - 1) * se
    t = mean / se
    return {**out, "lo": mean - half, "hi": mean + half, "t": t, "p": t_two_sided_p(t, n - 1)}


def sign_agreement(d) -> tuple[int, int]:
    """(k, n): of the n per-seed differences, the k with the sign of their mean (a zero difference, or a zero mean,
    agrees with nothing)."""
    d = np.asarray(d, dtype=np.float64)
    m = np.sign(d.mean()) if d.size else 0.0
    return (int(np.sum(np.sign(d) == m)) if m else 0), int(d.size)


def holm(p) -> list[float]:
    """Holm-Bonferroni adjusted p-values of a family, in the given order (module docstring); NaN stays NaN and is
    not counted in m."""
    p = np.asarray(p, dtype=np.float64)
    out = np.full(p.shape, np.nan)
    idx = np.flatnonzero(np.isfinite(p))
    m = idx.size
    running = 0.0
    for rank, i in enumerate(idx[np.argsort(p[idx], kind="stable")]):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out.tolist()


def side(lo: float, hi: float) -> int:
    """+1 if [lo, hi] lies above 0, -1 below, 0 if it holds 0 (or is not finite)."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return 0
    return 1 if lo > 0 else -1 if hi < 0 else 0


def check_sides(boot_lo, boot_hi, t_lo, t_hi, mean, p_holm, agree: int, n: int,
                alpha: float = ALPHA) -> dict[str, int]:  # fmt: skip
    """Where each check puts a row: +1 above 0, -1 below, 0 unresolved. bootstrap and t-interval: the side of their
    interval; Holm: the sign of the mean if the adjusted p < alpha; signs: the sign of the mean if every seed has
    it (k = n)."""
    sgn = int(np.sign(mean)) if np.isfinite(mean) else 0
    return {
        "bootstrap": side(boot_lo, boot_hi),
        "t-interval": side(t_lo, t_hi),
        "Holm": sgn if np.isfinite(p_holm) and p_holm < alpha else 0,
        "signs": sgn if n and agree == n else 0,
    }


def agreed_side(sides: dict[str, int]) -> int | None:
    """The side every check gives (+1, -1, or 0 when none resolves), None when they disagree."""
    values = set(sides.values())
    return values.pop() if len(values) == 1 else None


def disagreement(sides: dict[str, int], p_holm: float, agree: int, n: int) -> str:
    """The words of a split row: which checks put it on which side, e.g. "not resolved: bootstrap, t-interval
    above 0; Holm p 0.12, signs 3/4 not"."""
    words = {1: "above 0", -1: "below 0"}
    resolved = [s for s in (1, -1) if s in sides.values()]
    parts = [f"{', '.join(k for k, v in sides.items() if v == s)} {words[s]}" for s in resolved]
    label = {"Holm": f"Holm p {p_holm:.2g}", "signs": f"signs {agree}/{n}"}
    held = [label.get(k, k) for k, v in sides.items() if v == 0]
    if held:
        parts.append(f"{', '.join(held)} not")
    return "not resolved: " + "; ".join(parts)
