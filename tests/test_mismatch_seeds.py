"""The sampler's mismatch over a study's runs (`tokendyn.analysis.mismatch_seeds`) against plain numpy on the same
token columns: the pooled per-bin statistics, the least-squares slope through 0, one row per token for a two-stage
run, and the interval's two stages (constant units give a point; seeds that differ widen it)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from tokendyn.analysis.mismatch import EDGES
from tokendyn.analysis.mismatch_seeds import mismatch_over_seeds, sampler_rows, slope_over_seeds
from tokendyn.records import write_parquet


def _frame(rng, steps=(0, 4), n=60, scale=0.05, stage="train"):
    parts = []
    for step in steps:
        p = rng.uniform(0.02, 0.999, n)
        rho = rng.normal(0.0, scale, n) * (1 - p) * 4
        masked = rng.uniform(size=n) < 0.1
        parts.append(pl.DataFrame({"step": [step] * n, "stage": [stage] * n, "logp_old": np.log(p),
                                   "logp_sampler": np.log(p) - rho, "log_rho": rho, "is_weight": np.where(masked, 0.0, 1.0),
                                   "seq_masked": masked}))  # fmt: skip
    return pl.concat(parts)


def test_pooled_statistics_and_slope_equal_numpy_on_the_tokens():
    rng = np.random.default_rng(0)
    frames = {s: _frame(rng) for s in range(3)}
    table = mismatch_over_seeds(frames, n_boot=300)
    all_ = pl.concat(frames.values())
    p, lr = np.exp(all_["logp_old"].to_numpy()), all_["log_rho"].to_numpy()
    b = np.clip(np.searchsorted(EDGES, p, side="right") - 1, 0, len(EDGES) - 2)
    for k in range(-1, len(EDGES) - 1):
        sel = np.ones_like(p, bool) if k < 0 else b == k
        row = table.filter(pl.col("bin") == k).row(0, named=True)
        assert row["count"] == sel.sum() and row["seeds"] == 3 and row["steps"] == 6
        assert row["abs_mean"] == pytest.approx(np.abs(lr[sel]).mean(), rel=1e-12)
        assert row["mean_log_rho"] == pytest.approx(lr[sel].mean(), rel=1e-9, abs=1e-15)
        assert row["frac_seq_masked"] == pytest.approx(all_["seq_masked"].to_numpy()[sel].mean(), rel=1e-12)
        assert row["per_one_minus_pi"] == pytest.approx(np.abs(lr[sel]).sum() / (1 - p[sel]).sum(), rel=1e-12)
        assert row["abs_mean_lo"] <= row["abs_mean"] <= row["abs_mean_hi"]
    x, y = 1 - p, np.abs(lr)
    want = np.linalg.lstsq(x[:, None], y, rcond=None)[0][0]
    slope, lo, hi = slope_over_seeds(frames, n_boot=300)
    assert slope == pytest.approx(want, rel=1e-10) and lo <= slope <= hi


def test_identical_units_give_a_point_and_differing_seeds_an_interval():
    rng = np.random.default_rng(1)
    one = _frame(rng, steps=(0,))
    same = {s: pl.concat([one, one.with_columns(pl.lit(4, dtype=pl.Int64).alias("step"))]) for s in range(3)}
    row = mismatch_over_seeds(same, n_boot=200).filter(pl.col("bin") == -1).row(0, named=True)
    assert row["abs_mean_lo"] == pytest.approx(row["abs_mean"]) == pytest.approx(row["abs_mean_hi"])
    wide = {0: _frame(rng, scale=0.01), 1: _frame(rng, scale=0.1), 2: _frame(rng, scale=0.3)}
    row = mismatch_over_seeds(wide, n_boot=400).filter(pl.col("bin") == -1).row(0, named=True)
    assert row["abs_mean_hi"] - row["abs_mean_lo"] > 0.2 * row["abs_mean"]


def test_a_two_stage_run_counts_each_token_once(tmp_path):
    rng = np.random.default_rng(2)
    low = _frame(rng, steps=(0,), stage="low")
    high = low.with_columns(pl.lit("high").alias("stage"))
    later = _frame(rng, steps=(2,), stage="high")  # a step whose first stage recorded is "high"
    (tmp_path / "records").mkdir()
    for k, df in enumerate((low, high, later)):
        write_parquet(df, tmp_path / "records" / f"sampler-rank000-{k:06d}.parquet")
    rows = sampler_rows(tmp_path)
    assert rows.height == low.height + later.height
    assert rows.filter(pl.col("step") == 0)["stage"].unique().to_list() == ["low"]
    assert sampler_rows(tmp_path / "missing").height == 0
