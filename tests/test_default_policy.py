"""The shipped embedded default loads and still scores what its warmstart.json says.

A fixed evaluation slice (the first 20 official 3-person test puzzles, greedy) is recorded in
``warmstart.json`` under ``check_slice`` when the checkpoint is built; greedy decoding is
deterministic, so the reloaded checkpoint must reproduce it.
"""

import json

import pytest

from tokendyn.policy import EMBEDDED_DIR, load_policy
from tokendyn.trainers.warmstart import check_slice


@pytest.fixture(scope="module")
def shipped():
    report = json.loads((EMBEDDED_DIR / "warmstart.json").read_text())
    model, tok = load_policy()
    return report, model, tok


def test_shipped_checkpoint_is_package_data():
    assert (EMBEDDED_DIR / "config.json").is_file()
    assert (EMBEDDED_DIR / "model.safetensors").is_file()
    assert (EMBEDDED_DIR / "tokenizer.json").is_file()
    assert (EMBEDDED_DIR / "warmstart.json").is_file()


def test_shipped_checkpoint_scores_what_warmstart_json_says(shipped):
    report, model, tok = shipped
    expected = report["check_slice"]
    got = check_slice(model, tok)
    # greedy decoding of the same weights: the same rewards row for row (one row may flip on a
    # different CPU's float kernels; more would mean the checkpoint or the pipeline changed)
    mismatches = sum(a != b for a, b in zip(got["rewards"], expected["rewards"], strict=True))
    assert mismatches <= 1, (got, expected)
    assert abs(got["accuracy"] - expected["accuracy"]) <= 1 / len(expected["rewards"]) + 1e-9
