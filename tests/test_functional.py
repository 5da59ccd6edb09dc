"""The pure advantage/mask functions of tokendyn.remedies, checked against the formulas and the paper."""

from __future__ import annotations

import math

import pytest
import torch

from tokendyn.remedies import (
    grpo_advantages,
    lopti_masks,
    lopti_threshold,
    reinforce_pp_advantages,
    reweight_advantages,
)

torch.set_num_threads(1)


# --------------------------------------------------------------------------------------------- GRPO advantages
def test_grpo_advantages_match_paper_extreme_value():
    # G = 8, one correct answer: |A|max = 2.475 (docs/paper.md §1.2; the ±2.47 extremes of Fig. 1b, §5)
    rewards = torch.tensor([3.0] + [-0.5] * 7 + [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    adv = grpo_advantages(rewards, group_size=8)
    assert adv.shape == (16,)
    assert adv[0].item() == pytest.approx(2.4748, abs=1e-4)
    # second group by hand: mean 4.5, unbiased std sqrt(6)
    expected = (torch.arange(1.0, 9.0) - 4.5) / (math.sqrt(6.0) + 1e-6)
    torch.testing.assert_close(adv[8:], expected)
    assert adv[:8].sum().abs() < 1e-5 and adv[8:].sum().abs() < 1e-5


def test_grpo_advantages_constant_group_and_singletons():
    adv = grpo_advantages(torch.tensor([2.0, 2.0, 2.0, 2.0]), group_size=4)
    assert torch.equal(adv, torch.zeros(4))
    single = grpo_advantages(torch.tensor([3.0, -1.0]), group_size=1)  # mean 0, std 1
    torch.testing.assert_close(single, torch.tensor([3.0, -1.0]) / (1 + 1e-6))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rewards": torch.zeros(6), "group_size": 4}, "group_size"),
        ({"rewards": torch.zeros(4), "group_size": 0}, "group_size"),
        ({"rewards": torch.zeros(2, 2), "group_size": 2}, "rewards"),
        ({"rewards": torch.zeros(4), "group_size": 2, "eps": -1.0}, "eps"),
    ],
)
def test_grpo_advantages_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        grpo_advantages(**kwargs)


