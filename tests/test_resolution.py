"""Probability changes resolved near pi = 1 (docs/definitions.md, "Probability change and correct ratios": the sign
is right near pi = 1).

The reference is independent of the code under test: the same network in float64 end to end (``model.double()``),
and, for the real change, an update whose direction is known analytically (scaling the final norm's weight by
1 + eps multiplies every logit by 1 + eps, which raises pi of every position's arg-max token).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from _rebalance import VOCAB, tiny_model

from tokendyn.effects.change import correct_ratios, counterfactual_change, real_change
from tokendyn.probe.float64 import exact_float64
from tokendyn.probe.tokenloss import ProbeBatch, completion_logp

torch.set_num_threads(1)
PROMPT, COMPLETION, ROWS = 5, 8, 16


def _greedy_batch(model, temperature: float | None = None, advantages: float = 1.0) -> ProbeBatch:
    """Greedy completions (every token the arg-max of its position), advantages all ``advantages``; the
    temperature, if None, is chosen so that the median token has 1 - pi of about 1e-7 (float64 reference)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (ROWS, PROMPT + COMPLETION), generator=g)
    attn = torch.ones_like(ids)
    with torch.no_grad():
        for j in range(COMPLETION):
            ids[:, PROMPT + j] = (
                model(input_ids=ids, attention_mask=attn).logits[:, PROMPT - 1 + j].argmax(-1)
            )
    cmask = torch.ones(ROWS, COMPLETION, dtype=torch.long)
    adv = torch.full((ROWS,), advantages, dtype=torch.float64)
    if temperature is None:
        with torch.no_grad():
            z = model.double()(input_ids=ids, attention_mask=attn).logits[:, PROMPT - 1 : -1]
            model.float()
        top2 = z.topk(2, dim=-1).values
        margin = (top2[..., 0] - top2[..., 1]).median()
        temperature = float(margin / 16.0)  # exp(-16) ~ 1.1e-7 for the median token's nearest rival
    return ProbeBatch(ids, attn, cmask, adv, temperature=temperature)


def _one_minus_pi64(model, batch: ProbeBatch) -> torch.Tensor:
    """1 - pi of every completion token, from the float64 network (the reference)."""
    m64 = copy.deepcopy(model).double().eval()
    with torch.no_grad(), exact_float64():
        logp = completion_logp(m64, batch, float64=True)
    return -torch.expm1(logp)


def test_near_certain_tokens_whose_logits_rise_all_count_as_rising():
    model = tiny_model(sharpen=20.0).eval()
    batch = _greedy_batch(model)
    gap = _one_minus_pi64(model, batch)
    near = (gap > 1e-10) & (gap < 1e-5)
    assert int(near.sum()) >= 10, f"the setup must hold near-certain tokens, got 1 - pi = {gap.flatten()}"
    after = copy.deepcopy(model)
    with torch.no_grad():
        after.model.norm.weight.mul_(1.0 + 1e-3)  # every logit x (1 + 1e-3): each arg-max token's pi rises
    with exact_float64():
        ref = -torch.expm1(completion_logp(copy.deepcopy(after).double(), batch, float64=True).detach()) - gap
    assert bool((ref[near] < 0).all()), "premise: in float64 every near-certain arg-max token rose"
    delta = real_change(model, after, batch)
    r = correct_ratios(delta, batch.advantages, near)
    assert r["n_pos"] == int(near.sum())
    assert r["tie_pos"] == 0 and r["correct_pos"] == 1.0, r
    # the same tokens read in float32 (the old measurement) show nothing: a tie for every one of them
    with torch.no_grad():
        lp32 = completion_logp(model.eval(), batch).double().exp()
        lp32_after = completion_logp(after.eval(), batch).double().exp()
    assert int(((lp32_after - lp32)[near] == 0).sum()) > int(near.sum()) // 2


@pytest.mark.parametrize("precision", ["float64", "model"])
def test_counterfactual_signs_agree_with_a_float64_network(precision):
    """The paper's SGD step (lr 1e-3) on the float32 model against the same step on the float64 model: every token
    whose float64 change is clearly resolved has the same sign, near-certain tokens included."""
    model = tiny_model(sharpen=20.0).eval()
    batch = _greedy_batch(model)
    adv = torch.linspace(-1.5, 1.5, ROWS, dtype=torch.float64)
    batch = ProbeBatch(
        batch.input_ids, batch.attention_mask, batch.completion_mask, adv, temperature=batch.temperature
    )
    gap = _one_minus_pi64(model, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # precision "model": the float32 step is flagged as not resolved
        res32 = counterfactual_change(model, batch, lr=1e-3, precision=precision).delta["train"]
    with exact_float64():
        res64 = counterfactual_change(copy.deepcopy(model).double(), batch, lr=1e-3, precision="model")
    res64 = res64.delta["train"]
    mask = batch.completion_mask & (res64.abs() > 1e-13)
    near = mask & (gap < 1e-5)
    assert int(near.sum()) >= 10
    agree = (torch.sign(res32) == torch.sign(res64))[mask]
    assert bool(agree.all()), f"{int((~agree).sum())} of {int(mask.sum())} signs differ"
    ratio32 = correct_ratios(res32, batch.advantages, near)
    ratio64 = correct_ratios(res64, batch.advantages, near)
    assert ratio32["tie_pos"] == 0 and ratio32["correct_pooled"] == ratio64["correct_pooled"]
