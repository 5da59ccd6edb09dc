"""The command line as a user meets it: --version, `python -m tokendyn`, a suggestion for a mistyped command, a short
`train --help` with tokendyn's flags first, one-line errors, --threads on every computing command, a default --out
for figures, and a training bar with the reward on it instead of printed log dicts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import tokendyn
from tokendyn import cli
from tokendyn.cli import main


def test_version_and_python_dash_m(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tokendyn {tokendyn.__version__}"
    done = subprocess.run(
        [sys.executable, "-m", "tokendyn", "--version"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == f"tokendyn {tokendyn.__version__}"


@pytest.mark.parametrize(
    ("typed", "meant"), [("trian", "train"), ("figure", "figures"), ("analyse", "analyze")]
)
def test_a_mistyped_command_gets_a_suggestion(typed, meant, capsys):
    assert main([typed]) == 2
    err = capsys.readouterr().err
    assert f"did you mean {meant!r}?" in err and len(err.strip().splitlines()) == 1


def test_an_unrelated_word_gets_the_list_of_commands(capsys):
    assert main(["xyzzy"]) == 2
    err = capsys.readouterr().err
    assert "did you mean" not in err and "commands: demo, train" in err


def test_train_help_lists_tokendyn_flags_first_and_trl_behind_help_all(capsys):
    assert main(["train", "--help"]) == 0
    short = capsys.readouterr().out
    flags = [line.split()[0] for line in short.splitlines() if line.startswith("  --")]
    assert flags[0] == "--model_name_or_path"  # RunArguments, then the remedies and the probe, then TRL's
    assert flags.index("--lopti_eta") < flags.index("--probe_every") < flags.index("--learning_rate")
    assert "--threads" in flags and "--gradient_accumulation_steps" not in flags
    # 360 before the three arith_* flags, 380 before both camps (logp_reweight_c, w_reinforce_lambda, the comparison's
    # inner steps and c / eta sweeps), ~415 with the measured step precision, 424 with the lr sweep's limit named
    # and the vLLM engine's settings in the epilog, ~435 with the spike trigger; the rules' own parameters (dppo_tv_delta, ...) and the vLLM
    # engine's settings are --help-all's only, and TRL's / transformers' ~1,240 lines
    assert len(short.splitlines()) < 440 and "--help-all" in short
    assert "--vllm_dtype" not in flags and "lr -> 0 limit" in " ".join(short.split())
    assert "--dppo_tv_delta" not in flags and "--logp_reweight_c" in flags
    assert main(["train", "--help-all"]) == 0
    full = capsys.readouterr().out
    assert "--gradient_accumulation_steps" in full and len(full.splitlines()) > len(short.splitlines()) + 1000
    assert "--vllm_dtype" in full and "--vllm_enforce_eager" in full


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--lopti_order", "middle"],
        ["train", "--lopti_eta"],
        ["train", "--threads", "0"],
        ["analyze", "--threads", "x", "run"],
        ["figures"],
    ],
)
def test_errors_are_one_line_without_the_usage_block(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "usage:" not in err, err


def test_every_computing_command_takes_threads():
    parser = cli.build_parser()
    for name in cli.THREADED:
        if name in cli.PASSTHROUGH:
            from tokendyn.trainers.train_cli import parse

            assert parse(["--threads", "2"])[0].threads == 2
            continue
        action = next(
            a for a in parser._subparsers._group_actions[0].choices[name]._actions if a.dest == "threads"
        )
        assert action.type is cli.positive_int, name


def test_threads_size_the_pools_before_and_after_torch_is_imported(monkeypatch):
    for var in cli.THREAD_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    before = torch.get_num_threads()
    try:
        assert cli.threads_from_argv(["probe", "--threads=1", "x"]) == 1
        assert cli.threads_from_argv(["probe", "--threads", "nope"]) is None
        cli.set_threads(1)
        assert torch.get_num_threads() == 1
        assert all(__import__("os").environ[v] == "1" for v in cli.THREAD_VARIABLES)
        # a fresh interpreter started with --threads: torch is imported after the variables are set
        code = (
            "import sys, tokendyn.cli as c; c.set_threads(c.threads_from_argv(sys.argv[1:])); import torch; "
        )
        code += "print(torch.get_num_threads())"
        env = {k: v for k, v in __import__("os").environ.items() if k not in cli.THREAD_VARIABLES}
        done = subprocess.run(
            [sys.executable, "-c", code, "--threads", "1"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert done.stdout.strip() == "1", done.stderr
    finally:
        torch.set_num_threads(before)


def test_figures_default_out(tmp_path):
    from tokendyn.figures.cli import default_out

    a, b = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    assert default_out([str(a)]) == a.resolve() / "figures"
    assert default_out([str(a), str(b)]) == (tmp_path / "runs").resolve() / "figures"


def test_train_shows_one_bar_with_the_reward_and_no_log_dicts(tiny_model_dir, tmp_path, capfd):
    out = tmp_path / "run"
    argv = ["train", "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out), "--people", "3"]
    argv += ["--train_puzzles_per_size", "4", "--eval_n", "0", "--rollouts", "2", "--save_strategy", "no"]
    argv += ["--per_device_train_batch_size", "4", "--num_generations", "4", "--steps_per_generation", "1"]
    argv += ["--max_completion_length", "6", "--threads", "1"]
    before = torch.get_num_threads()
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(before)
    captured = capfd.readouterr()
    assert "{'loss'" not in captured.out + captured.err
    assert "Loading weights" not in captured.err  # transformers' per-file bars are off
    assert "reward=" in captured.err and "acc=" in captured.err and "2/2" in captured.err
    assert f"run directory: {out}" in captured.out


def test_dependency_warnings_are_dropped_and_tokendyns_shown_on_one_line():
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        cli.quiet_dependencies()
        warnings.warn_explicit("renamed", FutureWarning, "x.py", 1, module="transformers.configuration_utils")
        warnings.warn_explicit("experimental", UserWarning, "y.py", 2, module="trl.trainer.grpo_trainer")
        warnings.warn_explicit(
            "too long\n  for the model", UserWarning, "r.py", 3, module="tokendyn.trainers.runner"
        )
    assert [str(w.message) for w in seen] == ["too long\n  for the model"]
    shown = cli.one_line_warning(seen[0].message, UserWarning, "r.py", 3)
    assert shown == "warning: too long for the model\n"
