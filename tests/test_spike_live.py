"""The spike trigger in TRL's trainer (``probe_spike_k``, on by default): a probed rollout that spikes writes its
`spikes` record, the rollout after it is probed although ``probe_every`` skips it, and training is untouched, bit
for bit, on a GPT-2 with transformers' default dropout 0.1 (any extra RNG draw would show).

To make the trigger fire on a short run, its warm-up is one probed rollout and k is just above 1: then any rollout
whose gradient norm or loss (judged here on purpose; a run's trigger leaves the signed loss out) grows over the
first one's is a spike."""

from __future__ import annotations

import polars as pl
import pytest
import torch
from _sampler import rollout_sampler
from test_trainer import PROMPTS, TEMPERATURE, _config, vowel_reward
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from tokendyn.effects import spike_trigger
from tokendyn.trainers.grpo import TokendynGRPOTrainer

torch.set_num_threads(1)
MAX_COMPLETION = 8


def _train(model_dir, out, **probe) -> tuple[dict, object]:
    """5 rollouts of 4 completions, one optimizer step each, the probe on rollouts 0, 2 and 4 (``probe_every`` 2)."""
    from datasets import Dataset

    args = _config(out, max_steps=5, per_device_train_batch_size=4, num_generations=4,
                   gradient_accumulation_steps=1, max_completion_length=MAX_COMPLETION, probe_every=2,
                   probe_floor=False, probe_view_sequences=0, **probe)  # fmt: skip
    trainer = TokendynGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=vowel_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}),
        processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir),
        rollout_func=rollout_sampler(TEMPERATURE, MAX_COMPLETION),
    )
    trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, trainer


def _records(out, kind: str) -> pl.DataFrame:
    files = sorted((out / "run" / "records").glob(f"{kind}-*.parquet"))
    return pl.concat([pl.read_parquet(f) for f in files]) if files else pl.DataFrame()


def test_a_spike_is_recorded_the_next_rollout_probed_and_training_untouched(gpt2_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(spike_trigger, "DEFAULT_MIN_HISTORY", 1)
    # the loss judged too: on a short run the gradient norm may only fall, and any change of |L| fires at k ~ 1
    monkeypatch.setattr(spike_trigger, "DEFAULT_QUANTITIES", ("grad_norm", "loss"))
    off, _ = _train(gpt2_dir, tmp_path / "off", probe_spike_k=None)
    on, trainer = _train(gpt2_dir, tmp_path / "on", probe_spike_k=1.0001)
    spikes = _records(tmp_path / "on", "spikes")
    assert spikes.height, "the trigger never fired"
    spiked = sorted(set(spikes["step"].to_list()))
    assert 0 not in spiked  # (warming up on the first probed rollout)
    probed = sorted(set(_records(tmp_path / "on", "binstats")["step"].to_list()))
    assert spiked[0] < 4 and all(s + 1 in probed for s in spiked if s + 1 < 5), (
        spiked,
        probed,
    )  # the next rollout
    assert set(probed) - {0, 2, 4} <= {s + 1 for s in spiked}
    assert _records(tmp_path / "off", "spikes").is_empty()
    # each spike's tokens: ranked by share, with the trigger that fired and its ratio above k
    for _, rows in spikes.group_by("step"):
        assert rows["rank"].to_list() == list(range(1, rows.height + 1))
        assert rows["share"].to_list() == sorted(rows["share"].to_list(), reverse=True)
        assert (rows["trigger_ratio"] > 1.0001).all()
    assert off.keys() == on.keys()
    assert all(torch.equal(off[n], on[n]) for n in off), "the spike trigger changed training"


def test_the_trigger_option_is_validated_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"probe_spike_k: must be None \(off\) or a number > 1, got 0\.5"):
        _config(tmp_path, probe_spike_k=0.5)
