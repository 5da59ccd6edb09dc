"""Warm start with the `tiny` preset: trains, saves, reloads, generates the same; and the CLI."""

import json

import pytest
import torch

from tokendyn.cli import main
from tokendyn.policy import load_policy, save_policy
from tokendyn.tasks.kk.datasets import heldout
from tokendyn.tasks.kk.prompts import render_prompt
from tokendyn.trainers.warmstart import train_policy


@pytest.fixture(scope="module")
def tiny_policy():
    torch.manual_seed(0)
    return train_policy("tiny", seed=0, progress=False)


def test_tokenizer_keeps_the_official_prompt(tiny_policy):
    _, tok, _ = tiny_policy
    prompt = render_prompt(heldout(3)[0].quiz)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == prompt
    # the constant system block is one token; the tags survive skip_special_tokens (TRL decodes that way)
    assert tok.convert_ids_to_tokens(ids[0]).startswith("<|im_start|>system")
    text = " x </think>\n<answer> (1) A is a knight </answer>"
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text


def test_save_reload_generates_exactly_the_same(tiny_policy, tmp_path):
    model, tok, stats = tiny_policy
    assert stats["tokens_trained"] > 0
    tok.padding_side = "left"
    save_policy(model, tok, tmp_path, {"preset": "tiny"})
    model2, tok2 = load_policy(tmp_path)
    prompts = [render_prompt(p.quiz) for p in heldout(3)[:3]]
    enc, enc2 = (
        tok(prompts, return_tensors="pt", padding=True),
        tok2(prompts, return_tensors="pt", padding=True),
    )
    assert torch.equal(enc["input_ids"], enc2["input_ids"])
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        a = model.generate(**enc, **kw)
        b = model2.generate(**enc2, **kw)
    assert torch.equal(a, b)
    for p1, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p1, p2)


def test_cli_tiny_end_to_end(tmp_path, capsys):
    out = tmp_path / "policy"
    assert main(["warmstart", "--preset", "tiny", "--out", str(out), "--no-progress"]) == 0
    report = json.loads((out / "warmstart.json").read_text())
    assert report["preset"] == "tiny" and report["parameters"] > 0
    assert {r["mode"] for r in report["evaluation"]} == {"greedy", "T=0.7"}
    assert sum(report["bin_shares_T0.7"]["all_people"]) == pytest.approx(1.0)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert str(out) in capsys.readouterr().out
    # every warmstart.json carries its target table, computed from its own numbers and the folder's size
    files = [p for p in out.iterdir() if p.is_file() and p.name != "warmstart.json"]
    assert report["targets"]["package_mb"]["value"] == round(sum(p.stat().st_size for p in files) / 1e6, 2)
    acc3 = next(r["accuracy"] for r in report["evaluation"] if r["people"] == 3 and r["mode"] == "T=0.7")
    assert report["targets"]["accuracy_3ppl_T0.7"] == {
        "value": acc3,
        "range": [0.25, 0.8],
        "met": 0.25 <= acc3 <= 0.8,
    }


def test_seed_checks_table_every_seed_from_its_own_numbers():
    from tokendyn.trainers.warmstart import with_seed_checks

    def record(seed, acc, top):
        return {
            "preset": "p",
            "seed": seed,
            "evaluation": [{"people": 3, "mode": "T=0.7", "accuracy": acc, "format_valid": 1.0}],
            "bin_shares_T0.7": {"people_3": [0.2, 0.02, 0.02, top]},
            "tokens_below_0.5_T0.7": {"people_3": 0.22},
            "training": {"train_cpu_s": 3000.0},
            "targets": {"package_mb": {"value": 4.5, "range": [0.0, 8.0], "met": True}},
        }

    shipped = with_seed_checks(record(0, 0.3, 0.7), [record(2, 0.2, 0.74), record(1, 0.3, 0.8)])
    checks = shipped["seed_checks"]
    assert [c["seed"] for c in checks] == [0, 1, 2]
    assert checks[1]["targets"]["tokens_in_top_bin_3ppl"] == {
        "value": 0.8,
        "range": [0.0, 0.75],
        "met": False,
    }
    assert checks[2]["targets"]["accuracy_3ppl_T0.7"]["met"] is False
    assert checks[2]["targets"]["package_mb"]["value"] == 4.5
    with pytest.raises(ValueError, match="others: preset 'q' differs"):
        with_seed_checks(record(0, 0.3, 0.7), [{**record(1, 0.3, 0.7), "preset": "q"}])


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--preset", "huge"],
            "preset: must be one of ['cpu', 'cpu_v1', 'cpu_v2', 'cpu_v3', 'cpu_v4', 'cpu_v5', 'cpu_v6', 'cpu_v7', 'cpu_v8', "
            "'gpu', 'tiny']",
        ),
        (["--preset", "tiny", "--seed", "-1"], "seed: must be >= 0"),
        (["--preset", "tiny", "--threads", "0"], "--threads: must be an integer >= 1, got 0"),
    ],
)
def test_cli_rejects_bad_input(argv, message, tmp_path, capsys):
    out = tmp_path / "p"
    assert main(["warmstart", *argv, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_resolve_device_keeps_the_cpu_presets_on_the_cpu():
    from tokendyn.trainers.warmstart import resolve_device

    assert resolve_device(None, "cpu") == resolve_device("auto", "cpu_v3") == "cpu"
    assert resolve_device("auto", "gpu") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu", "gpu") == "cpu"
    for bad in ("tpu", "cudafoo", "cuda:x"):
        with pytest.raises(ValueError, match="device: must be auto, cpu, cuda or cuda:N"):
            resolve_device(bad)


def test_the_cpu_alias_is_recorded_by_its_version():
    """`--preset cpu` trains the current default's recipe and records its versioned name (the shipped policy's), so a
    record keeps naming its recipe after the alias moves to a later version; other names are recorded as given."""
    import json

    from tokendyn.policy import EMBEDDED_DIR
    from tokendyn.trainers.warmstart import PRESETS, canonical_preset

    version = canonical_preset("cpu")
    assert version != "cpu" and PRESETS["cpu"] is PRESETS[version]
    assert json.loads((EMBEDDED_DIR / "warmstart.json").read_text())["preset"] == version
    assert canonical_preset("tiny") == "tiny" and canonical_preset("cpu_v1") == "cpu_v1"


def test_a_run_through_the_alias_records_the_version(tmp_path, monkeypatch):
    """The recording path itself: with the alias pointed at the tiny recipe (so it runs in seconds), `--preset cpu`
    writes the versioned name into warmstart.json and the policy's marker file, not the alias."""
    import json

    from tokendyn.policy import MARKER
    from tokendyn.trainers import warmstart_presets as ws

    monkeypatch.setattr(ws, "DEFAULT_CPU_PRESET", "tiny")
    monkeypatch.setitem(ws.PRESETS, "cpu", ws.PRESETS["tiny"])
    out = tmp_path / "policy"
    assert main(["warmstart", "--preset", "cpu", "--out", str(out), "--no-progress"]) == 0
    assert json.loads((out / "warmstart.json").read_text())["preset"] == "tiny"
    assert json.loads((out / MARKER).read_text())["preset"] == "tiny"
