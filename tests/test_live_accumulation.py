"""Live probe metrics of a step made of several micro-batches (gradient accumulation): the logged token shares and
checks are those of all the step's micro-batches, as the records on disk hold them, not the last micro-batch's."""

from __future__ import annotations

import polars as pl
import pytest
import torch
from test_live import _scalars, vowel_reward

import tokendyn
from tokendyn.hooks.live import LiveProbeMetrics
from tokendyn.trainers.runner import train
from tokendyn.trainers.train_cli import parse

pytest.importorskip("tensorboard")  # a dev dependency (pyproject.toml)


def _run(model_dir, out):
    argv = ["--model_name_or_path", str(model_dir), "--output_dir", str(out), "--people", "3"]
    argv += ["--train_puzzles_per_size", "4", "--eval_n", "0", "--rollouts", "2", "--save_strategy", "no"]
    argv += ["--per_device_train_batch_size", "4", "--num_generations", "4"]
    argv += ["--gradient_accumulation_steps", "2"]
    argv += ["--max_completion_length", "12", "--temperature", "1.0", "--disable_tqdm", "true"]
    argv += ["--probe_every", "1", "--probe_flush_seconds", "0", "--probe_sample_sequences", "0"]
    argv += ["--report_to", "tensorboard"]
    before = torch.get_num_threads()
    try:
        train(*parse(argv), progress=False, reward=vowel_reward)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def accumulated_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ga2") / "run"
    _run(tiny_model_dir, out)
    return out


def test_live_token_shares_and_checks_are_the_whole_steps(accumulated_run):
    tb = _scalars(accumulated_run)
    run = tokendyn.load_run(accumulated_run)
    norms = (
        run["binstats"]
        .filter((pl.col("quantity") == "norm") & (pl.col("point") == "final_norm.out") & (pl.col("bin") >= 0))
        .collect()
    )
    checks = run["checks"].collect()
    assert sorted(norms["micro"].unique().to_list()) == [0, 1]  # two micro-batches per optimizer step
    for step in sorted(norms["step"].unique().to_list()):
        rows = norms.filter(pl.col("step") == step)
        counts = dict(rows.group_by("bin").agg(pl.col("count").sum()).iter_rows())
        last_rows = rows.filter(pl.col("micro") == rows["micro"].max())
        last = dict(last_rows.group_by("bin").agg(pl.col("count").sum()).iter_rows())
        total, last_total = sum(counts.values()), sum(last.values())
        # the last micro-batch alone has other shares: the test tells the step's apart from the last micro-batch's
        assert any(abs(counts.get(k, 0) / total - last.get(k, 0) / last_total) > 1e-3 for k in counts)
        for k in range(4):
            assert tb[f"train/probe/token_share/bin{k}"][step + 1] == pytest.approx(
                counts.get(k, 0) / total, rel=1e-5, abs=1e-7
            )
        c = checks.filter(pl.col("step") == step)
        assert c.height == 2
        violations = float(c["logits_violations"].sum() + c["head_violations"].sum())
        assert tb["train/probe/bound_violations"][step + 1] == violations
        assert tb["train/probe/identity_max_rel_err"][step + 1] == pytest.approx(
            float(c["identity_max_rel_err"].max()), rel=1e-6
        )


def test_live_checks_sum_violations_and_take_the_largest_error_over_micro_batches(accumulated_run):
    """The step's two `checks` records as the run wrote them, each given a count of violations and an error: the
    live values are their sum and their maximum, and a new step starts afresh."""
    checks = tokendyn.load_run(accumulated_run)["checks"].collect().sort("step", "micro")
    first = checks.filter(pl.col("step") == 0)
    live = LiveProbeMetrics(accumulated_run)
    for micro, (violations, err) in enumerate([(2, 0.5), (1, 0.25)]):
        row = first.filter(pl.col("micro") == micro).with_columns(
            pl.lit(violations).cast(first["logits_violations"].dtype).alias("logits_violations"),
            pl.lit(err).alias("identity_max_rel_err"),
        )
        live.collect({"checks": row})
    assert live.pending["probe/bound_violations"] == 3.0
    assert live.pending["probe/identity_max_rel_err"] == 0.5
    live.collect({"checks": checks.filter((pl.col("step") == 1) & (pl.col("micro") == 1))})
    assert live.pending["probe/bound_violations"] == 0.0
