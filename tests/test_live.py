"""Live probe metrics through --report_to: a real tiny run writes TensorBoard event files, read back here with
TensorBoard's own reader and checked against the records the same run wrote to disk."""

from __future__ import annotations

import polars as pl
import pytest
import torch

import tokendyn
from tokendyn.trainers.runner import train
from tokendyn.trainers.train_cli import parse

pytest.importorskip("tensorboard")  # a dev dependency (pyproject.toml)


def vowel_reward(completions, **kwargs):
    """A reward that differs within a group (the tiny model never answers a K&K puzzle: zero advantages)."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


def _scalars(logdir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for events in sorted(logdir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def test_tensorboard_gets_the_probe_numbers(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    argv = ["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out), "--people", "3"]
    argv += ["--train_puzzles_per_size", "4", "--eval_n", "0", "--rollouts", "2", "--save_strategy", "no"]
    argv += ["--per_device_train_batch_size", "4", "--num_generations", "4", "--steps_per_generation", "1"]
    argv += ["--max_completion_length", "6", "--temperature", "1.0", "--disable_tqdm", "true"]
    argv += ["--probe_every", "1", "--probe_sample_sequences", "4", "--probe_flush_seconds", "0"]
    argv += ["--probe_analyses", "shares,prob_change"]
    argv += ["--report_to", "tensorboard"]
    before = torch.get_num_threads()
    try:
        train(*parse(argv), progress=False, reward=vowel_reward)
    finally:
        torch.set_num_threads(before)
    tb = _scalars(out)  # transformers writes the events under output_dir
    assert "train/reward" in tb  # TRL's own scalars are there too
    shares = {t: v for t, v in tb.items() if t.startswith("train/probe/token_share/bin")}
    assert len(shares) == 4  # the paper's four bins
    steps = sorted(next(iter(shares.values())))
    assert steps == [1, 2]
    for s in steps:  # the token shares of a step sum to 1 over the bins
        assert sum(v[s] for v in shares.values() if s in v) == pytest.approx(1.0, abs=1e-6)
    assert all(v == 0 for v in tb["train/probe/bound_violations"].values())
    assert max(tb["train/probe/identity_max_rel_err"].values()) < 1e-3
    # against the records on disk: the final point's token counts per bin at the first probed step
    run = tokendyn.load_run(out)
    b = run["binstats"].filter((pl.col("quantity") == "norm") & (pl.col("point") == "final_norm.out"))
    counts = b.filter(pl.col("step") == 0).group_by("bin").agg(pl.col("count").sum()).collect()
    total = counts["count"].sum()
    for k, c in counts.iter_rows():
        assert tb[f"train/probe/token_share/bin{k}"][1] == pytest.approx(c / total, rel=1e-5)
    upd = [v for t, v in tb.items() if t.startswith("train/probe/update_share/bin")]
    assert upd and sum(v[min(v)] for v in upd) == pytest.approx(1.0, abs=1e-4)  # s_b sums to 1
    assert any(t.startswith("train/probe/correct_pos/bin") for t in tb)
