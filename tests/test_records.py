"""Record files (atomic parquet shards) and the analysis over them (polars), on records of a real probed model."""

from __future__ import annotations

import argparse
import math

import polars as pl
import pytest
import torch
from _models import completion_logps, grpo_loss, make_batch, probed_rows, tiny_qwen2

from tokendyn.analysis import analyze_run, load
from tokendyn.analysis import cli as analysis_cli
from tokendyn.hooks import instrument
from tokendyn.records import SCHEMAS, RecordWriter, shard_files, to_frame

torch.set_num_threads(1)
T = 0.7

# columns that must agree between one process over a batch and two shards over its halves
BIN_COLS = [
    "tokens",
    "share",
    "norm_mean",
    "norm_std",
    "norm_min",
    "norm_p10",
    "norm_p50",
    "norm_p90",
    "norm_max",
    "norm_per_w_mean",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
]
BOUND_COLS = ["n", "C", "ratio_mean", "D"]
CHECK_COLS = [
    "n_checked",
    "logits_violations",
    "head_n",
    "head_violations",
    "logits_ratio_min",
    "logits_ratio_max",
    "head_ratio_max",
]


def assert_frames_close(
    a: pl.DataFrame, b: pl.DataFrame, keys: list[str], cols: list[str], rtol: float = 1e-5
):
    a, b = a.sort(keys), b.sort(keys)
    assert a.select(keys).equals(b.select(keys))
    for c in cols:
        for x, y in zip(a[c].to_list(), b[c].to_list(), strict=True):
            if x is None or y is None:
                assert x is None and y is None, c
            elif isinstance(x, int):
                assert x == y, c
            else:
                assert x == pytest.approx(y, rel=rtol, abs=1e-12), c


def test_writer_is_atomic_per_rank_and_never_overwrites(tmp_path):
    cols = {c: [] for c in SCHEMAS["bound"]}
    row = {
        "step": 1,
        "stage": "train",
        "rank": 0,
        "micro": 0,
        "point": "final_norm.out",
        "point_index": 0,
        "n": 3,
        "ratio_min": 1.0,
        "ratio_max": 2.0,
        "spearman": None,
        "nonfinite": 0,
        "unreached": 0,
        "direct_n": 0,
        "direct_ratio_min": None,
        "direct_ratio_max": None,
        "direct_spearman": None,
    }
    for k, v in row.items():
        cols[k].append(v)
    w0 = RecordWriter(tmp_path, rank=0, flush_every=2)
    w0.add({"bound": cols})
    assert shard_files(tmp_path, "bound") == []  # buffered until the 2nd add
    w0.add({"bound": cols})
    w1 = RecordWriter(tmp_path, rank=1)
    w1.add({"bound": cols})
    w0b = RecordWriter(tmp_path, rank=0)  # a resumed writer continues the numbering
    w0b.add({"bound": cols})
    names = [f.name for f in shard_files(tmp_path, "bound")]
    assert names == [
        "bound-rank000-000000.parquet",
        "bound-rank000-000001.parquet",
        "bound-rank001-000000.parquet",
    ]
    assert [f.name for f in (tmp_path / "records").iterdir() if f.name.startswith(".")] == []  # no temp files
    assert pl.read_parquet(shard_files(tmp_path, "bound")[0]).height == 2
    with pytest.raises(ValueError, match="missing \\['n'\\]"):
        to_frame("bound", {k: v for k, v in cols.items() if k != "n"})
    with pytest.raises(ValueError, match="unknown kind"):
        to_frame("nope", cols)


def test_two_shards_merge_into_the_one_process_table(tmp_path):
    model = tiny_qwen2(sharpen=30.0)
    batch = make_batch(model, n=8)
    for bins in (None, [0.0, 0.1, 0.9, 1.0]):  # quantile edges need the all-reduce: test_probe_distributed
        one, two = tmp_path / f"one-{bins}", tmp_path / f"two-{bins}"
        probed_rows(model, batch, slice(0, 8), one, rank=0, bins=bins)
        probed_rows(model, batch, slice(0, 4), two, rank=0, bins=bins)
        probed_rows(model, batch, slice(4, 8), two, rank=1, bins=bins)
        assert len(shard_files(two, "binstats")) == 2
        a, b = analyze_run(one), analyze_run(two)
        assert_frames_close(a["bins"], b["bins"], ["stage", "point", "bin"], BIN_COLS)
        assert_frames_close(a["bound"], b["bound"], ["stage", "point"], BOUND_COLS)
        assert_frames_close(a["checks"], b["checks"], ["stage"], CHECK_COLS)
        assert a["checks"]["micro_batches"].to_list() == [1] and b["checks"]["micro_batches"].to_list() == [2]
    # the per-bin table is also consistent with the raw statistics: shares sum to 1 per point
    shares = a["bins"].group_by("point").agg(pl.col("share").sum())["share"].to_list()
    assert all(s == pytest.approx(1.0) for s in shares)


