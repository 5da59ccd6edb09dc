"""The sampler's records and their per-bin table: `tokendyn.hooks.sampler.sampler_frame` on hand-made batches (TRL's
keys, each importance-sampling shape) and `tokendyn.analysis.mismatch.mismatch_table` against a plain numpy
recomputation from the token columns, bin edges included."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
import torch

from tokendyn.analysis.mismatch import EDGES, mismatch_table
from tokendyn.hooks.sampler import sampler_frame


def _batch(weight: torch.Tensor | None) -> dict:
    old = torch.log(torch.tensor([[0.9, 0.5, 0.1], [0.3, 0.99, 0.6]]))
    mu = torch.log(torch.tensor([[0.8, 0.5, 0.2], [0.3, 0.98, 0.5]]))
    batch = {
        "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        "old_per_token_logps": old,
        "sampling_per_token_logps": mu,
    }
    if weight is not None:
        batch["importance_sampling_ratio"] = weight
    return batch


def test_sampler_rows_read_the_trainers_tensors():
    frame = sampler_frame(_batch(torch.tensor([[1.5], [0.0]])), step=3, stage="train", micro=1, rank=0)
    assert (
        frame.height == 5
        and frame["step"].unique().to_list() == [3]
        and frame["micro"].unique().to_list() == [1]
    )
    assert frame.select("row", "pos").rows() == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]  # padding left out
    assert np.allclose(frame["log_rho"], frame["logp_old"] - frame["logp_sampler"], rtol=0, atol=0)
    assert math.isclose(frame["log_rho"][0], math.log(0.9 / 0.8), rel_tol=1e-6)
    # a sequence mode's weight, (B, 1): broadcast to the row's tokens; row 1 masked whole
    assert frame["is_weight"].to_list() == [1.5, 1.5, 1.5, 0.0, 0.0]
    assert frame["seq_masked"].to_list() == [False, False, False, True, True]


def test_a_token_modes_single_masked_token_is_not_a_masked_sequence():
    weight = torch.tensor([[1.0, 0.0, 1.2], [0.0, 0.0, 1.0]])  # row 1: both valid tokens masked, padding's 1
    frame = sampler_frame(_batch(weight), step=0, stage="low", micro=0, rank=1)
    assert frame["is_weight"].to_list() == pytest.approx([1.0, 0.0, 1.2, 0.0, 0.0], rel=1e-6)
    assert frame["seq_masked"].to_list() == [False, False, False, True, True]
    no_correction = sampler_frame(_batch(None), step=0, stage="train", micro=0, rank=0)
    assert no_correction["is_weight"].to_list() == [1.0] * 5 and not no_correction["seq_masked"].any()


def test_no_sampler_logprobs_no_rows():
    batch = _batch(None)
    del batch["sampling_per_token_logps"]
    assert sampler_frame(batch, step=0, stage="train", micro=0, rank=0) is None


def _random_frame(n: int, seed: int) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    pi = rng.beta(0.6, 0.4, n)
    pi[:2] = 1.0  # certain tokens: no envelope
    logp_old = np.log(pi)
    log_rho = rng.normal(0.0, 0.05, n) * (1 - pi) + rng.normal(0, 1e-3, n)
    logp_mu = np.minimum(logp_old - log_rho, 0.0)
    log_rho = logp_old - logp_mu
    weight = np.where(rng.random(n) < 0.1, 0.0, np.exp(log_rho))
    return pl.DataFrame(
        {"step": np.zeros(n, dtype=np.int64), "stage": ["train"] * n, "rank": np.zeros(n, dtype=np.int32),
         "micro": np.zeros(n, dtype=np.int32), "row": np.arange(n, dtype=np.int32) // 7,
         "pos": np.arange(n, dtype=np.int32) % 7, "logp_old": logp_old, "logp_sampler": logp_mu,
         "log_rho": log_rho, "is_weight": weight, "seq_masked": weight == 0.0}
    )  # fmt: skip


def _bins(p: np.ndarray) -> np.ndarray:
    return np.minimum(np.searchsorted(np.asarray(EDGES), p, side="right") - 1, len(EDGES) - 2)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_per_bin_table_is_a_plain_recomputation_from_the_token_columns(seed):
    frame = _random_frame(2000, seed)
    table = mismatch_table(frame.lazy())
    assert table["side"].unique().sort().to_list() == ["mu", "pi_old"]
    for side, col in (("pi_old", "logp_old"), ("mu", "logp_sampler")):
        p = np.exp(frame[col].to_numpy())
        bins = _bins(p)
        rows = table.filter(pl.col("side") == side)
        assert rows["count"].sum() == 2 * frame.height  # the bins and the "all" row
        for b in range(-1, 4):
            sel = np.ones_like(bins, dtype=bool) if b < 0 else bins == b
            r = rows.filter(pl.col("bin") == b).row(0, named=True)
            rho = frame["log_rho"].to_numpy()[sel]
            w = frame["is_weight"].to_numpy()[sel]
            pi_old = np.exp(frame["logp_old"].to_numpy()[sel])
            assert r["count"] == sel.sum() and math.isclose(r["token_share"], sel.mean())
            assert math.isclose(r["mean_log_rho"], rho.mean(), rel_tol=1e-9, abs_tol=1e-15)
            for q in (50, 95, 99):
                assert math.isclose(r[f"abs_p{q}"], np.percentile(np.abs(rho), q), rel_tol=1e-9), (side, b, q)
            keep = pi_old < 1
            assert math.isclose(r["envelope"], (np.abs(rho[keep]) / (1 - pi_old[keep])).max(), rel_tol=1e-9)
            assert math.isclose(r["mean_weight"], w.mean(), rel_tol=1e-9)
            assert math.isclose(r["frac_masked"], (w == 0).mean()) and math.isclose(
                r["frac_seq_masked"], (w == 0).mean()
            )


def test_bins_are_half_open_and_the_last_closed():
    from tokendyn.analysis.mismatch import _bin_expr

    p = pl.DataFrame({"p": [0.0, 0.2499, 0.25, 0.5, 0.74, 0.75, 0.999, 1.0]})
    got = p.select(_bin_expr(pl.col("p"), EDGES).alias("b"))["b"].to_list()
    assert got == [0, 0, 1, 2, 2, 3, 3, 3]


def test_no_records_no_table():
    assert mismatch_table(pl.DataFrame()).height == 0


def test_live_scalars_are_the_tables_pi_old_rows():
    from tokendyn.hooks.live import analysis_metrics

    frame = _random_frame(500, 3)
    live = analysis_metrics("sampler", frame)
    table = mismatch_table(frame).filter(pl.col("side") == "pi_old")
    assert live["probe/sampler/mean_log_rho/all"] == table.filter(pl.col("bin") == -1)["mean_log_rho"][0]
    for b in range(4):
        row = table.filter(pl.col("bin") == b).row(0, named=True)
        assert live[f"probe/sampler/abs_p99/bin{b}"] == row["abs_p99"]
        assert live[f"probe/sampler/frac_seq_masked/bin{b}"] == row["frac_seq_masked"]
    floor = analysis_metrics("floor", frame)  # the trainer against itself: the same table, its own names
    assert floor["probe/floor/abs_mean/all"] == table.filter(pl.col("bin") == -1)["abs_mean"][0]
    assert not any(k.startswith("probe/sampler/") for k in floor)
