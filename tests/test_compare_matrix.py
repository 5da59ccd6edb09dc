"""The paired comparison across the configuration matrix's architectures and adapters (`tests/_matrix.py`): the
recorded dpi of the base and Reweight rules at equal ||dtheta||, on the float32 model and on its float64 copy, against
a plain-torch update of the float64 copy (adapter included), written here and run float64 at every op
(`exact_float64`: a plain float64 copy of most of these architectures computes its norms, rotary embedding or
softmax in float32). The comparison's steps are float64 (its default precision), so on the float32 model too they
agree to float64 rounding; with precision "model" the float32 model's own steps are within 2e-3 of the change plus
the 3e-7 resolution of its pi. bf16 is not crossed: a bf16 copy has no float64 reference of the same update."""

from __future__ import annotations

import copy

import pytest
import torch
from _matrix import ADAPTERS, ARCHS, PROMPT, T, build, sample_batch, token_logps, with_adapter

from tokendyn.effects.compare import compare_rules, make_rule
from tokendyn.effects.shares import token_shares, token_shares_many
from tokendyn.probe.float64 import exact_float64
from tokendyn.probe.tokenloss import Objective, ProbeBatch

torch.set_num_threads(1)
LR, ALPHA = 1e-2, 0.3


def plain_dpi(model64, b, rule: str) -> torch.Tensor:
    """dpi after one SGD step of ||dtheta|| = LR ||g_base||, the on-policy token-mean surrogate, in float64."""
    m = b.completion_mask.double()
    with torch.no_grad():
        old = token_logps(model64, b.input_ids)
    adv = b.advantages.double().unsqueeze(1).expand_as(old)

    def grad(model, a):
        logp = token_logps(model, b.input_ids)
        loss = -(a * torch.exp(logp - old) * m).sum() / m.sum()
        return torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])

    def norm(gs):
        return sum(float((x**2).sum()) for x in gs) ** 0.5

    target = LR * norm(grad(model64, adv))
    a = adv * (ALPHA * torch.exp(old) + 1 - ALPHA) if rule == "reweight" else adv
    work = copy.deepcopy(model64)
    gs = grad(work, a)
    with torch.no_grad():
        for p, g in zip([p for p in work.parameters() if p.requires_grad], gs, strict=True):
            p.sub_(target / norm(gs) * g)
        return (torch.exp(token_logps(work, b.input_ids)) - torch.exp(old)) * m


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_paired_dpi_against_float64_on_every_architecture(arch, adapter):
    if adapter == "lora":
        pytest.importorskip("peft")
    model = with_adapter(build(arch), adapter).eval()
    b = sample_batch(model)
    model64 = copy.deepcopy(model).double().eval()
    c = b.completion_mask.size(1)
    batch = ProbeBatch(
        b.input_ids, torch.ones_like(b.input_ids), b.completion_mask.bool(), b.advantages, temperature=T
    )
    assert batch.n_completion == c and b.input_ids.size(1) == PROMPT + c
    rules = [make_rule(n, Objective(eps_low=0.2, eps_high=0.24), alpha=ALPHA) for n in ("base", "reweight")]
    with exact_float64():
        want = {rule: plain_dpi(model64, b, rule) for rule in ("base", "reweight")}
    # float64 steps (the default) are exact on either model; the float32 model's own steps (precision "model") see
    # its pi to ~1e-7 (the logits' rounding): there the bound is relative to the change plus that resolution
    cases = ((model64, "float64", 1e-8, 0.0), (model, "float64", 1e-8, 0.0), (model, "model", 2e-3, 3e-7))
    for mdl, precision, rel, floor in cases:
        results = compare_rules(mdl, batch, rules, lr=LR, shares=False, precision=precision)
        for rule, w in want.items():
            got = results[(rule, "equal_norm")].delta
            scale = float(w.abs().max())
            assert scale > 1e-8, (arch, adapter, rule)
            err = float((got - w).abs().max())
            assert err <= rel * scale + floor, (arch, adapter, rule, precision, err, scale)


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_share_jvps_on_every_architecture(arch, adapter):
    """Two rules' share JVPs in one vmapped forward-mode pass (`token_shares_many`, no fallback: ``strict``), the
    base and the Reweight rule's advantages along two directions, against one `token_shares` each, on the float64
    copy of every architecture and adapter."""
    if adapter == "lora":
        pytest.importorskip("peft")
    model = copy.deepcopy(with_adapter(build(arch), adapter)).double().eval()
    b = sample_batch(model)
    batch = ProbeBatch(
        b.input_ids, torch.ones_like(b.input_ids), b.completion_mask.bool(), b.advantages, temperature=T
    )
    from dataclasses import replace

    from tokendyn.effects.change import fix_pi_old
    from tokendyn.probe.tokenloss import trainable_parameters

    batch, _ = fix_pi_old(model, batch)
    reweighted = replace(batch, advantages=batch.advantages * 0.7 + 0.1)
    g = torch.Generator().manual_seed(3)
    params = trainable_parameters(model)
    dirs = [
        {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in params.items()} for _ in range(2)
    ]
    objective = Objective(eps_low=0.2, eps_high=0.24)
    items = [(batch, dirs[0], objective), (reweighted, dirs[1], objective)]
    with exact_float64():
        many = token_shares_many(model, items, strict=True)
        for (bt, d, o), got in zip(items, many, strict=True):
            one = token_shares(model, bt, d, objective=o)
            assert float(one.abs().max()) > 0, (arch, adapter)
            assert float((got - one).abs().max()) <= 1e-10 * float(one.abs().max()), (arch, adapter)


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_lopti_first_stage_kept_on_every_architecture(arch, adapter, monkeypatch):
    """Lopti's first stage at theta_0 as the analyses keep it (the sum of the influence sources below eta, steps in
    the float32 model's own dtype) against that stage's gradient by float64 autograd of the clipped surrogate written
    here (pi_old one update behind: ratios != 1, clipping active), on every architecture and adapter; and, on the
    float64 copy, the comparison's Lopti made from the stage it kept (taken: the stage's own forward and backward
    skipped) against Lopti's two float64 SGD stages of a copy at the comparison's lr."""
    import tokendyn.effects.compare as compare_module
    from tokendyn.effects.rebalance import RebalanceOptions, analyze_update
    from tokendyn.probe.tokenloss import trainable_parameters

    if adapter == "lora":
        pytest.importorskip("peft")
    model = with_adapter(build(arch), adapter).eval()
    b = sample_batch(model)
    mask = b.completion_mask.bool()
    batch = ProbeBatch(b.input_ids, torch.ones_like(b.input_ids), mask, b.advantages, temperature=T)
    batch = batch.with_old_logp(b.old_logp)
    # bins at pi_old's quartiles, eta the median: between tokens
    pi = torch.exp(b.old_logp.double())[mask].sort().values
    q = [float(pi[i - 1] + pi[i]) / 2 for i in (len(pi) // 4, len(pi) // 2, 3 * len(pi) // 4)]
    edges, eta = [0.0, *q, 1.0], q[1]
    objective = Objective(eps_low=0.2, eps_high=0.24, loss_type="dapo")
    opts = RebalanceOptions(lr=LR, token_shares=2, step_precision="model")  # (a full update needs its shares)
    _, full = analyze_update(model, batch, step=0, edges=edges, options=opts, objective=objective,
                             first_stage=(eta, "low_first"))  # fmt: skip
    low = (torch.exp(b.old_logp.double()) < eta) & mask
    assert full.first_stage is not None and torch.equal(full.first_stage.mask, low), (arch, adapter)

    model64 = copy.deepcopy(model).double().eval()
    params64 = trainable_parameters(model64)
    old, adv = b.old_logp.double(), b.advantages.double().unsqueeze(1)

    def stage_gradient(work, keep):
        logp = token_logps(work, b.input_ids)
        r = torch.exp((logp - old) * mask)
        pg = -torch.minimum(r * adv, torch.clamp(r, 0.8, 1.24) * adv)
        loss = (pg * keep.double()).sum() / mask.sum()
        params = trainable_parameters(work)
        return dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))

    with exact_float64():
        want = stage_gradient(model64, low)
    assert want.keys() == full.first_stage.gradient.keys() == params64.keys()
    scale = max(float(w.abs().max()) for w in want.values())
    assert scale > 0, (arch, adapter)
    # float32 gradients of float32 weights: within 1e-5 of the largest entry
    for name, got in full.first_stage.gradient.items():
        err = float((got.double() - want[name]).abs().max())
        assert err <= 1e-5 * scale, (arch, adapter, name, err, scale)

    taken = []

    def observed(*args, **kwargs):
        out = given(*args, **kwargs)
        taken.append(out is not None)
        return out

    # the comparison on the float64 copy, float64 at every op (its own dtype's steps: float64)
    given = compare_module.given_first_stage
    monkeypatch.setattr(compare_module, "given_first_stage", observed)
    rules = [make_rule(n, objective, alpha=ALPHA, eta=eta) for n in ("base", "lopti")]
    with exact_float64():
        _, full = analyze_update(model64, batch, step=0, edges=edges, options=opts, objective=objective,
                                 first_stage=(eta, "low_first"))  # fmt: skip
        got = compare_rules(model64, batch, rules, lr=LR, shares=False, precision="model", full=full)
    got = got[("lopti", "equal_norm")]
    assert True in taken, (arch, adapter, taken)
    work = copy.deepcopy(model64)
    with exact_float64():
        for keep in (low, mask & ~low):
            grads = stage_gradient(work, keep)
            with torch.no_grad():
                for name, p in trainable_parameters(work).items():
                    p.sub_(got.lr * grads[name])
        with torch.no_grad():
            after, before = (torch.exp(token_logps(m, b.input_ids)) for m in (work, model64))
            dpi = (after - before) * mask
    scale = float(dpi.abs().max())
    assert scale > 1e-8, (arch, adapter)
    err = float((got.delta - dpi).abs().max())
    assert err <= 1e-8 * scale, (arch, adapter, err, scale)
