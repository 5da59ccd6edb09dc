"""Accuracy per puzzle size with its two-way bootstrap interval, and the paired difference of two methods
(`tokendyn.analysis.study`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

from tokendyn.analysis.bootstrap import N_BOOT, bootstrap_two_way


def outcome_matrix(
    evals: pl.DataFrame, method: str, mode: str, people: Sequence[int] | None = None
) -> np.ndarray:
    """x[s, j] = 1 if seed s solved puzzle j (columns: (people, puzzle) in sorted order) for one method and mode."""
    df = evals.filter((pl.col("method") == method) & (pl.col("mode") == mode))
    if people is not None:
        df = df.filter(pl.col("people").is_in(list(people)))
    if df.height == 0:
        return np.zeros((0, 0))
    wide = df.sort("people", "puzzle").pivot(on="seed", index=["people", "puzzle"], values="correct")
    seeds = sorted(c for c in wide.columns if c not in ("people", "puzzle"))
    return wide.select(seeds).to_numpy().astype(np.float64).T


def accuracy_table(evals: pl.DataFrame, n_boot: int = N_BOOT) -> pl.DataFrame:
    """Per method, mode and puzzle size (and "all" sizes pooled): accuracy with its two-way 95 % interval."""
    rows = []
    for (method, mode), _ in evals.group_by("method", "mode", maintain_order=True):
        sizes = sorted(
            evals.filter((pl.col("method") == method) & (pl.col("mode") == mode))["people"].unique()
        )
        for people in [*[[k] for k in sizes], *([sizes] if len(sizes) > 1 else [])]:
            x = outcome_matrix(evals, method, mode, people)
            if x.size == 0 or not np.isfinite(x).all():
                continue
            mean, lo, hi = bootstrap_two_way(x, n_boot)
            rows.append(
                {
                    "method": method,
                    "mode": mode,
                    "people": str(people[0]) if len(people) == 1 else "all",
                    "seeds": x.shape[0],
                    "puzzles": x.shape[1],
                    "accuracy": mean,
                    "lo": lo,
                    "hi": hi,
                }
            )
    return pl.DataFrame(rows)


def paired_difference(
    evals: pl.DataFrame, method: str, reference: str, mode: str, n_boot: int = N_BOOT
) -> tuple[float, float, float]:
    """Accuracy of ``method`` minus ``reference`` over every size, paired by seed and puzzle, with its interval."""
    a, b = outcome_matrix(evals, method, mode), outcome_matrix(evals, reference, mode)
    if a.size == 0 or a.shape != b.shape:
        return (float("nan"), float("nan"), float("nan"))
    return bootstrap_two_way(a - b, n_boot)
