"""The sampler's mismatch per probability bin over a study's runs: intervals over training seeds, then probed steps.

A unit is one probed step of one run (its `sampler` rows: every token of the step's probed micro-batches). Per unit u
and pi_old bin b (``EDGES``; b = -1: every token) the sums

    n_ub = #tokens,  a_ub = sum |log rho_t|,  r_ub = sum log rho_t,  m_ub = #tokens in a sequence the correction
    zeroed,  k_ub = #tokens whose seq_masked is known (null: a record that carried no weights, the offline probe's),
    xy_u = sum (1 - pi_old,t) |log rho_t|,  xx_u = sum (1 - pi_old,t)^2

give each statistic as a ratio of sums over the units drawn (so a resample weighs tokens as the pooled table does):

    mean |log rho|_b       = sum_u a_ub / sum_u n_ub
    mean log rho_b         = sum_u r_ub / sum_u n_ub            (signed: the sampler's bias)
    in masked sequences_b  = sum_u m_ub / sum_u k_ub            (null where no token's is known)
    per unit of (1 - pi)_b = mean |log rho|_b / mean (1 - pi_old)_b
    slope                  = sum_u xy_u / sum_u xx_u            (least squares of |log rho| on 1 - pi_old through 0:
                                                                 the (1 - pi) law, DVP arXiv 2512.23087)

with the two-stage percentile interval of `tokendyn.analysis.study.bootstrap_units` (seeds with replacement, then each
drawn seed's probed steps). The pooled p99 of |log rho| and the envelope max |log rho| / (1 - pi_old) are maxima-like
statistics and come without an interval.

A run's rows are read by `sampler_rows`: each token once (`first_stage`), and a run whose sampler records cannot be
read, or hold a row without a value the table needs, stops the table in one line (`SamplerRecordsError`) rather than
leaving the run out: a seed table that quietly loses a seed reports intervals over seeds it does not name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import polars as pl

from tokendyn.analysis.mismatch import EDGES, _bin_expr
from tokendyn.analysis.seeds import N_BOOT
from tokendyn.common import UsageError

REQUIRED = ("step", "stage", "logp_old", "logp_sampler", "log_rho")  # null in none of a run's rows


class SamplerRecordsError(UsageError):
    """A run's `sampler` records cannot be read, or a row lacks a value of `REQUIRED`."""


def unit_sums(frames: Mapping[int, pl.DataFrame], edges: Sequence[float] = EDGES):
    """(seed of each unit, {name: array [units, bins + 1]}) from each seed's `sampler` rows; column 0 is every token
    (bin -1), column b + 1 the bin b."""
    nb = len(edges) - 1
    seeds, parts = [], []
    for seed, frame in sorted(frames.items()):
        if frame.height == 0:
            continue
        df = frame.with_columns(
            pl.col("logp_old").exp().alias("p"),
            pl.col("log_rho").abs().alias("a"),
        ).with_columns(
            _bin_expr(pl.col("p"), edges).alias("bin"),
            (1.0 - pl.col("p")).alias("x"),
        )
        for _, g in df.sort("step").group_by("step", maintain_order=True):
            seeds.append(seed)
            row = {k: np.zeros(nb + 1) for k in ("n", "a", "r", "m", "k", "x")}
            for col, sel in [(0, g)] + [(b + 1, g.filter(pl.col("bin") == b)) for b in range(nb)]:
                row["n"][col] = sel.height
                row["a"][col] = float(sel["a"].sum())
                row["r"][col] = float(sel["log_rho"].sum())
                row["m"][col] = float(sel["seq_masked"].sum())
                row["k"][col] = float(sel["seq_masked"].is_not_null().sum())
                row["x"][col] = float(sel["x"].sum())
            row["xy"] = np.full(nb + 1, float((g["x"] * g["a"]).sum()))
            row["xx"] = np.full(nb + 1, float((g["x"] * g["x"]).sum()))
            parts.append(row)
    if not parts:
        return np.zeros(0, dtype=np.int64), {}
    return np.asarray(seeds), {k: np.vstack([p[k] for p in parts]) for k in parts[0]}


def _ratio(num: np.ndarray, den: np.ndarray, col: int):
    def stat(idx: np.ndarray) -> float:
        d = den[idx, col].sum()
        return float(num[idx, col].sum() / d) if d > 0 else float("nan")

    return stat


def _per_unit_1mp(a: np.ndarray, x: np.ndarray, col: int):
    def stat(idx: np.ndarray) -> float:
        xs = x[idx, col].sum()
        return float(a[idx, col].sum() / xs) if xs > 0 else float("nan")

    return stat


