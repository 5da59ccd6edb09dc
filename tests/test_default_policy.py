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


def test_shipped_targets_are_its_own_measurements():
    """warmstart.json's target table is recomputed from the numbers it records (accuracy, bins, format, CPU time when
    recorded) and the shipped folder's size: what it says was reached is what was measured."""
    from tokendyn.trainers.warmstart import TARGETS, check_targets, target_values

    report = json.loads((EMBEDDED_DIR / "warmstart.json").read_text())
    assert report["targets"] == check_targets(target_values(report, EMBEDDED_DIR))
    assert set(report["targets"]) <= set(TARGETS) and report["targets"]["package_mb"]["met"]


@pytest.mark.parametrize(
    ("version", "seeds"),
    [("v2", [0, 1]), ("v3", [0]), ("v4", [0]), ("v5", [0]), ("v6", [0]), ("v7", [0]), ("v8", [0, 1, 2])],
)
def test_candidate_versions_record_their_seeds_with_targets_from_their_numbers(version, seeds):
    """docs/warmstart_v2 .. v8 (presets cpu_v2 .. cpu_v8; v8 is the shipped default): their training seeds, every
    size 3-7 on 100 puzzles, and target verdicts that follow from the recorded values."""
    from pathlib import Path

    from tokendyn.trainers.warmstart import PRESETS, TARGETS, check_targets, target_values

    folder = Path(__file__).resolve().parents[1] / "docs" / f"warmstart_{version}"
    reports = [json.loads(p.read_text()) for p in sorted(folder.glob("seed*.json"))]
    assert sorted(r["seed"] for r in reports) == seeds
    for r in reports:
        preset = PRESETS[f"cpu_{version}"]
        assert r["preset"] == f"cpu_{version}" and r["training"]["steps"] == preset.steps
        assert r["training"]["people"] == list(preset.people) and r["training"]["lr"] == preset.lr
        assert {e["people"] for e in r["evaluation"]} == {3, 4, 5, 6, 7} and all(
            e["n"] == 100 for e in r["evaluation"]
        )
        values = {k: v["value"] for k, v in r["targets"].items()}
        assert set(values) == set(TARGETS)
        assert r["targets"] == check_targets(values)
        measured = target_values(r)
        assert all(values[k] == v for k, v in measured.items() if v is not None)


def test_shipped_default_meets_its_targets_and_reports_every_seed_trained():
    """The shipped warmstart.json's seed table lists at least two training seeds, the shipped one first; each row's
    verdicts are recomputed from that seed's own record (docs/warmstart_<version>/seed<N>.json, the shipped seed's
    equal to the shipped file's numbers); the shipped seed meets every target."""
    from pathlib import Path

    from tokendyn.trainers.warmstart import TARGETS, check_targets, target_values

    report = json.loads((EMBEDDED_DIR / "warmstart.json").read_text())
    version = report["preset"].removeprefix("cpu_")
    folder = Path(__file__).resolve().parents[1] / "docs" / f"warmstart_{version}"
    checks = report["seed_checks"]
    assert len(checks) >= 2 and checks[0]["seed"] == report["seed"]
    for row in checks:
        record = json.loads((folder / f"seed{row['seed']}.json").read_text())
        values = target_values(record)
        values["package_mb"] = report["targets"]["package_mb"]["value"]
        assert row["targets"] == check_targets(values)
        assert set(row["targets"]) == set(TARGETS)
    assert checks[0]["targets"] == report["targets"]
    assert all(t["met"] for t in report["targets"].values()), report["targets"]
    shipped_record = json.loads((folder / f"seed{report['seed']}.json").read_text())
    assert shipped_record["evaluation"] == report["evaluation"]
    assert shipped_record["check_slice"] == report["check_slice"]


def test_shipped_bin_shares_match_a_fresh_sample(shipped):
    """The recorded 3-person bin shares at T = 0.7 are re-measured on a fresh sample of 30 puzzles (another sampling
    seed): each share within 0.06 of the recorded one (sampling noise of ~2,000 tokens, correlated within puzzles)."""
    import numpy as np

    from tokendyn.trainers.evaluate import bin_shares, evaluate

    report, model, tok = shipped
    res = evaluate(model, tok, [3], n=30, modes=("sampled",), seed=123)
    got = bin_shares([p for r in res for p in r.token_probs])
    want = report["bin_shares_T0.7"]["people_3"]
    assert np.allclose(got, want, atol=0.06), (got, want)