def test_instrumented_loop_records_and_analysis(tmp_path):
    model = tiny_qwen2(sharpen=30.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    with pytest.raises(KeyboardInterrupt):
        with instrument(
            model, tmp_path, bins=[0.0, 0.5, 0.500001, 1.0], temperature=T, sample_tokens=5
        ) as probe:
            for step in range(4):
                batch = make_batch(model, seed=step)
                out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
                logps = completion_logps(out.logits, batch, T)
                probe.begin_step(
                    completion_mask=batch.completion_mask,
                    advantages=batch.advantages,
                    completion_ids=batch.completion_ids,
                    logps=logps,
                    temperature=T,
                )
                if step == 3:
                    raise KeyboardInterrupt  # interrupted before the backward of step 3
                grpo_loss(logps, logps.detach(), batch.advantages, batch.completion_mask).backward()
                opt.step()
                opt.zero_grad()
    assert all(len(m._forward_hooks) == 0 for m in model.modules())
    tables = analyze_run(tmp_path)
    assert sorted(load(tmp_path, "checks").collect()["step"].to_list()) == [0, 1, 2]
    assert (tmp_path / "analysis" / "bins.parquet").exists() and (
        tmp_path / "analysis" / "bound.parquet"
    ).exists()
    tokens = load(tmp_path, "tokens").collect()
    assert (
        tokens.group_by("step").agg(pl.col("row").len())["row"].to_list() == [5 * 3] * 3
    )  # 5 tokens x 3 points
    bins = tables["bins"]
    # an empty bin gives nulls and a zero share, never an error
    empty = bins.filter(pl.col("tokens") == 0)
    assert empty.height > 0
    assert (
        empty["norm_mean"].null_count() == empty.height and empty["share"].to_list() == [0.0] * empty.height
    )
    # the per-bin mean equals the mean over the raw records, pooled over steps
    raw = (
        load(tmp_path, "binstats")
        .filter((pl.col("quantity") == "norm") & (pl.col("point") == "final_norm.out"))
        .group_by("bin")
        .agg(pl.col("sum").sum(), pl.col("count").sum())
        .collect()
        .sort("bin")
    )
    mine = bins.filter(pl.col("point") == "final_norm.out").sort("bin")
    for s, c, m in zip(raw["sum"], raw["count"], mine["norm_mean"], strict=True):
        assert (m is None and c == 0) or m == pytest.approx(s / c)
    assert tables["checks"]["logits_violations"].to_list() == [0]
    assert tables["checks"]["head_violations"].to_list() == [0]
    by_step = analyze_run(tmp_path, by_step=True, write=False)["bins"]
    assert sorted(by_step["step"].unique().to_list()) == [0, 1, 2]


def test_quantiles_of_the_histogram_bracket_the_raw_tokens(tmp_path):
    model = tiny_qwen2(sharpen=30.0)
    batch = make_batch(model, n=8)
    probed_rows(model, batch, slice(0, 8), tmp_path, rank=0, bins="intervals:1")
    row = (
        analyze_run(tmp_path, write=False)["bins"]
        .filter(pl.col("point") == "final_norm.out")
        .row(0, named=True)
    )
    assert row["norm_min"] <= row["norm_p10"] <= row["norm_p50"] <= row["norm_p90"] <= row["norm_max"]
    # with one bin the median of the histogram lies within one log cell (10^0.25) of the exact median
    tokens = load(tmp_path, "tokens").filter(pl.col("point") == "final_norm.out").collect()
    assert tokens.height == row["tokens"]  # the sample (128) holds every token
    exact = float(tokens["norm"].median())
    assert abs(math.log10(row["norm_p50"] / exact)) <= 0.25 + 1e-9


def test_cli_analyze(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="tokendyn")
    analysis_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["analyze", str(tmp_path / "missing")])
    assert args.func(args) == 2 and "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    args = parser.parse_args(["analyze", str(tmp_path / "empty")])
    assert args.func(args) == 2 and "no binstats records" in capsys.readouterr().err
    model = tiny_qwen2(sharpen=30.0)
    probed_rows(model, make_batch(model), slice(0, 6), tmp_path / "run", rank=0)
    args = parser.parse_args(
        ["analyze", str(tmp_path / "run"), "--steps", "0:5", "--out", str(tmp_path / "out")]
    )
    assert args.steps == (0, 5)
    assert analysis_cli.run(args) == 0
    out = capsys.readouterr().out
    assert "violations of the exact checks: 0" in out and "wrote" in out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "bins.parquet",
        "bound.parquet",
        "checks.parquet",
        "diagnostics.parquet",
    ]
    with pytest.raises(SystemExit):
        parser.parse_args(["analyze", str(tmp_path), "--steps", "x"])
