"""The offline probe on every architecture family it accepts (GPT-2: absolute positions and a tied head; Llama:
rotary; OPT with `project_out`; post-LN OPT, whose last layer feeds the head), on left-padded rollouts sampled by `generate`.

Two oracles: the sampler's own log-probabilities (`generate`'s logits, with the position ids it builds from the
masks) must be what the offline probe reads, and the per-bin statistics must be those the probe records inside a
plain training loop that feeds the same batch with those position ids (verl's layout)."""

from __future__ import annotations

import polars as pl
import pytest
import torch
from _models import grpo_loss
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from tokendyn.hooks import instrument
from tokendyn.hooks.offline import probe_rollouts
from tokendyn.probe.points import discover_points

torch.set_num_threads(1)

VOCAB, T, P, C = 61, 1.0, 6, 5


def _model(family: str):
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, bos_token_id=None,
                         eos_token_id=None, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return GPT2LMHeadModel(cfg)
    if family == "llama":
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
        return LlamaForCausalLM(cfg)
    pre_ln = family == "opt_project_out"
    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=64, word_embed_proj_dim=16 if pre_ln else 32, do_layer_norm_before=pre_ln,
                    dropout=0.0, attention_dropout=0.0, layerdrop=0.0, pad_token_id=0)  # fmt: skip
    return OPTForCausalLM(cfg)


def _sampled_batch(model):
    """Left-padded prompts of lengths 2..6, completions of C tokens sampled by `generate` (which builds position ids
    from the mask), right-padded to ragged lengths; old_logp = the sampler's log pi at T."""
    g = torch.Generator().manual_seed(1)
    n = 6
    lengths = torch.tensor([6, 2, 4, 3, 5, 2])
    prompt = torch.randint(1, VOCAB, (n, P), generator=g)
    pmask = (torch.arange(P).unsqueeze(0) >= P - lengths.unsqueeze(1)).long()
    prompt = prompt * pmask  # pad id 0 on the left
    torch.manual_seed(2)
    out = model.generate(input_ids=prompt, attention_mask=pmask, do_sample=True, max_new_tokens=C, min_new_tokens=C,
                         temperature=T, top_k=0, top_p=1.0, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0, eos_token_id=None)  # fmt: skip
    completion = out.sequences[:, P:]
    logits = torch.stack(out.logits, dim=1).float() / T
    old = torch.log_softmax(logits, -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    cmask = (torch.arange(C).unsqueeze(0) < torch.tensor([5, 3, 5, 2, 4, 5]).unsqueeze(1)).long()
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, -0.8])
    return prompt, pmask, completion, cmask, old * cmask, adv


def _in_training(model, batch, run_dir) -> None:
    """One step of a plain GRPO loop with the position ids the sampler used, under `instrument`."""
    prompt, pmask, completion, cmask, old, adv = batch
    ids, mask = torch.cat([prompt, completion], 1), torch.cat([pmask, cmask], 1)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with instrument(model, run_dir, check_tokens=None, temperature=T, rank=0) as probe:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        z = logits[:, P - 1 : -1].float() / T
        logps = torch.log_softmax(z, -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        probe.begin_step(step=0, completion_mask=cmask, advantages=adv, old_logp=old, completion_ids=completion,
                     logps=logps, temperature=T)  # fmt: skip
        grpo_loss(logps, old, adv, cmask).backward()
        probe.end_step()
    model.zero_grad(set_to_none=True)


def _rollouts_file(batch, path):
    prompt, pmask, completion, cmask, old, adv = batch
    pl.DataFrame(
        {
            "prompt_ids": prompt.tolist(),
            "prompt_mask": pmask.tolist(),
            "completion_ids": completion.tolist(),
            "completion_mask": cmask.tolist(),
            "old_logp": old.tolist(),
            "advantage": adv.tolist(),
            "temperature": [T] * len(adv),
        }
    ).write_parquet(path)
    return path


def _frame(run_dir, kind):
    return pl.read_parquet(sorted((run_dir / "records").glob(f"{kind}-*.parquet")))


def _logp_gap(run_dir) -> float:
    """max |log pi - log pi_old| over the sampled tokens the offline probe recorded (on-policy file: 0 if right)."""
    tokens = _frame(run_dir, "tokens")
    return float((tokens["pi"].log() - tokens["pi_old"].log()).abs().max())


FAMILIES = ["gpt2", "llama", "opt_project_out", "opt_post_ln"]


@pytest.mark.parametrize("family", FAMILIES)
def test_offline_probe_agrees_with_the_training_loop(family, tmp_path):
    model = _model(family).eval()
    batch = _sampled_batch(model)
    names = [p.name for p in discover_points(model)]
    assert names[-1] == "final_norm.out"  # post-LN OPT: the last layer's output, the LM head's input
    _in_training(model.train(), batch, tmp_path / "train")
    path = _rollouts_file(batch, tmp_path / "r.parquet")
    res = probe_rollouts(model, None, path, tmp_path / "off", batch_size=8, analyses="none", objective=None)
    assert res.tokens == int(batch[3].sum())

    gap = _logp_gap(tmp_path / "off")
    key = ["point", "bin", "quantity"]
    train = _frame(tmp_path / "train", "binstats")
    both = train.join(_frame(tmp_path / "off", "binstats"), on=key, suffix="_off")
    assert both.height == train.height > 0 and (both["count"] == both["count_off"]).all()
    assert set(both["point"]) == set(names)
    worst = 0.0
    for row in both.filter(pl.col("count") > 0).iter_rows(named=True):
        for stat in ("sum", "min", "max"):
            a, b = row[stat], row[f"{stat}_off"]
            worst = max(worst, abs(a - b) / max(abs(a), abs(b), 1e-30))
    print(f"{family}: max |log pi - old_logp| {gap:.2g}; binstats max rel diff vs training {worst:.2g}")
    assert gap < 1e-5 and worst < 1e-5
    checks = _frame(tmp_path / "off", "checks")
    # every family, post-LN OPT included (its last layer's output is the LM head's input)
    assert checks.height > 0 and checks["identity_violations"].sum() == 0


def test_absolute_positions_need_the_masks(tmp_path):
    """The test above can fail: GPT-2 read at 0..S-1 (the model's default) misreads the left-padded rows."""
    model = _model("gpt2").eval()
    path = _rollouts_file(_sampled_batch(model), tmp_path / "r.parquet")
    probe_rollouts(model, None, path, tmp_path / "off", analyses="none", positions="model")
    assert _logp_gap(tmp_path / "off") > 1e-2
