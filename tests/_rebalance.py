"""Tiny real models and batches for the rebalancing-analysis tests (shares, probability change, influence)."""

from __future__ import annotations

import torch
from _models import tiny_qwen2
from transformers import Qwen2ForCausalLM

from tokendyn.probe.tokenloss import ProbeBatch

VOCAB = 97
TEMPERATURE = 0.7


def tiny_model(
    seed: int = 0, attn: str = "eager", dtype: torch.dtype = torch.float32, sharpen: float = 20.0
) -> Qwen2ForCausalLM:
    """A random Qwen2ForCausalLM (hidden 32, 2 layers, untied head, `tests._models.tiny_qwen2`); the LM head is
    scaled by ``sharpen`` so that the sampled tokens' pi spreads over (0, 1)."""
    return tiny_qwen2(seed, vocab=VOCAB, hidden=32, layers=2, attn=attn, sharpen=sharpen).to(dtype).train()


def tiny_batch(
    model,
    n: int = 6,
    prompt: int = 5,
    completion: int = 8,
    seed: int = 1,
    pad: bool = True,
    old_logp: bool = False,
) -> ProbeBatch:
    """Random prompts (row 1 left-padded by 2 when ``pad``), completions sampled from the model at T=0.7, ragged
    completion masks, one advantage per completion (row 1 exactly 0), optionally a perturbed pi_old."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, prompt + completion), generator=g)
    attn = torch.ones_like(ids)
    if pad:
        attn[1, :2] = 0
    with torch.no_grad():
        for j in range(completion):
            logits = model(input_ids=ids, attention_mask=attn).logits[:, prompt - 1 + j].double()
            probs = torch.softmax(logits / TEMPERATURE, -1)
            ids[:, prompt + j] = torch.multinomial(probs, 1, generator=g).squeeze(1)
    lengths = torch.randint(3, completion + 1, (n,), generator=g)
    lengths[0] = completion
    cmask = (torch.arange(completion).unsqueeze(0) < lengths.unsqueeze(1)).long()
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[1] = 0.0
    old = None
    if old_logp:
        from tokendyn.probe.tokenloss import completion_logp

        base = ProbeBatch(ids, attn, cmask, adv, temperature=TEMPERATURE)
        with torch.no_grad():
            lp = completion_logp(model, base).double()
        old = (lp + 0.3 * torch.randn(lp.shape, generator=g, dtype=torch.float64)).clamp(max=0.0)
    return ProbeBatch(ids, attn, cmask, adv, old_logp=old, temperature=TEMPERATURE)
