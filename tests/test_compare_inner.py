"""The paired comparison where the ratio-based rules differ: k > 1 updates per rule on the same batch (pi_old fixed at
theta_0, as TRL's num_iterations), so r != 1 from the second update on. At k = 1 (r = 1) DPPO, ASPO and CE-GPPO are
GRPO exactly; at k = 3 they differ from it and each equals a plain-torch loop written here from its closed-form
per-token gradient (test_both_camps.py), on a float64 copy of the model; and the equal norm holds: at the lr the
comparison settled on, the plain loop's displacement is the base rule's at lr within 5 % (DPPO-TV's grows as lr^5
there)."""

from __future__ import annotations

import copy
import math

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


def plain_compare(model, batch, k, lrs):
    """(dpi of every rule at its lr in ``lrs``, its ||dtheta|| over the base rule's at LR), on a float64 copy."""
    model = copy.deepcopy(model).double().eval()
    with exact_float64(), torch.no_grad():
        old, _ = logp_entropy(model, batch)
    out, ratio = {}, {}
    with exact_float64():
        _, target = plain_steps(model, batch, "base", old, k, LR)
        for name in NAMES:
            work, achieved = plain_steps(model, batch, name, old, k, lrs[name])
            ratio[name] = achieved / target
            with torch.no_grad():
                out[name] = (torch.exp(logp_entropy(work, batch)[0]) - torch.exp(old)) * batch.completion_mask
    return out, ratio


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
    want, ratio = plain_compare(model, batch, 3, {n: three[(n, "equal_norm")].lr for n in NAMES})
    base3 = three[("base", "equal_norm")].delta
    scale = float(base3.abs().max())
    for name in NAMES:
        got = three[(name, "equal_norm")].delta
        err = float((got - want[name]).abs().max()) / float(want[name].abs().max())
        apart = float((got - base3).abs().max()) / scale
        print(f"k = 3, {name}: against the plain loop {err:.1e}; apart from GRPO {apart:.1e}")
        assert err < 1e-8, (name, err)
        # equal norm: the plain loop's displacement at the rule's lr is the base rule's at LR, within 5 %
        assert abs(math.log(ratio[name])) <= math.log(1.05), (name, ratio[name])
        assert abs(ratio[name] / three[(name, "equal_norm")].norm_ratio - 1) < 1e-8, name
        if name != "base":
            assert apart > 1e-3, (name, apart)


def test_a_rule_whose_updates_leave_the_local_regime_is_null_and_leaves_the_others_and_the_model_as_they_were(
    setup,
):
    """At a step far beyond the local regime (lr 1 on the embedded default policy, two updates per stage: the base
    rule's second update moves theta by 3e4 of its norm) Lopti's second stage is not finite: it is `diverged` (warned,
    every measured column of its rows null), while the base rule's result is bitwise the one it has compared alone,
    Reweight's is at the equal norm, and the model's parameters are bitwise theta_0 again. (As on SmolLM2-135M at the
    paper's lr 1e-3, where the study's first both-camps run logged NaN norms.) A rule the lr search leaves off the
    equal norm is `diverged` too: DPPO-TV at k = 3 on the tiny model with one correction only (0.0013x)."""
    import math
    from pathlib import Path

    import polars as pl

    import tokendyn
    from tokendyn.effects.compare import DivergedStepWarning, paired_frame
    from tokendyn.effects.shares import as_edges
    from tokendyn.probe.tokenloss import pi_old

    model, batch = float64_probe_setup(Path(tokendyn.__file__).parent / "default_policy", 11, TEMP)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rules = [
        make_rule("base", BASE),
        make_rule("lopti", BASE, eta=0.5),
        make_rule("reweight", BASE, alpha=0.3),
    ]
    with pytest.warns(DivergedStepWarning) as caught:
        out = compare_rules(model, batch, rules, modes=("equal_norm",), lr=1.0, inner_steps=2)
    alone = compare_rules(model, batch, rules[:1], modes=("equal_norm",), lr=1.0, inner_steps=2)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    base, lopti, rew = (out[(r.name, "equal_norm")] for r in rules)
    print(f"lr 1: base ||dtheta||/||theta|| {base.param_step:.3g}; lopti {lopti.param_step}; reweight "
          f"{rew.param_step:.3g} at {rew.norm_ratio:.3g}x the equal norm")  # fmt: skip
    assert not base.diverged and torch.equal(base.delta, alone[("base", "equal_norm")].delta)
    assert lopti.diverged and math.isnan(lopti.param_step) and lopti.resolution is None
    assert not rew.diverged and abs(math.log(rew.norm_ratio)) <= math.log(1.05)
    assert {str(w.message).split(")")[0] for w in caught if w.category is DivergedStepWarning} == {
        "compare (rule lopti, mode equal_norm"
    }
    frame = paired_frame(out, batch, pi_old(model, batch), as_edges(None), step=0)
    for name, diverged in (("base", False), ("lopti", True), ("reweight", False)):
        rows = frame.filter(pl.col("rule") == name)
        assert rows.height and rows["diverged"].to_list() == [diverged] * rows.height
        measured = ("count", "up_pos", "sum_dpi", "sum_diff", "sum_share")
        assert all(rows[c].null_count() == (rows.height if diverged else 0) for c in measured), name
    assert frame.filter(pl.col("rule") == "lopti")["param_step"].null_count() > 0
    # within the local regime (the tiny model at this module's lr) nothing is flagged
    local = compare_rules(*setup, rules, lr=LR, inner_steps=2)
    assert not any(r.diverged for r in local.values())
    dppo = [make_rule("base", BASE), make_rule("dppo_tv", BASE)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tokendyn.effects.compare.NORM_PASSES", 1)
        with pytest.warns(DivergedStepWarning, match="rule dppo_tv.*the equal norm after the lr correction"):
            once = compare_rules(*setup, dppo, lr=LR, inner_steps=3, shares=False)
    assert once[("dppo_tv", "equal_norm")].diverged and once[("dppo_tv", "equal_norm")].norm_ratio < 0.5
