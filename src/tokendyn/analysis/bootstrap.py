"""Percentile bootstrap intervals of the study (`tokendyn.analysis.study`): two-way over seeds and puzzles, and
two-level over seeds and their probed steps."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

LEVEL = 0.95


N_BOOT = 2000


def _percentiles(samples: np.ndarray, level: float) -> tuple[float, float]:
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(samples, [a, 1.0 - a])
    return float(lo), float(hi)


def bootstrap_two_way(
    x: np.ndarray, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, lo, hi) of the matrix x[s, j] (rows: seeds, columns: puzzles): theta = mean_{s,j} x[s, j]; each of
    ``n_boot`` resamples draws rows S* and columns J* independently with replacement, theta* = mean of
    x[S*][:, J*]; [lo, hi] = the (1-level)/2 and (1+level)/2 quantiles of theta*. A constant matrix gives the
    exact interval [c, c]. NaN entries (a puzzle size a seed did not evaluate) are not allowed."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.size == 0:
        raise ValueError(f"x: must be a non-empty 2-d array (seeds x puzzles), got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("x: must be finite (every seed evaluated on every puzzle)")
    rng = np.random.default_rng(seed)
    s, p = x.shape
    theta = np.empty(n_boot)
    chunk = max(1, 2_000_000 // max(1, s * p))
    for start in range(0, n_boot, chunk):
        b = min(chunk, n_boot - start)
        rows = rng.integers(0, s, (b, s))
        cols = rng.integers(0, p, (b, p))
        theta[start : start + b] = x[rows[:, :, None], cols[:, None, :]].mean(axis=(1, 2))
    return (float(x.mean()), *_percentiles(theta, level))


def bootstrap_units(
    groups: Sequence[np.ndarray],
    statistic: Callable[[np.ndarray], float],
    n_boot: int = N_BOOT,
    level: float = LEVEL,
    seed: int = 0,
    min_units: int = 1,
) -> tuple[float, float, float]:
    """(estimate, lo, hi) of ``statistic(unit indices)`` where ``groups[s]`` holds the unit indices (probed steps)
    of seed s: each resample draws seeds with replacement, then each drawn seed's units with replacement, and
    evaluates the statistic on the concatenated indices; percentile interval as in ``bootstrap_two_way``. A
    statistic that is NaN on a resample (no decided token drawn) is left out of the quantiles. Fewer than
    ``min_units`` units in all: no interval (NaN bounds)."""
    groups = [np.asarray(g, dtype=np.int64) for g in groups if len(g)]
    if not groups:
        return (float("nan"), float("nan"), float("nan"))
    est = float(statistic(np.concatenate(groups)))
    if sum(len(g) for g in groups) < min_units:  # one unit: resampling it gives a point, not an interval
        return (est, float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    theta = np.empty(n_boot)
    for b in range(n_boot):
        picked = [groups[i] for i in rng.integers(0, len(groups), len(groups))]
        idx = np.concatenate([g[rng.integers(0, len(g), len(g))] for g in picked])
        theta[b] = statistic(idx)
    theta = theta[np.isfinite(theta)]
    if theta.size == 0:
        return (est, float("nan"), float("nan"))
    return (est, *_percentiles(theta, level))
