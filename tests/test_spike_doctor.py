"""`tokendyn doctor` lists the recorded spikes: the finding's verdict (watch from one spiking step, fine with the
trigger on and no spike, not measured with it off) and the tokens behind each spike in the text, from `spikes`
records written by the record writer with known values."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from tokendyn.analysis.diagnosis import diagnose, render_text, validate
from tokendyn.common import write_json
from tokendyn.records import to_frame, write_frames


def new_run(tmp_path: Path, name: str, **config) -> Path:
    run = tmp_path / name
    run.mkdir()
    write_json(run / "run.json", {"method": name, "config": config})
    return run


def spike_rows(step: int, tokens: list[tuple[str, float, float, int]], ratio: float = 8.0) -> pl.DataFrame:
    """One spiking step's rows: tokens as (text, pi_old, share, bin), ranked in that order."""
    n = len(tokens)
    cols = {
        "step": [step] * n, "stage": ["train"] * n, "trigger": ["grad_norm"] * n, "trigger_value": [ratio] * n,
        "trigger_median": [1.0] * n, "trigger_ratio": [ratio] * n, "k": [3.0] * n, "rank": list(range(1, n + 1)),
        "seq": [3] * n, "pos": list(range(n)), "token_id": list(range(n)), "text": [t[0] for t in tokens],
        "context": [t[0] for t in tokens], "bin": [t[3] for t in tokens], "bin_lo": [0.0] * n, "bin_hi": [0.25] * n,
        "pi_old": [t[1] for t in tokens], "advantage": [3.0] * n, "log_rho": [None] * n, "is_weight": [None] * n,
        "share": [t[2] for t in tokens], "grad_norm": [ratio] * n, "loss": [0.1] * n,
    }  # fmt: skip
    return to_frame("spikes", cols)


def finding(doc: dict) -> dict:
    return next(f for f in doc["runs"][0]["findings"] if f["name"] == "spikes.tokens")


def test_recorded_spikes_are_listed_with_their_tokens_and_a_watch(tmp_path):
    run = new_run(tmp_path, "spiky", probe_spike_k=3.0)
    write_frames(
        run, {"spikes": spike_rows(4, [(" Benjamin", 1e-4, 0.375, 0), (" is", 0.9, 0.2, 3)])}, rank=0
    )
    write_frames(run, {"spikes": spike_rows(9, [(" knave", 2e-4, 0.6, 0)], ratio=5.0)}, rank=0)
    doc = diagnose([run])
    validate(doc)
    f = finding(doc)
    assert (f["family"], f["status"], f["value"], f["verdict"]) == ("spikes", "measured", 2.0, "watch")
    assert [s["step"] for s in f["details"]["steps"]] == [9, 4]  # latest first
    assert [t["text"] for t in f["details"]["steps"][1]["tokens"]] == [" Benjamin", " is"]
    assert f["try"] == "--advantage_reweight_alpha 0.3"  # the spikes' top tokens sit in the lowest bin
    text = render_text(doc)
    assert "step 9 (grad_norm 5x its median): ' knave' pi 2.0e-04 A 3 share 0.6 (bin 0, seq 3, pos 0)" in text
    assert "step 4 (grad_norm 8x its median): ' Benjamin' pi 1.0e-04" in text and "' is' pi 0.9" in text


def analysed(run: Path, steps: int, ranks: int = 1) -> Path:
    """`shares` rows of ``steps`` analysed rollouts and `binstats` rows of ``ranks`` processes (the columns the
    finding reads; every other column null)."""
    from tokendyn.schemas import SCHEMAS

    for kind, cols in {
        "shares": {"step": list(range(steps)), "stage": ["train"] * steps, "bin": [-1] * steps},
        "binstats": {"step": [0] * ranks, "rank": list(range(ranks))},
    }.items():
        df = pl.DataFrame(cols)
        df = df.with_columns(
            [pl.lit(None).cast(t).alias(c) for c, t in SCHEMAS[kind].items() if c not in df.columns]
        )
        write_frames(run, {kind: df.select(list(SCHEMAS[kind]))}, rank=0)
    return run


def test_no_spike_with_the_trigger_armed_is_fine_and_with_it_off_or_unarmed_not_measured(tmp_path):
    on = finding(diagnose([analysed(new_run(tmp_path, "calm", probe_spike_k=3.0), steps=6)]))
    assert (on["status"], on["value"], on["verdict"]) == ("measured", 0.0, "fine")
    off = finding(diagnose([new_run(tmp_path, "off")]))
    assert off["status"] == "not measured" and off["verdict"] is None and "trigger was off" in off["reason"]
    # on, but it could not have fired: a 0 there would be a check not made read as a check passed
    unarmed = {
        "no analyses": (new_run(tmp_path, "bare", probe_spike_k=3.0), "no `shares` records"),
        "3 analysed rollouts": (
            analysed(new_run(tmp_path, "short", probe_spike_k=3.0), steps=3),
            "analysed 3",
        ),
        "two ranks": (
            analysed(new_run(tmp_path, "ddp", probe_spike_k=3.0), steps=6, ranks=2),
            "from 2 ranks",
        ),
    }
    verl = analysed(new_run(tmp_path, "verl", probe_spike_k=3.0), steps=6)
    meta = json.loads((verl / "run.json").read_text())
    write_json(verl / "run.json", {**meta, "source": "verl"})
    unarmed["verl's engine"] = (verl, "TRL trainer only")
    offline = analysed(new_run(tmp_path, "offline"), steps=6)
    meta = json.loads((offline / "run.json").read_text())
    write_json(offline / "run.json", {**meta, "method": "offline probe"})
    unarmed["offline probe"] = (offline, "sees one rollout batch")
    for case, (run, why) in unarmed.items():
        f = finding(diagnose([run]))
        assert f["status"] == "not measured" and f["verdict"] is None and why in f["reason"], (
            case,
            f["reason"],
        )


def test_spikes_whose_tokens_are_not_low_probability_suggest_no_remedy(tmp_path):
    run = new_run(tmp_path, "high", probe_spike_k=3.0)
    write_frames(run, {"spikes": spike_rows(2, [(" the", 0.95, 0.5, 3)])}, rank=0)
    f = finding(diagnose([run]))
    assert f["verdict"] == "watch" and f["try"] is None


def test_the_doctor_knows_the_live_triggers_warm_up():
    from tokendyn.analysis.diagnosis import spikes
    from tokendyn.effects import spike_trigger

    assert spikes.DEFAULT_MIN_HISTORY == spike_trigger.DEFAULT_MIN_HISTORY
