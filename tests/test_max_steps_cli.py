"""`tokendyn train`'s run length: an explicit --max_steps with --rollouts left at its default trains max_steps
optimizer steps; --rollouts and --max_steps both given is a one-line error naming both fields."""

from __future__ import annotations

import polars as pl
import pytest
import torch

from tokendyn.cli import main

SMALL = ["--people", "3", "--train_puzzles_per_size", "4", "--eval_n", "0", "--save_strategy", "no"]
SMALL += ["--per_device_train_batch_size", "4", "--num_generations", "4", "--steps_per_generation", "1"]
SMALL += ["--max_completion_length", "4", "--disable_tqdm", "true"]


def test_an_explicit_max_steps_sets_the_length_of_the_run(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    argv = ["train", "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out), *SMALL]
    before = torch.get_num_threads()
    try:
        assert main([*argv, "--max_steps=2"]) == 0
    finally:
        torch.set_num_threads(before)
    steps = pl.read_parquet(out / "metrics.parquet").get_column("step").drop_nulls()
    assert steps.max() == 2  # not the 15 rollouts of --rollouts' default


@pytest.mark.parametrize("config", [False, True])
def test_rollouts_and_max_steps_both_given_is_one_line_naming_both(tiny_model_dir, tmp_path, capsys, config):
    out = tmp_path / "run"
    argv = ["train", "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out), *SMALL]
    argv += ["--rollouts", "3"]
    if config:  # a field of the --config file counts as given
        (tmp_path / "run.yaml").write_text("max_steps: 5\n", encoding="utf-8")
        argv += ["--config", str(tmp_path / "run.yaml")]
    else:
        argv += ["--max_steps", "5"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rollouts" in err and "max_steps" in err, err
    assert "rollouts=3" in err and "max_steps=5" in err
    assert not out.exists()  # rejected before any work


def test_the_length_flags_parse_as_documented():
    from tokendyn.trainers.runner import apply_rollouts
    from tokendyn.trainers.train_cli import parse

    def length(*argv):
        run, cfg = parse(list(argv))
        apply_rollouts(run, cfg)
        return run.rollouts, cfg.max_steps

    assert length() == (15, 30)  # default: 15 rollouts of 2 optimizer steps
    assert length("--max_steps", "7") == (0, 7)
    assert length("--max_step", "7") == (0, 7)  # argparse's abbreviation is the same flag
    assert length("--rollouts", "4") == (4, 8)
    assert length("--rollouts", "0", "--max_steps", "7") == (0, 7)
