"""`tokendyn train --resume_from_checkpoint`: a run killed after a checkpoint and resumed from it is the run that was
never interrupted (weights, metrics, every record), for GRPO and for Lopti; checkpoints load in `tokendyn eval`."""

from __future__ import annotations

import json

import polars as pl
import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from tokendyn.cli import main
from tokendyn.records import KINDS, shard_files
from tokendyn.trainers.runner import train
from tokendyn.trainers.train_cli import parse

torch.set_num_threads(1)

# wall-clock columns, and the final row's train_loss (transformers averages it over the steps this process ran)
TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss")


def vowel_reward(completions, **kwargs):
    """A graded reward that differs within a group (the tiny model never writes a valid K&K answer, so the official
    reward is the same for every completion: zero advantages, nothing would be trained)."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


class Killed(Exception):
    """Stands for a kill -9 after a step was logged and recorded, before the next checkpoint."""


class KillAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:  # step `step` is done and logged
            raise Killed


def _argv(model_dir, out, lopti: bool) -> list[str]:
    argv = ["--model_name_or_path", str(model_dir), "--output_dir", str(out), "--people", "3"]
    # GRPO: held-out evaluations at rollouts 0, 3 and 4 (the end), none at the checkpoint (rollout 2)
    evals = ["--eval_n", "0"] if lopti else ["--eval_n", "1", "--eval_steps", "3"]
    argv += ["--train_puzzles_per_size", "8", *evals, "--rollouts", "4", "--save_steps", "2"]
    argv += ["--per_device_train_batch_size", "4", "--num_generations", "4", "--steps_per_generation", "1"]
    argv += ["--max_completion_length", "6", "--temperature", "1.0", "--learning_rate", "1e-3"]
    argv += ["--probe_every", "1", "--probe_sample_sequences", "4", "--probe_analyses", "shares,real_change"]
    # flush every record at once: the worst case for a kill, records after the checkpoint are on disk
    argv += ["--probe_flush_seconds", "0", "--disable_tqdm", "true", "--save_total_limit", "3"]
    return argv + (["--lopti_eta", "0.5"] if lopti else [])


def _run(argv, callbacks=()):
    run_args, cfg = parse(argv)
    return train(run_args, cfg, callbacks=callbacks, progress=False, reward=vowel_reward)


def _records(run_dir) -> dict[str, pl.DataFrame]:
    out = {}
    for kind in KINDS:
        files = shard_files(run_dir, kind)
        if files:
            frame = pl.concat([pl.read_parquet(f) for f in files], how="vertical")
            out[kind] = frame.sort(frame.columns)
    return out


def _max_diff(a: pl.DataFrame, b: pl.DataFrame) -> float:
    """Largest absolute difference between two frames of the same shape (float columns; others must be equal)."""
    assert a.columns == b.columns and a.height == b.height
    worst = 0.0
    for c in a.columns:
        if a[c].dtype.is_float():
            x, y = a[c].to_numpy(), b[c].to_numpy()
            both_nan = (x != x) & (y != y)
            d = abs(x - y)
            d[both_nan] = 0.0
            worst = max(worst, float(d.max()) if len(d) else 0.0)
        else:
            assert a[c].to_list() == b[c].to_list(), c
    return worst


@pytest.mark.parametrize("lopti", [False, True], ids=["grpo", "lopti"])
def test_resumed_run_equals_the_uninterrupted_run(tiny_model_dir, tmp_path, lopti, capsys):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    _run(_argv(tiny_model_dir, whole, lopti))
    per = 2 if lopti else 1  # optimizer steps per rollout; checkpoints every 2 rollouts
    with pytest.raises(Killed):
        _run(_argv(tiny_model_dir, cut, lopti), callbacks=[KillAt(2 * per + 1)])
    assert (cut / f"checkpoint-{2 * per}").is_dir()
    steps_before = pl.read_parquet(cut / "metrics.parquet")["step"].max()
    assert (
        steps_before == 2 * per + 1
    )  # the killed run got past its checkpoint: that step must not count twice
    after = [f for k in KINDS for f in shard_files(cut, k) if pl.read_parquet(f)["step"].max() >= 2 * per]
    assert {f.name.split("-rank")[0] for f in after} >= {"binstats", "tokens", "shares"}

    _run([*_argv(tiny_model_dir, cut, lopti), "--resume_from_checkpoint", "true"])
    meta = json.loads((cut / "run.json").read_text())
    assert meta["status"] == "finished" and meta["resumed_from"] == [str(cut / f"checkpoint-{2 * per}")]

    # weights: bit for bit
    a, b = load_file(whole / "final" / "model.safetensors"), load_file(cut / "final" / "model.safetensors")
    weight_diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    # metrics: every logged step once, the same values (timings aside)
    ma, mb = (pl.read_parquet(d / "metrics.parquet") for d in (whole, cut))
    drop = [c for c in ma.columns if c in TIMING]
    ma, mb = ma.drop(drop), mb.drop([c for c in mb.columns if c in TIMING])
    steps = 4 * per
    logged = [*range(1, steps + 1), steps]  # + the final summary
    if not lopti:
        heldout = ma.filter(pl.col("heldout/accuracy").is_not_null())["step"].to_list()
        assert heldout == [0, 3, 4] == mb.filter(pl.col("heldout/accuracy").is_not_null())["step"].to_list()
        logged = sorted([*logged, *heldout])  # each evaluation is a row of its own
    assert mb["step"].to_list() == ma["step"].to_list() == logged
    assert ma["loss"].abs().max() > 0 and ma["reward_std"].max() > 0  # something was trained
    metric_diff = _max_diff(ma.select(sorted(ma.columns)), mb.select(sorted(mb.columns)))
    # records: the same rows of every kind, none twice
    ra, rb = _records(whole), _records(cut)
    assert set(ra) == set(rb) and {"binstats", "tokens", "shares", "prob_change"} <= set(ra)
    record_diff = max(_max_diff(ra[k], rb[k]) for k in ra)
    print(
        f"resume ({'lopti' if lopti else 'grpo'}): max |diff| weights {weight_diff:.3g}, metrics {metric_diff:.3g}, "
        f"records {record_diff:.3g}"
    )
    assert weight_diff == 0.0 and metric_diff == 0.0 and record_diff == 0.0
    if lopti:
        assert set(ra["binstats"]["stage"].unique()) == {"low", "high"}
    else:
        # a finished run has nothing to resume: refused before any work, the run left as it was
        assert main(["train", *_argv(tiny_model_dir, whole, lopti), "--resume_from_checkpoint", "true"]) == 2
        assert "nothing to resume" in capsys.readouterr().err
        assert pl.read_parquet(whole / "metrics.parquet")["step"].to_list() == logged
        assert max(_max_diff(ra[k], _records(whole)[k]) for k in ra) == 0.0
        # checkpoints are policies `tokendyn eval` loads (weights and tokenizer)
        table = tmp_path / "eval.parquet"
        argv = [
            "eval",
            "--model",
            str(cut / "checkpoint-4"),
            "--people",
            "3",
            "--n",
            "1",
            "--modes",
            "greedy",
        ]
        assert main([*argv, "--out", str(table)]) == 0
        assert pl.read_parquet(table)["model"].to_list() == [str(cut / "checkpoint-4")]


def test_checkpoints_evaluate_and_bad_resume_paths_fail_first(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    argv = _argv(tiny_model_dir, out, lopti=False)
    missing = tmp_path / "nope" / "checkpoint-9"
    assert main(["train", *argv, "--resume_from_checkpoint", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "resume_from_checkpoint:" in err and "does not exist" in err
    assert main(["train", *argv, "--resume_from_checkpoint", "true"]) == 2
    assert "holds no checkpoint-N folder" in capsys.readouterr().err
    assert not out.exists()  # nothing was created by the rejected commands
