"""The packaged real LLM (``--model smollm2-135m``, `tokendyn.packaged`) through the command lines that take a model,
offline: `tokendyn probe` and `tokendyn eval` resolve the name once, for the config, the tokenizer and the
weights, so nothing is asked of the Hugging Face hub; and a name that cannot be a model fails at once, in one line
naming the flag, instead of retrying the network.

Each command runs in a subprocess with ``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1`` and an empty ``HF_HOME``
(nothing can come from the hub or its cache). The model is converted from the package's GGUF into the tokendyn cache
once by the ``smollm2_dir`` fixture (first time ~20-70 s, later a checksum of the 98 MB file, ~0.5 s); measured on
2 CPU cores shared with other work, one thread: the probe ~9 s, the eval ~10 s, a wrong name ~4 s (mostly
importing torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from tokendyn import packaged

# the README's text columns (prompt, completion, reward, group): two groups of two completions
ROWS = [
    {"prompt": "What is 2 + 3?", "completion": "2 + 3 = 5.", "reward": 1.0, "group": 0},
    {"prompt": "What is 2 + 3?", "completion": "It is 6.", "reward": 0.0, "group": 0},
    {"prompt": "Name a colour.", "completion": "Blue.", "reward": 1.0, "group": 1},
    {"prompt": "Name a colour.", "completion": "A dog.", "reward": 0.0, "group": 1},
]
TYPO = "smollm2-135"  # one letter short of the packaged name: no directory, no .gguf, no owner/name


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """The packaged model's converted directory (converted here, so that no subprocess below pays for it)."""
    return Path(packaged.resolve("smollm2-135m"))


