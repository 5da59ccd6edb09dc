"""The sampler's mismatch over a study's runs (`tokendyn.analysis.mismatch_seeds`) against plain numpy on the same
token columns: the pooled per-bin statistics, the least-squares slope through 0, one row per token for a two-stage
run, and the interval's two stages (constant units give a point; seeds that differ widen it)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch

from tokendyn.analysis.mismatch import EDGES, mismatch_table
from tokendyn.analysis.mismatch_seeds import (
    SamplerRecordsError,
    mismatch_over_seeds,
    sampler_rows,
    slope_over_seeds,
)
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


def _write_sampler(run, frames):
    (run / "records").mkdir(parents=True, exist_ok=True)
    for k, df in enumerate(frames):
        write_parquet(df, run / "records" / f"sampler-rank000-{k:06d}.parquet")


def test_a_broken_run_stops_the_seed_table_in_one_line_naming_it(tmp_path):
    """A shard that cannot be read, or rows without log rho, are a one-line `SamplerRecordsError` naming the file or
    the column, never an empty frame that drops the run from the table."""
    rng = np.random.default_rng(3)
    _write_sampler(tmp_path / "torn", [_frame(rng, steps=(0,))])
    torn = tmp_path / "torn" / "records" / "sampler-rank000-000001.parquet"
    torn.write_bytes(b"PAR1 torn")  # a shard cut short (a killed writer)
    with pytest.raises(SamplerRecordsError) as err:
        sampler_rows(tmp_path / "torn")
    assert str(torn) in str(err.value) and "\n" not in str(err.value)
    _write_sampler(tmp_path / "holes", [_frame(rng, steps=(0,)).with_columns(pl.lit(None).alias("log_rho"))])
    with pytest.raises(SamplerRecordsError, match=r"without log_rho \(60 rows\)") as err:
        sampler_rows(tmp_path / "holes")
    assert "\n" not in str(err.value)


def test_unknown_seq_masked_is_null_not_zero():
    """Rows whose weights were not recorded (the offline probe's: null is_weight and seq_masked) give a null share
    in masked sequences, beside the log rho statistics over the same tokens."""
    rng = np.random.default_rng(4)
    frames = {s: _frame(rng).with_columns(pl.lit(None, dtype=pl.Boolean).alias("seq_masked"),
                                          pl.lit(None, dtype=pl.Float64).alias("is_weight")) for s in range(2)}  # fmt: skip
    table = mismatch_over_seeds(frames, n_boot=50)
    assert table["frac_seq_masked"].null_count() == table.height
    assert table["frac_seq_masked_hi"].null_count() == table.height
    lr = pl.concat(frames.values())["log_rho"].to_numpy()
    assert table.filter(pl.col("bin") == -1)["abs_mean"][0] == pytest.approx(np.abs(lr).mean(), rel=1e-12)
    pooled = mismatch_table(pl.concat(frames.values()))
    for column in ("mean_weight", "frac_masked", "frac_seq_masked"):
        assert pooled[column].null_count() == pooled.height, column


def test_analyze_counts_a_two_stage_runs_tokens_once(tmp_path):
    """`tokendyn analyze`'s mismatch table of a Lopti run (each micro-batch's sampler rows recorded in stage low
    and stage high) holds each token once, as the seed table does: numpy over the tokens of one stage."""
    from _models import make_batch, tiny_qwen2

    from tokendyn import instrument
    from tokendyn.analysis.report import analyze_run

    run = tmp_path / "run"
    model = tiny_qwen2(sharpen=4.0)
    batch = make_batch(model, n=2, sample=False)
    with instrument(model, run, rank=0) as probe:
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        z = out.logits[:, -batch.c - 1 : -1].float()
        logps = torch.log_softmax(z, -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
        probe.begin_step(step=0, completion_mask=batch.completion_mask, advantages=batch.advantages,
                         completion_ids=batch.completion_ids, logps=logps)  # fmt: skip
        (-(logps * batch.advantages.unsqueeze(1) * batch.completion_mask).sum()).backward()
        probe.end_step()
    low = _frame(np.random.default_rng(5), steps=(0,), stage="low")
    _write_sampler(run, [low, low.with_columns(pl.lit("high").alias("stage"))])
    table = analyze_run(run, write=False)["mismatch"]
    every = table.filter((pl.col("side") == "pi_old") & (pl.col("bin") == -1)).row(0, named=True)
    lr = low["log_rho"].to_numpy()
    assert every["count"] == low.height
    assert every["abs_mean"] == pytest.approx(np.abs(lr).mean(), rel=1e-12)
    seeds = mismatch_over_seeds({0: sampler_rows(run)}, n_boot=20).filter(pl.col("bin") == -1)
    assert seeds["count"][0] == every["count"]
