"""The doctor's one-line summary in the live log (`tokendyn.trainers.doctor_log`): a short TRL run with the spike
trigger made to fire (as in test_spike_live) logs, at its end, a summary that names the spike finding under watch;
the token view of that run opens at the spike's top token, whose text in the `token_view` records is the `spikes`
record's; the summary draws nothing from any random generator; a diagnosis that fails is one logged line, and
training still ends normally."""

from __future__ import annotations

import logging
import random
import re

import numpy as np
import polars as pl
import torch
from test_spike_live import MAX_COMPLETION, _records
from test_trainer import PROMPTS, TEMPERATURE, _config, vowel_reward
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from tokendyn.effects import spike_trigger
from tokendyn.trainers import doctor_log
from tokendyn.trainers.grpo import TokendynGRPOTrainer

torch.set_num_threads(1)


def _train(model_dir, out):
    """5 rollouts of 4 completions, the probe on rollouts 0, 2 and 4, the view on all 4 sequences, k just above 1."""
    from _sampler import rollout_sampler
    from datasets import Dataset

    args = _config(out, max_steps=5, per_device_train_batch_size=4, num_generations=4,
                   gradient_accumulation_steps=1, max_completion_length=MAX_COMPLETION, probe_every=2,
                   probe_floor=False, probe_view_sequences=4, probe_spike_k=1.0001)  # fmt: skip
    trainer = TokendynGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=vowel_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}),
        processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir),
        rollout_func=rollout_sampler(TEMPERATURE, MAX_COMPLETION),
    )
    trainer.train()
    return trainer


def test_the_run_logs_the_doctors_summary_at_its_end(gpt2_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(spike_trigger, "DEFAULT_MIN_HISTORY", 1)
    # the loss judged too: on a short run the gradient norm may only fall, and any change of |L| fires at k ~ 1
    monkeypatch.setattr(spike_trigger, "DEFAULT_QUANTITIES", ("grad_norm", "loss"))
    caplog.set_level(logging.INFO, logger=doctor_log.LOGGER)
    _train(gpt2_dir, tmp_path)
    run = tmp_path / "run"
    spikes = _records(tmp_path, "spikes")
    assert spikes.height, "the trigger never fired"
    lines = [r.getMessage() for r in caplog.records if r.name == doctor_log.LOGGER]
    assert len(lines) == 1, lines
    line = lines[0]
    assert re.match(r"tokendyn doctor: \d+ act, \d+ watch, \d+ fine, \d+ not measured", line), line
    watched = re.search(r"watch: ([^;)]*)", line)
    assert watched and "spikes.tokens" in watched.group(1).split(", "), line
    assert line.endswith(f"details: tokendyn doctor {run}")

    # the view of this run opens at the first spike's top token, as the token_view records hold it
    from tokendyn.cli import main

    assert main(["view", str(run), "--out", str(tmp_path / "view.html")]) == 0
    html = (tmp_path / "view.html").read_text()
    data = re.search(r"id='tv-data'>(.*?)</script>", html, re.S).group(1)
    opened = __import__("json").loads(data)["open"]
    top = spikes.filter(pl.col("step") == spikes["step"].min()).sort("rank").row(0, named=True)
    view = _records(tmp_path, "token_view").filter(
        (pl.col("step") == top["step"]) & (pl.col("seq") == top["seq"]) & (pl.col("pos") == top["pos"])
    )
    assert (
        view.height == 1 and view["text"].item() == top["text"] and view["token_id"].item() == top["token_id"]
    )
    assert opened["at"][1] == top["seq"]
    assert f"href='#tv-t-{top['seq']}-{opened['at'][2]}'" in html

    # the summary draws from no random generator
    states = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    doctor_log.DoctorLogCallback(run).log_summary()
    assert torch.equal(states[0], torch.get_rng_state()) and (states[1] == np.random.get_state()[1]).all()
    assert states[2] == random.getstate()


def test_a_failing_diagnosis_is_one_logged_line_and_training_ends(
    tiny_model_dir, tmp_path, monkeypatch, caplog
):
    from test_trainer import _trainer

    def broken(run_dir):
        raise ValueError("records unreadable\nsecond line")

    monkeypatch.setattr(doctor_log, "doctor_line", broken)
    caplog.set_level(logging.INFO, logger=doctor_log.LOGGER)
    trainer = _trainer(tiny_model_dir, _config(tmp_path, max_steps=1, probe_every=1))
    trainer.train()
    assert trainer.state.global_step == 1
    lines = [r for r in caplog.records if r.name == doctor_log.LOGGER]
    assert [r.levelno for r in lines] == [logging.WARNING]
    assert lines[0].getMessage() == (
        f"tokendyn doctor: could not diagnose {tmp_path / 'run'} (ValueError: records unreadable)"
    )