def _env(tmp_path: Path, offline: bool = True) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "empty_hf_home"))
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        env.pop(key, None)
    if offline:
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def _tokendyn(args: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tokendyn", *args, "--threads", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def _rollouts(tmp_path: Path) -> Path:
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


@pytest.mark.slow
def test_probe_runs_the_packaged_model_offline(smollm2_dir, tmp_path):
    """`tokendyn probe --model smollm2-135m` offline: the text rows are tokenized by SmolLM2's own tokenizer (the
    cache directory's) and probed on its weights. --sample_sequences 0: the probe alone, no rebalancing analyses
    (they would add ~10 s on 2 CPU cores and 1 GB for the float64 copy; the entry point is what is tested here)."""
    from tokendyn.policy import load_tokenizer

    out = tmp_path / "run"
    args = ["probe", "--model", "smollm2-135m", "--rollouts", str(_rollouts(tmp_path)), "--out", str(out)]
    proc = _tokendyn([*args, "--temperature", "1.0", "--sample_sequences", "0"], _env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "huggingface.co" not in proc.stderr
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "finished" and meta["rows"] == 4
    assert (meta["model"], meta["model_path"]) == ("smollm2-135m", str(smollm2_dir))
    # every completion token counted, as SmolLM2's tokenizer splits the completions
    tok = load_tokenizer(smollm2_dir)
    expected = sum(len(tok(text=row["completion"], add_special_tokens=False)["input_ids"]) for row in ROWS)
    assert meta["tokens"] == expected
    checks = pl.read_parquet(next((out / "records").glob("checks-*.parquet")))
    assert checks["vocab_size"].to_list() == [49152]  # the real model's head, not a stand-in
    assert (checks["identity_violations"] == 0).all() and (checks["head_violations"] == 0).all()
    tokens = pl.read_parquet(next((out / "records").glob("tokens-*.parquet")))
    assert tokens.height > 0 and tokens["token_id"].max() < 49152


@pytest.mark.slow
def test_eval_runs_the_packaged_model_offline(smollm2_dir, tmp_path):
    """`tokendyn eval --model smollm2-135m` offline at the smallest size: one 2-person puzzle, greedy (144 new
    tokens at most)."""
    out = tmp_path / "e.parquet"
    args = ["eval", "--model", "smollm2-135m", "--people", "2", "--n", "1", "--modes", "greedy"]
    proc = _tokendyn([*args, "--batch_size", "1", "--out", str(out)], _env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = pl.read_parquet(out).to_dicts()
    assert [(r["model"], r["people"], r["mode"], r["n"]) for r in rows] == [("smollm2-135m", 2, "greedy", 1)]
    assert 0.0 <= rows[0]["accuracy"] <= 1.0


@pytest.mark.slow
@pytest.mark.slow_tier  # the slow tier: `make test-slow`
def test_train_runs_the_packaged_model_offline(smollm2_dir, tmp_path):
    """`tokendyn train --model_name_or_path smollm2-135m --task arith` offline, one rollout at the smallest batch
    (2 sums x 2 samples, 4 new tokens, no evaluation, the probe on): the run's model is the packaged one, its records
    the real head's (V = 49,152)."""
    out = tmp_path / "run"
    args = ["train", "--model_name_or_path", "smollm2-135m", "--task", "arith", "--arith_digits", "1",
            "--rollouts", "1", "--per_device_train_batch_size", "4", "--num_generations", "2",
            "--steps_per_generation", "1", "--max_completion_length", "4", "--eval_n", "0", "--probe_every", "1",
            "--probe_sample_sequences", "0", "--save_strategy", "no", "--output_dir", str(out)]  # fmt: skip
    proc = _tokendyn(args, _env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "huggingface.co" not in proc.stderr
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "finished" and meta["model"] == "smollm2-135m"
    checks = pl.read_parquet(next((out / "records").glob("checks-*.parquet")))
    assert checks["vocab_size"].unique().to_list() == [49152]


@pytest.mark.parametrize(
    "command,offline,field",
    [("probe", True, "--model"), ("probe", False, "--model"), ("eval", False, "model")],
    ids=["probe-offline", "probe-default-env", "eval-default-env"],
)
def test_a_wrong_model_name_fails_at_once_in_one_line(command, offline, field, tmp_path):
    """A typo of the packaged name: exit 2 and one line naming the flag, before any request to the hub. Without
    HF_HUB_OFFLINE (and without a network) the old check asked the hub for it: 5 retries, ~27 s."""
    if command == "probe":
        args = [
            "probe",
            "--model",
            TYPO,
            "--rollouts",
            str(_rollouts(tmp_path)),
            "--out",
            str(tmp_path / "o"),
        ]
    else:
        args = ["eval", "--model", TYPO, "--people", "2", "--n", "1", "--out", str(tmp_path / "e.parquet")]
    start = time.monotonic()
    proc = _tokendyn(args, _env(tmp_path, offline=offline), timeout=120)
    seconds = time.monotonic() - start
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(
        f"tokendyn {command}: error: {field}: '{TYPO}' is neither a local directory"
    ), lines
    assert "smollm2-135m" in lines[0] and "owner/name" in lines[0]
    assert seconds < 20, f"{seconds:.1f} s"  # importing torch; no network retry
    assert not (tmp_path / "o").exists() and not (tmp_path / "e.parquet").exists()


def test_only_names_that_cannot_be_a_model_fail_fast(tiny_model_dir, tmp_path):
    """The bare-name check refuses a name without an owner only when the local hub cache lacks it: a legacy bare id
    downloaded earlier (here a fake cache entry ``tinyqwen``, the tiny model's config) still passes, offline."""
    hub = tmp_path / "empty_hf_home" / "hub" / "models--tinyqwen"
    commit = "0" * 40
    (hub / "refs").mkdir(parents=True)
    (hub / "refs" / "main").write_text(commit)
    (hub / "snapshots" / commit).mkdir(parents=True)
    (hub / "snapshots" / commit / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    script = (
        "from tokendyn.policy import check_model_source\n"
        "print(check_model_source('tinyqwen', 'model').model_type)\n"
        "try:\n"
        f"    check_model_source({TYPO!r}, 'model')\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=_env(tmp_path), timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "qwen2",
        f"model: '{TYPO}' is neither a local directory, a .gguf file, a packaged model (smollm2-135m) nor a hub id "
        "(owner/name)",
    ]


def _python(code: str, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.mark.real_llm_extra
def test_the_real_llm_demo_runs_offline(smollm2_dir, tmp_path):
    """`tokendyn demo --policy smollm2-135m`'s entry point offline, at a toy size (one rollout of 2 sums x 2 samples
    per run, 4 new tokens, 2 held-out sums): three runs of the packaged model and the report."""
    out = tmp_path / "demo"
    code = (
        "import torch; torch.set_num_threads(1)\n"
        "from tokendyn.commands.demo import LLM_QUICK, demo, with_size\n"
        "size = with_size(LLM_QUICK, eval_n=2, kk_histogram=0, probe_sample_sequences=4)\n"
        "toy = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=4, disable_tqdm=True)\n"
        f"print(demo({str(out)!r}, policy='smollm2-135m', size=size, overrides=toy))\n"
    )
    proc = _python(code, _env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "huggingface.co" not in proc.stderr
    for name in ("grpo", "reweight", "lopti"):
        meta = json.loads((out / name / "run.json").read_text())
        assert meta["status"] == "finished" and meta["model"] == "smollm2-135m"
    assert (out / "figures" / "report.html").is_file()


@pytest.mark.real_llm_extra
def test_the_real_llm_study_runs_offline(smollm2_dir, tmp_path):
    """`tokendyn study --policy smollm2-135m --quick` offline for one method and seed (one rollout of the study's
    8 x 4 sums, 2 held-out sums), then its report from the folder alone."""
    out, work = tmp_path / "study", tmp_path / "work"
    argv = [
        "study",
        "--policy",
        "smollm2-135m",
        "--quick",
        "--methods",
        "grpo",
        "--seeds",
        "0",
        "--eval-n",
        "2",
    ]
    proc = _tokendyn([*argv, "--out", str(out), "--work", str(work)], _env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "huggingface.co" not in proc.stderr
    done = json.loads((out / "runs" / "grpo-s0" / "study_done.json").read_text())
    assert done["study"]["model"] == "smollm2-135m" and (out / "study.md").is_file()
    assert not list(out.rglob("*.safetensors"))


def test_model_path_gives_other_stacks_the_packaged_models_directory(smollm2_dir, tmp_path):
    """`tokendyn model-path smollm2-135m` offline prints the converted directory (what verl's
    actor_rollout_ref.model.path takes); a typo fails in one line naming the field."""

    def model_path(name: str) -> subprocess.CompletedProcess:  # no --threads: the command computes nothing
        cmd = [sys.executable, "-m", "tokendyn", "model-path", name]
        return subprocess.run(cmd, capture_output=True, text=True, env=_env(tmp_path), timeout=120)

    proc = model_path("smollm2-135m")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(smollm2_dir) and (smollm2_dir / "config.json").is_file()
    bad = model_path(TYPO)
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and "model: 'smollm2-135' is neither" in lines[0]
