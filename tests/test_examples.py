"""Every script in examples/ runs as written (short settings, in this process with runpy: the file's own
``__main__`` block), and its run directory holds what the script promises: the records of every kind, read back
through `tokendyn.load_run`."""

from __future__ import annotations

import json
import runpy
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import torch

import tokendyn

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PROBE_KINDS = {"binstats", "hist", "bound", "checks", "tokens"}
ANALYSIS_KINDS = {"shares", "prob_change", "influence"}


def _run(script: str, *argv: str, monkeypatch) -> float:
    monkeypatch.setattr(sys, "argv", [script, *argv])
    before = torch.get_num_threads()
    t0 = time.time()
    try:
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    finally:
        torch.set_num_threads(before)
    return time.time() - t0


def test_every_example_has_a_test():
    tested = {"custom_loop.py", "trl_script.py", "verl_rollouts.py", "verl_actor.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_custom_loop_on_a_local_gpt2_gets_every_figure(tmp_path, monkeypatch, capsys):
    out = tmp_path / "loop"
    _run("custom_loop.py", "--out", str(out), "--steps", "3", monkeypatch=monkeypatch)
    run = tokendyn.load_run(out)
    assert run.method == "GRPO (custom loop)"
    assert PROBE_KINDS | ANALYSIS_KINDS | {"metrics"} <= set(run.kinds)
    assert run["metrics"].select("step").collect()["step"].to_list() == [1, 2, 3]
    # the update shares s_b of each step sum to 1 over the bins (g = sum_b g_b)
    shares = run["shares"].filter((pl.col("group") == "all") & (pl.col("bin") >= 0)).collect()
    sums = shares.group_by("step").agg(pl.col("share").sum())["share"].to_list()
    assert len(sums) == 3 and all(abs(s - 1) < 1e-6 for s in sums)
    printed = capsys.readouterr().out
    assert "report:" in printed
    from tokendyn.figures.report import FIGURES

    figures = {p.stem for p in (out / "figures").glob("*.png")}
    # every figure but those of the paired comparison (an option of the trainer and of tokendyn probe, not of this
    # loop): the paired differences, both camps and the c / eta axis
    # and the sampler's (a TRL trainer's floor and vLLM sampler records)
    assert figures == {spec.name for spec in FIGURES if not {"paired", "sampler"} & set(spec.kinds)}
    assert {"h_paired", "h_both_camps", "h_axis"} <= {spec.name for spec in FIGURES}


def test_trl_script_swaps_in_the_tokendyn_trainer(tmp_path, monkeypatch):
    out = tmp_path / "trl"
    _run("trl_script.py", "--out", str(out), "--steps", "3", monkeypatch=monkeypatch)
    run = tokendyn.load_run(out)
    assert run.config["lopti_eta"] == 0.5 and run.config["advantage_reweight_alpha"] == 0.3
    assert PROBE_KINDS | ANALYSIS_KINDS | {"metrics"} <= set(run.kinds)
    stages = set(run["binstats"].select("stage").unique().collect()["stage"])
    assert stages == {"low", "high"}  # Lopti's two stages, each probed
    assert run["metrics"].select("lopti/stage1_fraction").collect().drop_nulls().height >= 1


def test_trl_script_samples_with_vllm(tmp_path, monkeypatch):
    out = tmp_path / "trl_vllm"
    from tokendyn.integrations.vllm_cpu import release_engines

    try:
        _run("trl_script.py", "--out", str(out), "--steps", "2", "--use_vllm", monkeypatch=monkeypatch)
    finally:
        release_engines()  # the script's engine goes with the test, as with its process in a real run
    run = tokendyn.load_run(out)
    assert run.config["use_vllm"] is True and run.config["vllm_mode"] == "colocate"
    meta = json.loads((out / "run.json").read_text())
    assert meta["sampler"]["engine"] == "vllm" and meta["sampler"]["dtype"] == "bfloat16"
    assert PROBE_KINDS | ANALYSIS_KINDS | {"metrics"} <= set(run.kinds)
    assert set(run["binstats"].select("stage").unique().collect()["stage"]) == {"low", "high"}


def test_verl_batch_to_rollouts_file_to_probe(tmp_path, monkeypatch):
    out = tmp_path / "verl"
    argv = ("--out", str(out), "--prompts", "2", "--group", "2", "--length", "6")
    _run("verl_rollouts.py", *argv, monkeypatch=monkeypatch)
    rollouts = pl.read_parquet(out.with_suffix(".rollouts.parquet"))
    assert rollouts.height == 4 and len(rollouts["advantage"][0]) == 6
    run = tokendyn.load_run(out)
    assert PROBE_KINDS | ANALYSIS_KINDS <= set(run.kinds)
    tokens = (
        run["binstats"]
        .filter((pl.col("point") == "final_norm.out") & (pl.col("quantity") == "norm"))
        .collect()
    )
    assert int(tokens["count"].sum()) == 4 * 6  # every response token probed once at the final norm
    # norm/|w| and the bound ratio exist only for tokens with w != 0: a nonzero advantage
    nonzero = sum(a != 0 for row in rollouts["advantage"].to_list() for a in row)
    for quantity in ("norm_per_w", "ratio"):
        with_w = run["binstats"].filter(
            (pl.col("point") == "final_norm.out") & (pl.col("quantity") == quantity)
        )
        assert int(with_w.collect()["count"].sum()) == nonzero


def test_verl_actor_runs_lopti_and_the_probe_inside_verls_worker(tmp_path, monkeypatch, capsys):
    out = tmp_path / "verl_actor"
    argv = ("--out", str(out), "--prompts", "2", "--group", "2", "--length", "6", "--updates", "1")
    _run("verl_actor.py", *argv, monkeypatch=monkeypatch)
    run = tokendyn.load_run(out)
    assert run.method == "verl vanilla + Reweight(a=0.3) + Lopti(eta=0.5)"
    assert run.config["lopti_eta"] == 0.5 and run.config["temperature"] == 0.7
    assert PROBE_KINDS | {"shares", "prob_change", "influence"} <= set(run.kinds)
    assert (out / "analysis" / "bins.parquet").is_file()
    tokens = (
        run["binstats"]
        .filter((pl.col("point") == "final_norm.out") & (pl.col("quantity") == "norm"))
        .collect()
    )
    assert sorted(tokens["stage"].unique().to_list()) == ["high", "low"]
    for stage in ("low", "high"):  # every response token probed once per stage at the final norm
        assert int(tokens.filter(pl.col("stage") == stage)["count"].sum()) == 4 * 6
    checks = run["checks"].collect()
    assert int(checks["logits_violations"].sum() + checks["head_violations"].sum()) == 0
    printed = capsys.readouterr().out
    assert "Lopti stage low" in printed and "Lopti stage high" in printed


@pytest.mark.parametrize("script", ["custom_loop.py", "trl_script.py", "verl_rollouts.py", "verl_actor.py"])
def test_examples_state_their_command_and_time(script):
    head = (EXAMPLES / script).read_text().split('"""')[1]
    assert f"python examples/{script}" in head and "s on 2 CPU cores" in head
