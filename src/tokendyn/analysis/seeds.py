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
    "Each difference is the method's held-out accuracy minus the base's at the same training seed and problem, over "
    "the seeds both have (a seed only one of them has is left out and listed under unpaired). Four checks: the 95 % "
    "two-stage bootstrap interval (lo, hi: seeds, then problems within each seed); the seed-level paired "
    "t-interval (t_lo, t_hi: per seed the mean over problems of method minus base, t on seeds - 1 degrees of "
    "freedom); the seeds whose difference has the sign of the mean (agree); the paired t-test's p, Holm-Bonferroni "
    "adjusted (p_holm) across the family of the holm_m rows of this table that share the base at the same rollout. "
    "A row is resolved only when all four put it on one side of 0 (both intervals exclude 0, p_holm < 0.05, every "
    "seed agrees); a row some checks resolve and others do not reads 'not resolved', naming which. Resolved, for "
    "the paper's remedies: reproduced above 0, reversed below; for the other methods: better / worse than the base. "
    "Paper's effect excluded, sign not resolved: both intervals hold 0 but lie wholly below the paper's effect "
    "(+0.14 Reweight, +0.15 Lopti: 3B on K&K); not resolved at this size: no check resolves. With one training "
    "seed the interval is over the problems alone and says nothing about training: such a row reads 'one seed', "
    "whatever its interval."
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


def _paired(evals, method: str, reference: str, rollout: int):
    """(shared seeds, a, b, seeds of ``method`` only, seeds of ``reference`` only): the outcome matrices of the two
    methods over the seeds both have, rows in the same seed order."""
    sa, _ = outcome_matrix(evals, method, rollout)
    sb, _ = outcome_matrix(evals, reference, rollout)
    shared = sorted(set(sa) & set(sb))
    only_a, only_b = sorted(set(sa) - set(sb)), sorted(set(sb) - set(sa))
    if not shared:
        return shared, None, None, only_a, only_b
    _, a = outcome_matrix(evals, method, rollout, shared)
    _, b = outcome_matrix(evals, reference, rollout, shared)
    if a.shape != b.shape:
        raise ValueError(f"{method} and {reference}: different problems at rollout {rollout}")
    return shared, a, b, only_a, only_b


def paired_difference(evals, method: str, reference: str, rollout: int, n_boot: int = N_BOOT):
    """(difference, lo, hi, seeds): accuracy of ``method`` minus ``reference`` after ``rollout`` rollouts, paired
    by training seed and problem over the seeds both have; NaNs and 0 seeds when they share none."""
    shared, a, b, _, _ = _paired(evals, method, reference, rollout)
    if not shared:
        return float("nan"), float("nan"), float("nan"), 0
    return (*hierarchical_interval(a - b, n_boot), len(shared))


def seed_accuracy_table(evals, rollout: int, order=()):
    """Each method's accuracy per training seed after ``rollout`` rollouts: one row per method (those of ``order``
    first, in its order, then the others sorted), a column s{seed} per seed (null where the method has no run of
    that seed), and the mean over its seeds."""
    import polars as pl

    df = evals.filter(pl.col("rollout") == rollout)
    if df.height == 0:
        return pl.DataFrame()
    per = df.group_by("method", "seed").agg(pl.col("correct").cast(pl.Float64).mean().alias("acc"))
    seeds = sorted(per["seed"].unique().to_list())
    methods = sorted(per["method"].unique().to_list())
    methods = [m for m in order if m in methods] + [m for m in methods if m not in order]
    rows = []
    for m in methods:
        got = dict(per.filter(pl.col("method") == m).select("seed", "acc").iter_rows())
        rows.append({"method": m, **{f"s{s}": got.get(s) for s in seeds}, "seeds": len(got),
                     "mean": float(np.mean(list(got.values())))})  # fmt: skip
    schema = {
        "method": pl.String,
        **{f"s{s}": pl.Float64 for s in seeds},
        "seeds": pl.Int64,
        "mean": pl.Float64,
    }
    return pl.DataFrame(rows, schema=schema)


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
                      baseline: str | None = "grpo", effects=None):  # fmt: skip
    """One row per (method, reference) of ``pairs`` after ``rollout`` rollouts: the paired difference with its
    two-stage bootstrap interval, the seed-level paired t-interval, the seeds that agree in sign, the paired t-test's
    p and its Holm adjustment across the rows sharing a reference (`tokendyn.analysis.seed_tests`), and the verdict
    (VERDICT_TEXT: against ``baseline``, GRPO, with ``effects`` as in `verdict`; other references: the side of 0 it
    lies on, "holds 0" when no check resolves it). Seeds only one method has are left out and listed (unpaired)."""
    import polars as pl

    from tokendyn.analysis import seed_tests as T

    rows = []
    for method, reference in pairs:
        shared, a, b, only_a, only_b = _paired(evals, method, reference, rollout)
        if not shared:
            continue
        d, lo, hi = hierarchical_interval(a - b, n_boot)
        per_seed = (a - b).mean(axis=1)
        t = T.paired_t(per_seed)
        k, n = T.sign_agreement(per_seed)
        unpaired = "; ".join(f"{m}: {', '.join(map(str, ss))}" for m, ss in ((method, only_a), (reference, only_b))
                             if ss)  # fmt: skip
        rows.append({"method": method, "minus": reference, "rollout": rollout, "seeds": n, "difference": d,
                     "lo": lo, "hi": hi, "t_lo": t["lo"], "t_hi": t["hi"], "agree": f"{k}/{n}", "k": k,
                     "p": t["p"], "unpaired": unpaired or None})  # fmt: skip
    for reference in {r["minus"] for r in rows}:
        family = [r for r in rows if r["minus"] == reference]
        for r, p_holm in zip(family, T.holm([r["p"] for r in family]), strict=True):
            r.update(p_holm=p_holm, holm_m=sum(np.isfinite(f["p"]) for f in family))
    for r in rows:
        r["verdict"] = _row_verdict(r, baseline, paper_methods, effects)
        del r["k"]
    if not rows:
        return pl.DataFrame()
    cols = ["method", "minus", "rollout", "seeds", "difference", "lo", "hi", "t_lo", "t_hi", "agree", "p", "p_holm",
            "holm_m", "verdict", "unpaired"]  # fmt: skip
    return pl.DataFrame(rows, schema_overrides={"unpaired": pl.String}).select(cols)


def _row_verdict(r: dict, baseline, paper_methods, effects) -> str:
    """A row's verdict from its four checks (VERDICT_TEXT)."""
    from tokendyn.analysis import seed_tests as T

    n = r["seeds"]
    if n < 2:  # an interval over the problems of one training run says nothing about training
        return ONE_SEED
    sides = T.check_sides(r["lo"], r["hi"], r["t_lo"], r["t_hi"], r["difference"], r["p_holm"], r["k"], n)
    s = T.agreed_side(sides)
    if s is None:
        return T.disagreement(sides, r["p_holm"], r["k"], n)
    if r["minus"] != baseline:
        return {1: "above 0", -1: "below 0", 0: "holds 0"}[s]
    word = verdict(r["method"], r["lo"], r["hi"], paper_methods, effects)
    if word == "paper's effect excluded; sign not resolved":
        both = verdict(r["method"], r["t_lo"], r["t_hi"], paper_methods, effects)
        if both != word:
            return (
                "not resolved at this size (the paper's effect excluded by the bootstrap, not the t-interval)"
            )
    return word
