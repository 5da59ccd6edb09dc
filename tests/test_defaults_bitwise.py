"""Nothing the probe turns on changes training: a run with every probe feature on (the probe's records, the noise
floor, the rebalancing analyses, the paired comparison in both step modes, the token view, the sampler records, the
rollout dumps) ends with every parameter equal bit for bit (``torch.equal``) to the same run with the probe off.

The matrix: a tiny GPT-2 built from a config with transformers' default dropouts (0.1 on the embeddings, the
residuals and the attention; every training forward draws its dropout masks from torch's global RNG, so one extra
draw anywhere changes every later mask, and the weights: `test_one_extra_rng_draw_changes_the_weights`), trained by
GRPO and by Lopti (``lopti_eta``). The reference is the probe-off run of the same cell (``probe_every=0``: the
trainer builds no probe). The same comparison without dropout (the tiny Qwen2) is in tests/test_trainer_probe.py.

The same comparison through the configuration matrix (every architecture, dtype, adapter and accumulation mode, with
dropout): tests/test_defaults_matrix.py. The sampler records need a sampler's own log-probs: TRL's ``rollout_func``
samples here with a plain torch loop (`_sampler.rollout_sampler`)."""

from __future__ import annotations

import pytest
import torch
from _sampler import rollout_sampler
from test_trainer import TEMPERATURE, _config, vowel_reward
from transformers import AutoModelForCausalLM, GPT2Config, PreTrainedTokenizerFast, TrainerCallback

from tokendyn.hooks.sampler import side_pass
from tokendyn.trainers.grpo import TokendynGRPOTrainer

torch.set_num_threads(1)

PROMPTS = ["Zoey says that", "Knights always", "the quick brown", "count: one two"]
MAX_COMPLETION = 8

# every probe feature on: the probe every step, the floor (on by default), every analysis (their default), the token
# view (its default 4 sequences), the paired comparison (Lopti, two stages) in both step modes (its default), the
# rollout dumps; the sampler records come with the probe whenever the batch holds a sampler's log-probs
ALL_ON = dict(probe_every=1, probe_compare_rules="lopti", probe_dump_rollouts=True)
KINDS = {
    "binstats",
    "floor",
    "sampler",
    "shares",
    "token_shares",
    "prob_change",
    "influence",
    "paired",
    "token_view",
}
CELLS = {"gpt2_dropout-grpo": {}, "gpt2_dropout-lopti": {"lopti_eta": 0.5}}


def test_the_gpt2_of_the_matrix_has_transformers_default_dropout(gpt2_dir):
    """The dropout cell has dropout: transformers' GPT-2 defaults, 0.1 on the embeddings, residuals and attention."""
    config = GPT2Config.from_pretrained(gpt2_dir)
    defaults = GPT2Config()
    assert (config.resid_pdrop, config.embd_pdrop, config.attn_pdrop) == (0.1, 0.1, 0.1)
    assert (defaults.resid_pdrop, defaults.embd_pdrop, defaults.attn_pdrop) == (0.1, 0.1, 0.1)


def _train(model_dir, out, callbacks=None, **overrides) -> list[torch.Tensor]:
    """The cell's run, its final parameters: 3 optimizer steps of 2 micro-batches of 4 completions (GRPO: a rollout
    of 8 completions each; Lopti: the two stages of one rollout, then the next rollout's first stage)."""
    from datasets import Dataset

    args = _config(
        out,
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        max_completion_length=MAX_COMPLETION,
        **overrides,
    )
    trainer = TokendynGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=vowel_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir),
        rollout_func=rollout_sampler(TEMPERATURE, MAX_COMPLETION),
        callbacks=callbacks,
    )
    trainer.train()
    return [p.detach().clone() for p in trainer.model.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def probe_off(gpt2_dir, tmp_path_factory):
    """Each cell's probe-off run, trained once for the module: its final parameters."""
    runs: dict[str, list[torch.Tensor]] = {}

    def get(cell: str) -> list[torch.Tensor]:
        if cell not in runs:
            runs[cell] = _train(gpt2_dir, tmp_path_factory.mktemp(f"off-{cell}"), **CELLS[cell])
        return runs[cell]

    return get


@pytest.mark.parametrize("cell", list(CELLS))
def test_every_probe_feature_on_trains_bit_for_bit_as_the_probe_off(cell, gpt2_dir, probe_off, tmp_path):
    on = _train(gpt2_dir, tmp_path, **ALL_ON, **CELLS[cell])
    kinds = {p.name.split("-")[0] for p in (tmp_path / "run" / "records").glob("*.parquet")}
    # each feature ran: one that silently did nothing would pass the comparison
    assert KINDS <= kinds, f"no records of {sorted(KINDS - kinds)}"
    assert list((tmp_path / "run" / "rollouts").glob("step-*.parquet"))
    off = probe_off(cell)
    assert all(torch.equal(a, b) for a, b in zip(off, on, strict=True)), (
        f"{cell}: max |dweight| {_max_diff(off, on):.3g} with every probe feature on"
    )


class _OneDraw(TrainerCallback):
    """Draws one number from torch's global RNG before the second optimizer step."""

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 1:
            torch.rand(1)


def test_one_extra_rng_draw_changes_the_weights(gpt2_dir, probe_off, tmp_path):
    """The dropout cell sees any side pass that draws from the RNG: a single draw changes the trained weights."""
    drawn = _train(gpt2_dir, tmp_path, callbacks=[_OneDraw()], **CELLS["gpt2_dropout-grpo"])
    assert _max_diff(probe_off("gpt2_dropout-grpo"), drawn) > 1e-4


def test_a_side_pass_restores_the_rng_and_every_training_flag_when_it_raises(gpt2_dir):
    """`side_pass` (the floor's halves): no dropout inside (two forwards agree), the RNG as it was after, and every
    module's flag restored after an exception, a submodule left in eval mode by the caller included."""
    model = AutoModelForCausalLM.from_pretrained(gpt2_dir).train()
    model.transformer.h[1].eval()
    flags = [m.training for m in model.modules()]
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="inside"), side_pass(model):
        assert not any(m.training for m in model.modules())
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
            model.train()  # a pass that switches training back on: still restored
            model(input_ids=ids)  # draws dropout masks
        raise RuntimeError("inside")
    assert [m.training for m in model.modules()] == flags
    assert torch.equal(torch.get_rng_state(), state)
