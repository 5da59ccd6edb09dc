"""The rebalancing analyses on a PEFT LoRA model inside the real TRL loop: a short run completes, and its shares and
probability changes equal those computed here on float64 copies of the model by plain autograd over the LoRA
parameters (the only trainable ones) and by applying the updates to copies."""

from __future__ import annotations

import contextlib
import copy

import polars as pl
import pytest
import torch
from datasets import Dataset
from test_trainer import PROMPTS, TEMPERATURE, _config, vowel_reward
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback

from tokendyn.probe.float64 import exact_float64
from tokendyn.trainers.grpo import TokendynGRPOTrainer

peft = pytest.importorskip("peft")

torch.set_num_threads(1)
EDGES = (0.0, 0.25, 0.5, 0.75, 1.0)
SAMPLE = 4


class Capturing(TokendynGRPOTrainer):
    """The trainer under test, keeping a copy of each rollout batch's first rows (the analysed sample)."""

    samples: list[dict] = []

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
            self.samples.append({k: output[k][:SAMPLE].detach().clone() for k in keys})
        return output


def _log_pi(model, sample) -> torch.Tensor:
    """log pi(o_t) at the sampling temperature from the model's full logits, (B, C)."""
    ids = torch.cat([sample["prompt_ids"], sample["completion_ids"]], dim=1)
    attn = torch.cat([sample["prompt_mask"], sample["completion_mask"]], dim=1)
    c = sample["completion_ids"].size(1)
    with exact_float64() if next(model.parameters()).dtype == torch.float64 else contextlib.nullcontext():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, -c - 1 : -1].double() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, sample["completion_ids"].unsqueeze(-1)).squeeze(-1)


def _float64_copy(model_dir, lora, model):
    """A separate PEFT model (the base model loaded again, the same LoRA config) holding ``model``'s parameters now,
    in float64 and eval mode."""
    twin = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), copy.deepcopy(lora))
    twin.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    return twin.double().eval()


