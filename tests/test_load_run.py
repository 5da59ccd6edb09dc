"""`tokendyn.load_run`: a run directory as its config and a LazyFrame per record kind; the reader `tokendyn figures`
goes through, with one error type for a path that is not a run."""

from __future__ import annotations

import json

import polars as pl
import pytest

import tokendyn
from tokendyn.figures.data import load_runs
from tokendyn.records import SCHEMAS, RecordWriter

BOUND = {"step": 1, "stage": "train", "rank": 0, "micro": 0, "point": "final_norm.out", "point_index": 0, "n": 3,
         "ratio_min": 1.0, "ratio_max": 2.0, "spearman": None, "nonfinite": 0, "unreached": 0, "direct_n": 0,
         "direct_ratio_min": None, "direct_ratio_max": None, "direct_spearman": None}  # fmt: skip


def _bound(step: int) -> dict:
    cols = {c: [] for c in SCHEMAS["bound"]}
    for k, v in {**BOUND, "step": step}.items():
        cols[k].append(v)
    return {"bound": cols}


def test_a_run_reads_as_config_and_lazy_frames(tmp_path):
    (tmp_path / "run.json").write_text(
        json.dumps({"method": "GRPO + Lopti(eta=0.5)", "config": {"lopti_eta": 0.5}})
    )
    RecordWriter(tmp_path, rank=0).add(_bound(1))
    RecordWriter(tmp_path, rank=1).add(_bound(1))  # a second rank's shard is merged in
    RecordWriter(tmp_path, rank=0).add(_bound(2))
    pl.DataFrame({"step": [1, 2], "reward": [0.1, 0.3]}).write_parquet(tmp_path / "metrics.parquet")
    run = tokendyn.load_run(tmp_path)
    assert run.method == "GRPO + Lopti(eta=0.5)" and run.config["lopti_eta"] == 0.5
    assert run.kinds == ("bound", "metrics")
    bound = run["bound"]
    assert isinstance(bound, pl.LazyFrame)
    assert sorted(bound.collect()["step"].to_list()) == [1, 1, 2]
    assert bound.collect_schema() == pl.Schema(SCHEMAS["bound"])
    assert run["metrics"].collect()["reward"].to_list() == [0.1, 0.3]
    assert run["binstats"].collect().height == 0  # a kind the run lacks: no rows, its full schema
    assert run["binstats"].collect_schema() == pl.Schema(SCHEMAS["binstats"])
    assert set(run.frames()) == {"bound", "metrics"}
    with pytest.raises(KeyError, match="unknown record kind 'bnds'"):
        run["bnds"]


def test_not_a_run_directory(tmp_path):
    with pytest.raises(tokendyn.analysis.RunDirError, match="does not exist"):
        tokendyn.load_run(tmp_path / "nope")
    with pytest.raises(tokendyn.analysis.RunDirError, match="is not a run directory"):
        tokendyn.load_run(tmp_path)
    with pytest.raises(tokendyn.analysis.RunDirError, match="is not a run directory"):
        load_runs([tmp_path])  # the figures' loader checks through load_run


def test_figures_read_the_same_frames(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"method": "GRPO"}))
    RecordWriter(tmp_path, rank=0).add(_bound(4))
    records = load_runs([tmp_path])
    want = tokendyn.load_run(tmp_path)["bound"].collect()
    assert records.get("bound").drop("run").equals(want)
    assert records.labels == ["GRPO"]