def mismatch_over_seeds(
    frames: Mapping[int, pl.DataFrame], edges: Sequence[float] = EDGES, n_boot: int = N_BOOT
) -> pl.DataFrame:
    """One row per bin (-1: every token) with the module docstring's statistics and their intervals, the seeds and
    probed steps they rest on, and the pooled p99 and envelope; empty without rows."""
    from tokendyn.analysis.mismatch import mismatch_table
    from tokendyn.analysis.study import bootstrap_units

    seeds, v = unit_sums(frames, edges)
    if not v:
        return pl.DataFrame()
    groups = [np.flatnonzero(seeds == s) for s in np.unique(seeds)]
    pooled = mismatch_table(
        pl.concat([f for f in frames.values() if f.height], how="vertical_relaxed"), edges
    )
    pooled = pooled.filter(pl.col("side") == "pi_old")
    rows = []
    for col in range(v["n"].shape[1]):
        b = col - 1
        row = {"bin": b, "seeds": len(groups), "steps": len(seeds), "count": int(v["n"][:, col].sum())}
        if b >= 0:
            row["bin_lo"], row["bin_hi"] = float(edges[b]), float(edges[b + 1])
        for name, stat in (
            ("abs_mean", _ratio(v["a"], v["n"], col)),
            ("mean_log_rho", _ratio(v["r"], v["n"], col)),
            ("frac_seq_masked", _ratio(v["m"], v["k"], col)),
            ("per_one_minus_pi", _per_unit_1mp(v["a"], v["x"], col)),
        ):
            row[name], row[f"{name}_lo"], row[f"{name}_hi"] = bootstrap_units(
                groups, stat, n_boot, min_units=2
            )
        if not v["k"][:, col].sum():  # no token's seq_masked known: unknown, not 0 or NaN
            row["frac_seq_masked"] = row["frac_seq_masked_lo"] = row["frac_seq_masked_hi"] = None
        p = pooled.filter(pl.col("bin") == b)
        row["abs_p99"] = p["abs_p99"][0] if p.height else None
        row["envelope"] = p["envelope"][0] if p.height else None
        rows.append(row)
    return pl.DataFrame(rows)


def slope_over_seeds(frames: Mapping[int, pl.DataFrame], n_boot: int = N_BOOT) -> tuple[float, float, float]:
    """(slope, lo, hi): the least-squares slope of |log rho_t| on 1 - pi_old(t) through 0 (module docstring)."""
    from tokendyn.analysis.study import bootstrap_units

    seeds, v = unit_sums(frames)
    if not v:
        return (float("nan"),) * 3
    groups = [np.flatnonzero(seeds == s) for s in np.unique(seeds)]
    return bootstrap_units(groups, _ratio(v["xy"], v["xx"], 0), n_boot, min_units=2)


def first_stage(df: pl.DataFrame) -> pl.DataFrame:
    """Each token once: a two-stage run (Lopti) records its micro-batches in both stages, the same tokens and
    weights; the rows of the first stage recorded at each step are kept (every row of a one-stage run)."""
    if df.height == 0:
        return df
    first = df.group_by("step").agg(pl.col("stage").first().alias("_first"))
    return df.join(first, on="step").filter(pl.col("stage") == pl.col("_first")).drop("_first")


def _unreadable(run_dir) -> str:
    """The first shard of the run's sampler records whose footer cannot be read, else the records folder."""
    from tokendyn.records import records_dir, shard_files

    for f in shard_files(run_dir, "sampler"):
        try:
            pl.read_parquet_schema(f)
        except (pl.exceptions.PolarsError, OSError):
            return str(f)
    return str(records_dir(run_dir))


def sampler_rows(run_dir) -> pl.DataFrame:
    """A run's `sampler` rows, each token once (`first_stage`); empty when the run has none (no sampler record
    files). Records that cannot be read, or a row without a value of `REQUIRED`: a one-line `SamplerRecordsError`
    naming the file or the column."""
    from tokendyn.analysis.load import load

    try:
        df = load(run_dir, "sampler").collect()
    except (pl.exceptions.PolarsError, OSError) as exc:
        text = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise SamplerRecordsError(
            f"{_unreadable(run_dir)}: the run's sampler records cannot be read ({type(exc).__name__}: {text}); "
            "re-run or remove the run"
        ) from None
    nulls = {c: n for c, n in df.select(pl.col(REQUIRED).null_count()).row(0, named=True).items() if n}
    if nulls:
        which = ", ".join(f"{c} ({n} rows)" for c, n in nulls.items())
        raise SamplerRecordsError(
            f"{run_dir}: sampler rows without {which}; every row needs {', '.join(REQUIRED)}"
        )
    return first_stage(df)
