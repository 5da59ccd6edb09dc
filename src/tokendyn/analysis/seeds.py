"""Intervals over what varies in a seeded study: training seeds, then the held-out problems within each seed.

A run's held-out accuracy varies with the training seed (which prompts it drew, which samples it generated) and with
the problems it is scored on. An interval over the problems alone says nothing about training; one over seeds alone
forgets that each seed's accuracy is itself measured on a finite set of problems. The two-stage (hierarchical)
bootstrap resamples both, in the order they were drawn:

    theta   = mean_{s, j} x[s, j]                      (x: seeds x problems; a method's 0/1 outcomes, or a paired
                                                         difference a[s, j] - b[s, j] of two methods at the same
                                                         training seed s and problem j)
    theta*  = mean over k = 1..S of  mean_j x[s_k, j_k,j]
              s_k ~ U{seeds} with replacement, then for each drawn seed j_k,1..j_k,P ~ U{problems} with replacement
    [lo, hi] = the (1 - level) / 2 and (1 + level) / 2 quantiles of theta*

Its variance is known in closed form (`hierarchical_variance`), which the tests check the draws against.
"""

from __future__ import annotations

import numpy as np

LEVEL = 0.95
N_BOOT = 4000


def _matrix(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.size == 0:
        raise ValueError(f"x: must be a non-empty 2-d array (seeds x problems), got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("x: must be finite (every seed scored on every problem)")
    return x


def hierarchical_draws(x, n_boot: int = N_BOOT, seed: int = 0) -> np.ndarray:
    """``n_boot`` two-stage bootstrap means theta* of x[s, j] (module docstring): seeds with replacement, then
    problems with replacement within each drawn seed."""
    x = _matrix(x)
    s, p = x.shape
    rng = np.random.default_rng(seed)
    theta = np.empty(n_boot)
    chunk = max(1, 4_000_000 // (s * p))
    for start in range(0, n_boot, chunk):
        b = min(chunk, n_boot - start)
        rows = rng.integers(0, s, (b, s))
        cols = rng.integers(0, p, (b, s, p))
        theta[start : start + b] = x[rows[:, :, None], cols].mean(axis=(1, 2))
    return theta


def hierarchical_interval(
    x, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0
) -> tuple[float, float, float]:
    """(theta, lo, hi): the mean of x[s, j] with its two-stage percentile interval (module docstring). A constant
    matrix gives [c, c]."""
    x = _matrix(x)
    theta = hierarchical_draws(x, n_boot, seed)
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(theta, [a, 1.0 - a])
    return float(x.mean()), float(lo), float(hi)


def hierarchical_variance(x) -> float:
    """The exact variance of theta* under the two-stage bootstrap of x (S seeds x P problems)::

        Var*(theta*) = (1 / S) * [ (1 / S) sum_s (m_s - m)^2  +  (1 / S) sum_s v_s / P ]

    with m_s the row means, m their mean and v_s = (1 / P) sum_j (x[s, j] - m_s)^2: each drawn seed's mean varies
    with which seed was drawn and with which problems were drawn within it, and theta* averages S such draws."""
    x = _matrix(x)
    s, p = x.shape
    m_s = x.mean(axis=1)
    v_s = x.var(axis=1)
    return float((np.mean((m_s - m_s.mean()) ** 2) + np.mean(v_s) / p) / s)


def seed_spread(x) -> dict[str, float]:
    """The across-seed spread of one method: each seed's mean over the problems, their mean, standard deviation
    (ddof 1; NaN for one seed), min and max."""
    x = _matrix(x)
    m_s = x.mean(axis=1)
    return {
        "seeds": int(x.shape[0]),
        "mean": float(m_s.mean()),
        "sd": float(m_s.std(ddof=1)) if m_s.size > 1 else float("nan"),
        "min": float(m_s.min()),
        "max": float(m_s.max()),
    }


# ---------------------------------------------------------------- a study's held-out outcomes
# evals: one row per (method, seed, rollout, digits, problem) with correct in {0, 1}; the starting policy is method
# START at rollout 0 (one policy, greedy: one seed's worth of outcomes, shared by every run)
START = "start"
VERDICT_TEXT = (
    "Each difference is the method's held-out accuracy minus GRPO's at the same training seed and problem, with a "
    "95 % two-stage bootstrap interval (seeds, then problems within each seed). For the paper's remedies: "
    "reproduced if the interval lies above 0, reversed if below; paper's effect excluded, sign not resolved if it "
    "holds 0 but lies wholly below the paper's effect (+0.14 Reweight, +0.15 Lopti: 3B on K&K); not resolved at this "
    "size only if it holds both 0 and the paper's effect. For the other methods: better / worse than GRPO, or not "
    "resolved at this size. With one training seed the interval is over the problems alone and says nothing about "
    "training: such a row reads 'one seed', whatever its interval."
)
# the paper's accuracy gains over GRPO (its Fig. 3 table: Qwen2.5-3B on K&K, mean over 3..7 people)
PAPER_EFFECTS = {"reweight": 0.53 - 0.39, "lopti": 0.54 - 0.39}
ONE_SEED = "one seed: no verdict"


def outcome_matrix(evals, method: str, rollout: int, seeds=None) -> tuple[list[int], np.ndarray]:
    """(seeds, x[s, j]): the 0/1 outcomes of ``method`` after ``rollout`` rollouts, one row per training seed (those
    in ``seeds`` if given), columns the problems (digits, problem) in sorted order."""
    import polars as pl

    df = evals.filter((pl.col("method") == method) & (pl.col("rollout") == rollout))
    if seeds is not None:
        df = df.filter(pl.col("seed").is_in(list(seeds)))
    if df.height == 0:
        return [], np.zeros((0, 0))
    wide = df.sort("digits", "problem").pivot(on="seed", index=["digits", "problem"], values="correct")
    found = sorted(int(c) for c in wide.columns if c not in ("digits", "problem"))
    return found, wide.select([str(s) for s in found]).to_numpy().astype(np.float64).T


def accuracy_over_seeds(evals, n_boot: int = N_BOOT):
    """Per (method, rollout): the accuracy over seeds and problems with its two-stage interval, and the across-seed
    spread (sd and range of the seeds' own accuracies)."""
    import polars as pl

    rows = []
    for (method, rollout), _ in evals.group_by("method", "rollout", maintain_order=True):
        seeds, x = outcome_matrix(evals, method, rollout)
        if x.size == 0 or not np.isfinite(x).all():
            continue
        mean, lo, hi = hierarchical_interval(x, n_boot)
        spread = seed_spread(x)
        rows.append({"method": method, "rollout": int(rollout), "seeds": len(seeds), "problems": x.shape[1],
                     "accuracy": mean, "lo": lo, "hi": hi, "seed_sd": spread["sd"], "seed_min": spread["min"],
                     "seed_max": spread["max"]})  # fmt: skip
    return pl.DataFrame(rows).sort("method", "rollout") if rows else pl.DataFrame()


def paired_difference(evals, method: str, reference: str, rollout: int, n_boot: int = N_BOOT):
    """(difference, lo, hi, seeds): accuracy of ``method`` minus ``reference`` after ``rollout`` rollouts, paired
    by training seed and problem over the seeds both have; NaNs and 0 seeds when they share none."""
    sa, _ = outcome_matrix(evals, method, rollout)
    sb, _ = outcome_matrix(evals, reference, rollout)
    shared = sorted(set(sa) & set(sb))
    if not shared:
        return float("nan"), float("nan"), float("nan"), 0
    _, a = outcome_matrix(evals, method, rollout, shared)
    _, b = outcome_matrix(evals, reference, rollout, shared)
    if a.shape != b.shape:
        raise ValueError(f"{method} and {reference}: different problems at rollout {rollout}")
    return (*hierarchical_interval(a - b, n_boot), len(shared))


def verdict(method: str, lo: float, hi: float, paper_methods=("reweight", "lopti"), effects=None) -> str:
    """The rule of VERDICT_TEXT; ``effects``: the paper's value per method (default `PAPER_EFFECTS`)."""
    effects = PAPER_EFFECTS if effects is None else effects
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "no data"
    if lo > 0:
        return "reproduced" if method in paper_methods else "better than GRPO"
    if hi < 0:
        return "reversed" if method in paper_methods else "worse than GRPO"
    if method in paper_methods and method in effects and hi < effects[method]:
        return "paper's effect excluded; sign not resolved"
    return "not resolved at this size"


def differences_table(evals, pairs, rollout: int, n_boot: int = N_BOOT, paper_methods=("reweight", "lopti"),
                      baseline: str = "grpo", effects=None):  # fmt: skip
    """One row per (method, reference) of ``pairs``: the paired difference after ``rollout`` rollouts, its interval,
    the seeds it pairs and the verdict (against ``baseline``, GRPO; ``effects`` as in `verdict`) or the side of 0 it
    lies on (other references)."""
    import polars as pl

    rows = []
    for method, reference in pairs:
        d, lo, hi, n = paired_difference(evals, method, reference, rollout, n_boot)
        if n == 0:
            continue
        if n < 2:  # an interval over the problems of one training run says nothing about training
            word = ONE_SEED
        elif reference == baseline:
            word = verdict(method, lo, hi, paper_methods, effects)
        else:
            word = "above 0" if lo > 0 else "below 0" if hi < 0 else "holds 0"
        rows.append({"method": method, "minus": reference, "rollout": rollout, "seeds": n, "difference": d,
                     "lo": lo, "hi": hi, "verdict": word})  # fmt: skip
    return pl.DataFrame(rows) if rows else pl.DataFrame()
