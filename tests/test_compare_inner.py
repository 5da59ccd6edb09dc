"""The paired comparison where the ratio-based rules differ: k > 1 updates per rule on the same batch (pi_old fixed at
theta_0, as TRL's num_iterations), so r != 1 from the second update on. At k = 1 (r = 1) DPPO, ASPO and CE-GPPO are
GRPO exactly; at k = 3 they differ from it and each equals a plain-torch loop written here from its closed-form
per-token gradient (test_both_camps.py), with the comparison's equal-norm rule (plain SGD at one lr, corrected once
to the first rule's displacement) written out too, on a float64 copy of the model."""

from __future__ import annotations

import copy

import pytest
import torch
from _models import float64_probe_setup
from test_both_camps import aspo_closed_form, ce_gppo_closed_form

from tokendyn.effects.compare import compare_rules, make_rule
from tokendyn.probe.float64 import exact_float64
from tokendyn.probe.tokenloss import Objective

torch.set_num_threads(1)
TEMP, LR = 0.7, 0.02
BASE = Objective(eps_low=0.2, eps_high=0.24, loss_type="dapo")
NAMES = ("base", "dppo_tv", "aspo", "ce_gppo")


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    return float64_probe_setup(tiny_model_dir, 5, TEMP)


def logp_entropy(model, batch):
    c = batch.n_completion
    z = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, -c - 1 : -1] / TEMP
    lsm = torch.log_softmax(z.double(), -1)
    logp = lsm.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    return logp, -(lsm.exp() * lsm).sum(-1)


def closed_gradient(name, old, logp, adv, mask, entropy):
    """dL/dlog pi of each rule at the current log pi (pi_old fixed), dapo's token mean."""
    n = mask.sum()
    r = torch.exp(logp - old)
    if name == "base":  # GRPO: -A r 1[unclipped], clip 0.8 / 1.24
        w = r * torch.where(adv > 0, r <= 1.24, r >= 0.8)
    elif name == "dppo_tv":  # -A min(r, C) M, delta 0.15, C 1e4
        d = torch.exp(logp) - torch.exp(old)
        w = torch.clamp(r, max=1e4) * torch.where(adv > 0, d <= 0.15, d >= -0.15)
    elif name == "aspo":
        return aspo_closed_form(old, logp, adv, mask, entropy)
    else:
        return ce_gppo_closed_form(
            old, logp, adv, mask, eps_low=0.2, eps_high=0.24, beta1=0.5, beta2=1.0, c=10.0
        )
    return torch.where(mask, -w * adv, torch.zeros_like(w)) / n


def plain_steps(model, batch, name, old, k, lr):
    """k SGD steps at lr on a copy, each on the loss sum_t sg(g_t) log pi_t (gradient: the rule's closed form);
    returns the copy and its displacement norm."""
    work = copy.deepcopy(model)
    theta0 = [p.detach().clone() for p in work.parameters()]
    adv = batch.advantages.double()
    for _ in range(k):
        logp, entropy = logp_entropy(work, batch)
        g = closed_gradient(name, old, logp.detach(), adv, batch.completion_mask, entropy.detach())
        grads = torch.autograd.grad((g * logp).sum(), list(work.parameters()))
        with torch.no_grad():
            for p, x in zip(work.parameters(), grads, strict=True):
                p.sub_(lr * x)
    norm = sum(float(((p - q) ** 2).sum()) for p, q in zip(work.parameters(), theta0, strict=True)) ** 0.5
    return work, norm


def plain_compare(model, batch, k):
    """dpi of every rule, the comparison's equal-norm rule for k > 1 written out, on a float64 copy."""
    model = copy.deepcopy(model).double().eval()
    with exact_float64(), torch.no_grad():
        old, _ = logp_entropy(model, batch)
    out, target = {}, None
    with exact_float64():
        for name in NAMES:
            work, achieved = plain_steps(model, batch, name, old, k, LR)
            if target is None:
                target = achieved
            else:
                work, _ = plain_steps(model, batch, name, old, k, LR * target / achieved)
            with torch.no_grad():
                out[name] = (torch.exp(logp_entropy(work, batch)[0]) - torch.exp(old)) * batch.completion_mask
    return out


def test_at_one_update_the_ratio_rules_are_grpo_and_at_three_they_differ_and_equal_their_reference(setup):
    model, batch = setup
    rules = [make_rule(n, BASE) for n in NAMES]
    one = compare_rules(model, batch, rules, modes=("equal_norm",), lr=LR, shares=False)
    base1 = one[("base", "equal_norm")].delta
    for name in NAMES[1:]:
        diff = float((one[(name, "equal_norm")].delta - base1).abs().max()) / float(base1.abs().max())
        print(f"k = 1, {name}: max |dpi - dpi(GRPO)| / max |dpi| = {diff:.1e}")
        assert diff < 1e-12, (name, diff)
    three = compare_rules(model, batch, rules, modes=("equal_norm",), lr=LR, shares=False, inner_steps=3)
    want = plain_compare(model, batch, 3)
    base3 = three[("base", "equal_norm")].delta
    scale = float(base3.abs().max())
    for name in NAMES:
        got = three[(name, "equal_norm")].delta
        err = float((got - want[name]).abs().max()) / float(want[name].abs().max())
        apart = float((got - base3).abs().max()) / scale
        print(f"k = 3, {name}: against the plain loop {err:.1e}; apart from GRPO {apart:.1e}")
        assert err < 1e-8, (name, err)
        if name != "base":
            assert apart > 1e-3, (name, apart)
