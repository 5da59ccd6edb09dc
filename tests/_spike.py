"""A planted spike with a known culprit, for the spike tests and bench/spike_localise.py.

The model samples its own completions (T = 1) to a few prompts; in one of them, at the scored position where some token
other than the sampled one has pi closest to ``target`` (pi measured by a plain forward in float64, not by the code
under test), that token is put in, and the completion ends there (its later tokens were sampled after another token).
That completion gets the advantage ``big``, every other one +-``calm`` (a calm batch): the planted token is the
culprit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokendyn.probe.tokenloss import ProbeBatch


@dataclass
class Planted:
    batch: ProbeBatch
    row: int
    pos: int
    token_id: int
    pi: float  # the planted token's pi, float64 forward
    text: str


def sampled_batch(model, tok, prompts: list[str], *, n_return: int, max_new_tokens: int, seed: int):
    """(input_ids, attention_mask, completion_mask, P) of the model's own samples, the completion cut after eos."""
    enc = tok(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=max_new_tokens,
            num_return_sequences=n_return,
            pad_token_id=tok.pad_token_id,
        )
    p = enc["input_ids"].shape[1]
    comp = out[:, p:]
    cmask = torch.ones_like(comp, dtype=torch.bool)
    for i in range(comp.size(0)):
        hit = (comp[i] == tok.eos_token_id).nonzero()
        if len(hit):
            cmask[i, int(hit[0, 0]) + 1 :] = False
    attn = torch.cat([enc["attention_mask"].repeat_interleave(n_return, 0), cmask.long()], 1)
    return out.clone(), attn, cmask, p


def plant_spike(
    model,
    tok,
    prompts: list[str],
    *,
    n_return: int = 2,
    max_new_tokens: int = 32,
    target: float = 1e-4,
    big: float = 3.0,
    calm: float = 0.1,
    seed: int = 0,
    row: int | None = None,
    min_pos: int = 4,
) -> Planted:
    """The planted spike of the module docstring, in row ``row`` (default: the middle one)."""
    ids, attn, cmask, p = sampled_batch(model, tok, prompts, n_return=n_return, max_new_tokens=max_new_tokens,
                                        seed=seed)  # fmt: skip
    b, c = cmask.shape
    r = b // 2 - 1 if row is None else row
    with torch.no_grad():
        logits = model.eval()(ids[r : r + 1], attention_mask=attn[r : r + 1]).logits[0, p - 1 : -1]
    logp = torch.log_softmax(logits.double(), -1)
    dist = (logp - torch.log(torch.tensor(target, dtype=torch.float64))).abs()
    dist[torch.arange(c), ids[r, p:]] = float("inf")  # another token than the sampled one
    dist[:, list(getattr(tok, "all_special_ids", []))] = float("inf")
    dist[~cmask[r]] = float("inf")
    dist[: min(min_pos, c - 1)] = float("inf")
    best = dist.min(-1)
    j = int(best.values.argmin())
    tid = int(best.indices[j])
    ids[r, p + j] = tid
    cmask[r, j + 1 :] = False
    attn[r, p + j + 1 :] = 0
    adv = torch.tensor([calm if i % 2 == 0 else -calm for i in range(b)], dtype=torch.float64)
    adv[r] = big
    batch = ProbeBatch(ids, attn, cmask, adv, temperature=1.0)
    return Planted(batch, r, j, tid, float(logp[j, tid].exp()), tok.decode([tid]))