# ------------------------------------------------------------------------------------------------ REINFORCE++
def test_reinforce_pp_whitens_over_valid_tokens_without_group_baseline():
    rewards = torch.tensor([3.0, 3.0, -0.5, -3.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    adv = reinforce_pp_advantages(rewards, mask)
    assert adv.shape == mask.shape
    assert torch.equal(adv[mask == 0], torch.zeros(int((mask == 0).sum())))
    # explicit token list: each valid token carries its completion's reward
    tokens = torch.cat([rewards[b].repeat(int(mask[b].sum())) for b in range(4)]).double()
    mu, var = tokens.mean(), tokens.var(unbiased=True)
    expected = ((rewards.double() - mu) / torch.sqrt(var + 1e-8)).float()
    for b in range(4):
        torch.testing.assert_close(adv[b, mask[b] == 1], expected[b].expand(int(mask[b].sum())))
    valid = adv[mask == 1].double()
    assert valid.mean().abs() < 1e-6 and valid.var(unbiased=True).item() == pytest.approx(1.0, abs=1e-6)
    # no group baseline: two completions with the same reward keep a non-zero advantage
    assert adv[0, 0] > 0 and adv[1, 0] > 0


def test_reinforce_pp_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least 2 valid tokens"):
        reinforce_pp_advantages(torch.tensor([1.0, 2.0]), torch.tensor([[1, 0], [0, 0]]))
    with pytest.raises(ValueError, match="completion_mask"):
        reinforce_pp_advantages(torch.tensor([1.0, 2.0]), torch.ones(3, 2))


# ------------------------------------------------------------------------------------------------- Reweight
def test_reweight_formula_both_signs_and_shapes():
    old_logp = torch.log(torch.tensor([[0.1, 0.5, 0.9], [0.2, 0.7, 1.0]]))
    adv = torch.tensor([2.0, -1.0])
    out = reweight_advantages(adv, old_logp, alpha=0.3)
    expected = (0.3 * old_logp.exp() + 0.7) * adv.unsqueeze(1)
    torch.testing.assert_close(out, expected)
    per_token = adv.unsqueeze(1).expand(2, 3).clone()
    torch.testing.assert_close(reweight_advantages(per_token, old_logp, 0.3), expected)
    assert torch.equal(reweight_advantages(adv, old_logp, 0.0), adv.unsqueeze(1).expand(2, 3))
    torch.testing.assert_close(reweight_advantages(adv, old_logp, 1.0), old_logp.exp() * adv.unsqueeze(1))


def test_reweight_scales_each_token_gradient_exactly(tiny_model_dir):
    """The parameter gradient that each sampled token sends back is scaled by alpha*pi_old + 1 - alpha."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").double()
    torch.manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (2, 7))
    logp = torch.log_softmax(model(ids).logits[:, :-1] / 0.7, dim=-1)
    logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (2, 6)
    old_logp = logp.detach()
    alpha, adv = 0.4, torch.tensor([1.5, -0.8], dtype=torch.float64)
    reweighted = reweight_advantages(adv, old_logp, alpha)
    params = [p for p in model.parameters() if p.requires_grad]
    for b, t in [(0, 0), (0, 4), (1, 2), (1, 5)]:
        g_rw = torch.autograd.grad(-(reweighted[b, t] * logp[b, t]), params, retain_graph=True)
        g_raw = torch.autograd.grad(-(adv[b] * logp[b, t]), params, retain_graph=True)
        w = alpha * math.exp(old_logp[b, t].item()) + 1 - alpha
        for a, r in zip(g_rw, g_raw, strict=True):  # HF computes RMSNorm in float32: relative rounding ~1e-7
            torch.testing.assert_close(a, w * r, rtol=0, atol=1e-6 * float(r.abs().max()) + 1e-12)
    # the weight is a constant: no gradient flows through pi_old
    assert not reweighted.requires_grad


def test_reweight_rejects_bad_arguments():
    old_logp = torch.zeros(2, 3)
    for alpha in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match=r"alpha .*\[0, 1\]"):
            reweight_advantages(torch.zeros(2), old_logp, alpha)
    with pytest.raises(ValueError, match="adv"):
        reweight_advantages(torch.zeros(3), old_logp, 0.5)
    with pytest.raises(ValueError, match="old_logp"):
        reweight_advantages(torch.zeros(2), torch.zeros(2), 0.5)


# ---------------------------------------------------------------------------------------------------- Lopti
def test_lopti_masks_strict_threshold_partition_and_order():
    probs = torch.tensor([[0.1, 0.5, 0.49, 0.9], [0.5, 0.2, 0.8, 0.3]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    low, high = lopti_masks(probs.log(), mask, eta=0.5)
    assert low.dtype == torch.bool
    assert low.tolist() == [[True, False, True, False], [False, True, False, False]]  # 0.5 is not < 0.5
    assert high.tolist() == [[False, True, False, True], [True, False, True, False]]
    assert not (low & high).any() and torch.equal(low | high, mask.bool())
    first, second = lopti_masks(probs.log(), mask, eta=0.5, order="high_first")
    assert torch.equal(first, high) and torch.equal(second, low)


def test_lopti_quantile_threshold_uses_valid_tokens_only():
    torch.manual_seed(0)
    probs = torch.rand(4, 6) * 0.98 + 0.01
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    probs_with_junk = probs.clone()
    probs_with_junk[mask == 0] = 1e-6  # padding must not move the threshold
    thr = lopti_threshold(probs_with_junk.log(), mask, 0.3)
    expected = torch.quantile(probs[mask == 1].double(), 0.3)
    assert thr.item() == pytest.approx(expected.item(), rel=1e-6)
    low, high = lopti_masks(probs_with_junk.log(), mask, quantile=0.3)
    assert not low[mask == 0].any() and not high[mask == 0].any()
    assert torch.equal(low, (probs_with_junk.double() < expected) & mask.bool())
    n_valid = int(mask.sum())
    assert int(low.sum()) == math.ceil(0.3 * (n_valid - 1))  # linear interpolation between order statistics


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one of eta and quantile"),
        ({"eta": 0.5, "quantile": 0.5}, "exactly one of eta and quantile"),
        ({"eta": 0.0}, r"eta must be in \(0, 1\)"),
        ({"eta": 1.0}, r"eta must be in \(0, 1\)"),
        ({"quantile": 1.2}, r"quantile must be in \(0, 1\)"),
        ({"eta": 0.5, "order": "sideways"}, "order must be one of"),
    ],
)
def test_lopti_masks_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lopti_masks(torch.zeros(2, 3), torch.ones(2, 3), **kwargs)


def test_lopti_masks_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="completion_mask"):
        lopti_masks(torch.zeros(2, 3), torch.ones(2, 4), eta=0.5)
