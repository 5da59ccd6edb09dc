"""`tokendyn probe`'s `sampler` records: a rollouts file carries the sampler's log-probs but no importance weight, so
the rows hold the file's log mu and log pi_old per scored token and leave ``is_weight`` and ``seq_masked`` null
(unknown), and `tokendyn analyze`'s mismatch table reads them as unknown, not as "weight 1, nothing masked"."""

from __future__ import annotations

import math

import polars as pl
import torch
from _models import tiny_qwen2

from tokendyn.analysis.report import analyze_run
from tokendyn.hooks.offline import probe_rollouts

torch.set_num_threads(1)

OLD = [[-0.5, -1.0, -2.0, -0.1], [-0.3, -0.2, 0.0, 0.0]]
MU = [[-0.6, -0.9, -2.5, -0.1], [-0.2, -0.4, 0.0, 0.0]]
LOSS = [[1, 0, 1, 1], [1, 1, 0, 0]]


def test_offline_sampler_rows_leave_the_weights_unknown(tmp_path):
    pl.DataFrame(
        {"prompt_ids": [[5, 6, 7], [0, 8, 9]], "prompt_mask": [[1, 1, 1], [0, 1, 1]],
         "completion_ids": [[10, 11, 12, 13], [14, 15, 0, 0]], "completion_mask": [[1, 1, 1, 1], [1, 1, 0, 0]],
         "loss_mask": LOSS, "advantage": [1.0, -0.5], "old_logp": OLD, "sampler_logp": MU}
    ).write_parquet(tmp_path / "r.parquet")  # fmt: skip
    probe_rollouts(tiny_qwen2(sharpen=4.0), None, tmp_path / "r.parquet", tmp_path / "run", analyses="none")
    rows = pl.read_parquet(sorted((tmp_path / "run" / "records").glob("sampler-*.parquet"))).sort(
        "row", "pos"
    )
    scored = [(r, t) for r in range(2) for t in range(4) if LOSS[r][t]]
    assert [(r, p) for r, p in rows.select("row", "pos").iter_rows()] == scored
    for column, want in (("logp_old", OLD), ("logp_sampler", MU)):
        assert all(
            math.isclose(a, want[r][t], abs_tol=1e-7) for a, (r, t) in zip(rows[column], scored, strict=True)
        )
    assert rows["is_weight"].null_count() == rows["seq_masked"].null_count() == rows.height == 5
    mismatch = analyze_run(tmp_path / "run", write=False)["mismatch"]
    for column in ("mean_weight", "frac_masked", "frac_seq_masked"):
        assert mismatch[column].null_count() == mismatch.height > 0, column
    every = mismatch.filter((pl.col("side") == "pi_old") & (pl.col("bin") == -1)).row(0, named=True)
    rho = [OLD[r][t] - MU[r][t] for r, t in scored]
    assert math.isclose(every["abs_mean"], sum(map(abs, rho)) / 5, rel_tol=1e-6)
