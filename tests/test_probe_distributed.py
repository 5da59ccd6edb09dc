"""Two CPU processes (torchrun, gloo): each probes half of a batch and writes its own shard; the analysis merges
the shards into the same tables as one process over the whole batch (STACK_NOTES §8).

Run by pytest, this file launches itself under `torchrun --nproc_per_node 2`; as a script it is the worker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import torch

HERE = Path(__file__).resolve().parent
BINS = {"intervals": None, "quantiles": "quantiles:3"}


def _model_and_batch():
    from _models import make_batch, tiny_qwen2

    model = tiny_qwen2(sharpen=30.0)
    return model, make_batch(model, n=8)


def worker(out_dir: str) -> None:
    import torch.distributed as dist
    from _models import probed_rows

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2
    model, batch = _model_and_batch()
    half = batch.input_ids.shape[0] // world
    for name, bins in BINS.items():
        probed_rows(
            model, batch, slice(rank * half, (rank + 1) * half), Path(out_dir) / name, rank=None, bins=bins
        )
    dist.barrier()
    dist.destroy_process_group()


def test_two_processes_write_two_shards_that_merge_into_the_one_process_tables(tmp_path):
    from _models import probed_rows
    from test_records import BIN_COLS, BOUND_COLS, CHECK_COLS, assert_frames_close

    from tokendyn.analysis import analyze_run
    from tokendyn.hooks.records import shard_files

    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        __file__,
        str(tmp_path / "two"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    torch.set_num_threads(1)
    model, batch = _model_and_batch()
    for name, bins in BINS.items():
        probed_rows(model, batch, slice(0, 8), tmp_path / "one" / name, rank=0, bins=bins)
        two = tmp_path / "two" / name
        assert [f.name for f in shard_files(two, "binstats")] == [
            "binstats-rank000-000000.parquet",
            "binstats-rank001-000000.parquet",
        ]
        a, b = analyze_run(tmp_path / "one" / name), analyze_run(two)
        n_tokens = int(batch.completion_mask.sum())
        assert a["bins"].filter(pl.col("point") == "final_norm.out")["tokens"].sum() == n_tokens
        assert_frames_close(a["bins"], b["bins"], ["stage", "point", "bin"], [*BIN_COLS, "bin_lo", "bin_hi"])
        assert_frames_close(a["bound"], b["bound"], ["stage", "point"], BOUND_COLS)
        assert_frames_close(a["checks"], b["checks"], ["stage"], CHECK_COLS)
        assert b["checks"]["micro_batches"].to_list() == [2]
        assert b["checks"]["logits_violations"].to_list() == [0] and b["checks"][
            "head_violations"
        ].to_list() == [0]
    # quantile edges are shared by the ranks (all-reduced histogram) and are not the fixed intervals
    edges = (
        analyze_run(tmp_path / "two" / "quantiles", write=False)["bins"]["bin_hi"].unique().sort().to_list()
    )
    assert len(edges) == 3 and edges[-1] == 1.0 and edges[0] not in (0.25, 0.5)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    worker(sys.argv[1])