def test_lora_run_with_analyses_matches_updates_applied_to_copies(tiny_model_dir, tmp_path):
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
    )  # B != 0 at the start: the adapter already changes the logits
    cfg = _config(tmp_path, max_steps=1, probe_every=1, probe_sample_sequences=SAMPLE)
    Capturing.samples = []
    trainer = Capturing(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=vowel_reward, args=cfg,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=PreTrainedTokenizerFast.from_pretrained(tiny_model_dir), peft_config=lora,
    )  # fmt: skip
    assert isinstance(trainer.model, peft.PeftModel)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    start = _float64_copy(tiny_model_dir, lora, trainer.model)
    after: dict[int, torch.nn.Module] = {}

    class AfterStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            after[state.global_step] = _float64_copy(tiny_model_dir, lora, trainer.model)

    trainer.add_callback(AfterStep())
    trainer.train()

    sample = Capturing.samples[0]
    mask = sample["completion_mask"].bool()
    adv = sample["advantages"].double().unsqueeze(1).expand_as(mask)
    n_tokens = int(mask.sum())
    records = tmp_path / "run" / "records"

    # update shares: g_b = grad over the LoRA parameters of the loss with A zeroed outside bin b; at ratio 1 (pi_old
    # = pi, on-policy) that is -(1/N) sum_{t in b} A_t grad log pi_t; s_b = <g_b, g> / ||g||^2
    params = [p for p in start.parameters() if p.requires_grad]
    logp = _log_pi(start, sample)
    pi = logp.detach().exp()
    bins = torch.bucketize(pi, torch.tensor(EDGES[1:-1], dtype=torch.float64), right=True)
    per_bin = []
    for b in range(len(EDGES) - 1):
        loss_b = -(adv * logp)[mask & (bins == b)].sum() / n_tokens
        grads = torch.autograd.grad(loss_b, params, retain_graph=True, allow_unused=True)
        per_bin.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                                  for g, p in zip(grads, params, strict=True)]))  # fmt: skip
    g = sum(per_bin)
    want_shares = [float(gb @ g / (g @ g)) for gb in per_bin]
    shares = pl.read_parquet(sorted(records.glob("shares-*.parquet"))).filter(
        (pl.col("group") == "all") & (pl.col("bin") >= 0) & (pl.col("stage") == "train")
    )
    shares = shares.sort("bin")
    assert shares["count"].to_list() == [int((mask & (bins == b)).sum()) for b in range(len(EDGES) - 1)]
    assert shares["share"].to_list() == pytest.approx(want_shares, abs=1e-5)
    assert shares["jvp_share"].to_list() == pytest.approx(want_shares, abs=1e-5)
    assert abs(sum(shares["share"].to_list()) - 1.0) < 1e-6

    change = pl.read_parquet(sorted(records.glob("prob_change-*.parquet")))

    def measured(update: str) -> list[float]:
        rows = change.filter(
            (pl.col("update") == update) & (pl.col("source_bin") == -1) & (pl.col("update_stage") == "train")
        )
        return rows.sort("bin")["mean"].to_list()

    def expected(before, after_model) -> list[float]:
        with torch.no_grad():
            delta = _log_pi(after_model, sample).exp() - _log_pi(before, sample).exp()
        return [float(delta[mask].mean())] + [float(delta[mask & (bins == b)].mean()) for b in range(4)]

    # counterfactual: one plain SGD step of the whole loss on the LoRA parameters of a copy, pi read before/after
    lr = change.filter(pl.col("update") == "counterfactual")["lr"][0]
    stepped = _float64_copy(tiny_model_dir, lora, start)
    moved = [p for p in stepped.parameters() if p.requires_grad]
    loss = -(adv * _log_pi(stepped, sample))[mask].sum() / n_tokens
    with torch.no_grad():
        for p, d in zip(moved, torch.autograd.grad(loss, moved), strict=True):
            p -= lr * d
    want = expected(start, stepped)
    assert max(abs(x) for x in want) > 1e-5  # the step moves pi
    # this reference is float64 at every op; the run's first analysed step is its precision check, reported from
    # float64 steps of the float32 gradient (`float64_step`): within that gradient's rounding (3.1e-6 seen)
    assert measured("counterfactual") == pytest.approx(want, rel=2e-5, abs=1e-13)
    # the real change: pi of the same tokens under the model after the run's optimizer step minus before it
    want = expected(start, after[1])
    assert max(abs(x) for x in want) > 1e-5
    assert measured("real") == pytest.approx(want, rel=1e-3, abs=1e-7)


def test_a_lora_model_splits_into_its_adapted_backbone_and_its_head():
    """The analyses' forward stops at the backbone of the model inside PEFT's wrappers (adapters included): log pi
    equals the one from the wrapped model's own logits; a prompt-learning adapter is called whole."""
    from _models import make_batch, tiny_qwen2

    from tokendyn.probe.tokenloss import ProbeBatch, _split, _split_checked, completion_logp

    lora = peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
    )
    model = peft.get_peft_model(tiny_qwen2(0, sharpen=5.0), lora).eval()
    b = make_batch(model, n=3)
    batch = ProbeBatch(b.input_ids, b.attention_mask, b.completion_mask, b.advantages)
    parts = _split_checked(model, batch)
    assert parts is not None and parts[0] is model.base_model.model.model and parts[1] is model.lm_head
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
        want = torch.log_softmax(logits[:, -b.c - 1 : -1].double(), -1)
        want = want.gather(-1, b.completion_ids.unsqueeze(-1)).squeeze(-1)
        got = completion_logp(model, batch, float64=True)
    mask = b.completion_mask.bool()
    assert torch.allclose(got[mask], want[mask], atol=1e-5)
    prompt = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    assert _split(peft.get_peft_model(tiny_qwen2(0), prompt)) is None
