"""Probability change, correct ratios, the influence matrix and the per-batch analysis records
(tokendyn.effects.change / influence / rebalance)."""

from __future__ import annotations

import copy
import math
import warnings

import polars as pl
import pytest
import torch
from _rebalance import TEMPERATURE, tiny_batch, tiny_model

from tokendyn.effects.change import (
    InPlaceUpdate,
    change_frame,
    completion_probs,
    correct_ratios,
    counterfactual_change,
    delta_summary,
    fix_pi_old,
    real_change,
    sgd,
)
from tokendyn.effects.influence import influence, lopti_stage_masks
from tokendyn.effects.rebalance import RebalanceOptions, analyze_batch, real_change_frame
from tokendyn.effects.shares import as_edges, bin_gradients
from tokendyn.probe.float64 import exact_float64
from tokendyn.probe.tokenloss import Objective, ProbeBatch, bin_index, completion_logp, token_loss
from tokendyn.records import SCHEMAS
from tokendyn.records import write_frames as write_records

torch.set_num_threads(1)
LR = 1e-3


@pytest.fixture(scope="module")
def model():
    return tiny_model(attn="eager")


@pytest.fixture(scope="module")
def batch(model):
    return tiny_batch(model)


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _unchanged(model, snap) -> bool:
    return all(torch.equal(p, snap[n]) for n, p in model.named_parameters()) and all(
        p.grad is None for p in model.parameters()
    )


def _hand_sgd(model, batch, masks, lr=LR, objective=None, make_opt=None):
    """SGD (or ``make_opt``) steps done by hand on a deep copy: backward of sum_{t in mask} l_t, then step;
    pi_old fixed at the start. Returns pi after each step."""
    work = copy.deepcopy(model).eval()
    with torch.no_grad():
        old = completion_logp(work, batch)
    fixed = batch if batch.old_logp is not None else batch.with_old_logp(old)
    opt = make_opt(list(work.parameters())) if make_opt else None
    out = []
    for mask in masks:
        work.zero_grad(set_to_none=True)
        terms = token_loss(work, fixed, objective).terms
        (terms if mask is None else terms * mask).sum().backward()
        if opt is None:
            with torch.no_grad():
                for p in work.parameters():
                    if p.grad is not None:
                        p -= lr * p.grad
        else:
            opt.step()
        with torch.no_grad():
            out.append(completion_logp(work, fixed).double().exp())
    return out


def test_counterfactual_all_tokens_equals_a_hand_sgd_step(model, batch):
    snap = _snapshot(model)
    res = counterfactual_change(model, batch, lr=LR)
    (pi_hand,) = _hand_sgd(model, batch, [None])
    assert _unchanged(model, snap) and model.training, "the model is untouched and its mode restored"
    assert torch.allclose(res.pi_after["train"], pi_hand, atol=1e-6, rtol=0)
    delta = res.delta["train"]
    assert float(delta[batch.completion_mask].abs().max()) > 1e-3, "the step moves the probabilities"
    assert float(delta[~batch.completion_mask].abs().max()) == 0.0
    assert torch.allclose(res.pi_before, completion_probs(model, batch))


def test_counterfactual_bin_masked_step_is_sgd_along_the_bin_gradient(model, batch):
    """A counterfactual restricted to bin b equals theta - lr g_b with g_b from `bin_gradients`."""
    grads = bin_gradients(model, batch)
    b = 0
    mask = grads.bins == b
    res = counterfactual_change(model, batch, [("b0", mask)], lr=LR)
    params = {n: p.detach() - LR * grads.per_bin[b][n] for n, p in model.named_parameters()}
    assert torch.allclose(res.pi_after["b0"], completion_probs(model, batch, params), atol=1e-6, rtol=0)


def test_lopti_stages_with_adam_carry_the_optimizer_state(model, batch):
    """Stage 2 starts from stage 1's parameters and optimizer state, pi_old fixed: against two Adam steps by hand."""
    low, high = lopti_stage_masks(batch, eta=0.5, pi_old=completion_probs(model, batch))
    assert low.any() and high.any() and not (low & high).any()
    assert torch.equal(low | high, batch.completion_mask)

    def adam(params):
        return torch.optim.Adam(params, lr=1e-3)

    obj = Objective(eps_low=0.2, eps_high=0.24)
    res = counterfactual_change(model, batch, [("low", low), ("high", high)], optimizer=adam, objective=obj)
    pi1, pi2 = _hand_sgd(model, batch, [low, high], objective=obj, make_opt=adam)
    assert torch.allclose(res.pi_after["low"], pi1, atol=1e-6, rtol=0)
    assert torch.allclose(res.pi_after["high"], pi2, atol=1e-6, rtol=0)
    assert torch.allclose(res.delta["high"], (pi2 - pi1) * batch.completion_mask, atol=1e-6, rtol=0)
    assert torch.allclose(res.delta["lopti"], res.delta["low"] + res.delta["high"], atol=1e-12)


class _InPlaceSGD(torch.optim.SGD):
    """Plain SGD that `InPlaceUpdate` cannot tell is plain: it steps the parameters in place, from a host copy."""


def test_model_dtype_sgd_steps_never_write_theta_0(model, batch):
    """Plain SGD in the model's dtype is stepped as new tensors swapped in (no copy of theta_0): the same floats as
    SGD's own in-place step from a host copy, through Lopti's two stages and the influence sources' restarts, and
    every parameter is afterwards the very tensor it was, never written (its storage and its version counter)."""
    low, high = lopti_stage_masks(batch, eta=0.5, pi_old=completion_probs(model, batch))
    stages = [("low", low), ("high", high)]
    snap = _snapshot(model)
    swapped = counterfactual_change(model, batch, stages, lr=LR, precision="model")
    in_place = counterfactual_change(
        model, batch, stages, optimizer=lambda ps: _InPlaceSGD(ps, lr=LR), precision="model"
    )
    for name in ("low", "high", "lopti"):
        assert torch.equal(swapped.delta[name], in_place.delta[name]), name
        assert swapped.param_step[name] == in_place.param_step[name]
    assert float(swapped.delta["lopti"][batch.completion_mask].abs().max()) > 1e-3
    inf = influence(model, batch, lr=LR, precision="model")
    inf_in_place = influence(
        model, batch, lr=LR, optimizer=lambda ps: _InPlaceSGD(ps, lr=LR), precision="model"
    )
    assert inf.deltas.keys() == inf_in_place.deltas.keys()
    assert all(torch.equal(inf.deltas[k], inf_in_place.deltas[k]) for k in inf.deltas)
    assert _unchanged(model, snap)
    before = {n: (p.data_ptr(), p._version) for n, p in model.named_parameters()}
    counterfactual_change(model, batch, stages, lr=LR, precision="model")
    influence(model, batch, lr=LR, precision="model")
    after = {n: (p.data_ptr(), p._version) for n, p in model.named_parameters()}
    assert after == before, "the swapped steps never write a parameter"


def test_float64_step_resolves_a_step_float32_loses(model, batch):
    """float64_step (the float32 gradient, the step and pi in float64) against every op in float64: a step far below
    float32's rounding of theta (lr 1e-9: float32 steps lose it) is made whole, through Lopti's two stages, to the
    float32 gradient's own rounding; theta_0 is never written; another optimizer than plain SGD falls back to the
    float64 path itself."""
    low, high = lopti_stage_masks(batch, eta=0.5, pi_old=completion_probs(model, batch))
    stages = [("low", low), ("high", high)]
    before = {n: (p.data_ptr(), p._version) for n, p in model.named_parameters()}
    snap = _snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the float32 steps are not resolved: that is the point)
        got = {pr: counterfactual_change(model, batch, stages, lr=1e-9, precision=pr)
               for pr in ("float64_step", "float64", "model")}  # fmt: skip
    for name in ("low", "high", "lopti"):
        want, step = got["float64"].delta[name], got["float64_step"].delta[name]
        scale = float(want.abs().max())
        assert scale > 0 and float((step - want).abs().max()) < 1e-5 * scale, name
        assert float((got["model"].delta[name] - want).abs().max()) > 0.1 * scale, name  # (float32 loses it)
        assert got["float64_step"].resolution[name].step_dtype == "float64"
        assert abs(got["float64_step"].param_step[name] / got["float64"].param_step[name] - 1) < 1e-5
    assert _unchanged(model, snap)
    assert {n: (p.data_ptr(), p._version) for n, p in model.named_parameters()} == before

    def adam(params):
        return torch.optim.Adam(params, lr=1e-3)

    a = counterfactual_change(model, batch, stages, optimizer=adam, precision="float64_step")
    b = counterfactual_change(model, batch, stages, optimizer=adam, precision="float64")
    assert all(torch.equal(a.delta[k], b.delta[k]) for k in b.delta)


def test_real_change_is_side_effect_free(model, batch):
    after = copy.deepcopy(model)
    with torch.no_grad():
        for p in after.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    model.train()
    after.train()
    before_pi = completion_probs(model, batch)
    d1 = real_change(model, after, batch)
    d2 = real_change(before_pi, after, batch)
    assert torch.equal(d1, d2)
    assert model.training and after.training
    assert all(p.grad is None for p in after.parameters())
    expect = (completion_probs(after, batch) - before_pi) * batch.completion_mask
    assert torch.allclose(d1, expect, atol=1e-12)
    df = real_change_frame(before_pi, after, batch, step=2)
    assert df["update"].unique().to_list() == ["real"]
    assert dict(df.schema) == SCHEMAS["prob_change"]


def test_correct_ratios_hand_checked():
    delta = torch.tensor([[0.1, -0.2, 0.0, 0.3], [-0.1, -0.05, 0.2, 0.4]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0], [-2.0, 0.0, 0.5, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    r = correct_ratios(delta, adv, mask)
    # A > 0: (0.1 up), (-0.2 down), (0.0 tie), (0.2 up) -> 2 / 3, one tie; A < 0: (0.3 up), (-0.1 down) -> 1 / 2
    assert (r["n_pos"], r["n_neg"], r["tie_pos"], r["tie_neg"]) == (4, 2, 1, 0)
    assert r["correct_pos"] == 2 / 3 and r["correct_neg"] == 0.5
    assert r["correct_pooled"] == 3 / 5
    all_ties = correct_ratios(torch.zeros_like(delta), adv, mask)
    assert (all_ties["tie_pos"], all_ties["tie_neg"]) == (4, 2) and math.isnan(all_ties["correct_pooled"])
    only_pos = correct_ratios(delta, adv.abs(), mask)
    assert only_pos["n_neg"] == 0 and math.isnan(only_pos["correct_neg"])
    s = delta_summary(delta, adv, mask)
    x = delta[mask]
    assert s["count"] == 7 and abs(s["mean_abs"] - float(x.abs().mean())) < 1e-15
    assert abs(s["q50"] - float(x.median())) < 1e-15 and s["min"] == -0.2 and s["max"] == 0.3


def test_influence_rows(model, batch):
    edges = as_edges(None)
    res = influence(model, batch, edges, lr=LR)
    cf = counterfactual_change(model, batch, lr=LR)
    assert torch.allclose(res.deltas[("train", -1)], cf.delta["train"], atol=1e-12)
    grads = bin_gradients(model, batch)
    for b in range(4):  # each row is the update along its bin's gradient
        params = {n: p.detach() - LR * grads.per_bin[b][n] for n, p in model.named_parameters()}
        want = (completion_probs(model, batch, params) - cf.pi_before) * batch.completion_mask
        assert torch.allclose(res.deltas[("train", b)], want, atol=1e-6, rtol=0)
    # first order: the rows add up to the all-token row (SGD is linear in the gradient)
    small = influence(model, batch, edges, lr=1e-6)
    summed = sum(small.deltas[("train", b)] for b in range(4))
    full = small.deltas[("train", -1)]
    assert float((summed - full).abs().max()) < 1e-2 * float(full.abs().max())
    m = res.matrix("train", "mean_abs")
    assert m.shape == (5, 4) and bool(torch.isfinite(m).all())
    df = res.to_frame(step=1)
    assert dict(df.schema) == SCHEMAS["influence"]
    assert df.height == 5 * 5
    row = df.filter((pl.col("source_bin") == 0) & (pl.col("target_bin") == 3))
    assert abs(row["mean_abs"][0] - float(m[1, 3])) < 1e-15
    # the distribution of delta pi over the target bin (the isolation figure's boxes)
    x = res.deltas[("train", 0)][res.bins == 3]
    qs = torch.quantile(x, torch.tensor([0.01, 0.25, 0.5, 0.75, 0.99], dtype=x.dtype))
    got = row.select("q01", "q25", "q50", "q75", "q99").row(0)
    assert max(abs(a - float(b)) for a, b in zip(got, qs, strict=True)) < 1e-15
    assert (
        row["min"][0] == float(x.min()) and row["max"][0] == float(x.max()) and row["count"][0] == x.numel()
    )


@pytest.mark.parametrize(
    "objective", [None, Objective(beta=0.04, loss_type="dapo", eps_low=0.2, eps_high=0.28)]
)
def test_influence_and_shares_from_one_set_of_gradients(model, batch, objective):
    """The merged pass equals the two analyses run apart: every source's dpi bitwise (the same step from the same
    theta_0), the per-bin and per-group norms and shares those of every g_b held at once (`bin_gradients`, K
    backward passes of their own, on a float64 copy) to float64 rounding, the per-token shares those of `gradient_shares`; the model is
    left bitwise as it was; with the fewer forward passes it exists for."""
    from tokendyn.effects.influence import influence_and_shares
    from tokendyn.effects.shares import bin_shares, gradient_shares

    ref_batch = batch
    if objective is not None:  # an off-policy batch with a reference policy near pi_old, for the KL term
        from dataclasses import replace

        old = completion_logp(model, batch).detach()
        noise = 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1), dtype=old.dtype)
        ref_batch = replace(batch.with_old_logp(old), ref_logp=old + noise)
    snap = _snapshot(model)
    backwards = []
    layer = model.model.layers[-1]
    hook = layer.register_full_backward_pre_hook(lambda *_: backwards.append(1))
    try:
        apart_inf = influence(model, ref_batch, lr=LR, objective=objective)
        apart = gradient_shares(model, ref_batch, objective=objective)
        n_apart = len(backwards)
        backwards.clear()
        inf, res = influence_and_shares(model, ref_batch, lr=LR, objective=objective)
        n_merged = len(backwards)
    finally:
        hook.remove()
    assert _unchanged(model, snap)
    n_sources = sum(1 for _, b in apart_inf.deltas if b >= 0)
    assert (n_apart, n_merged) == (2 * (n_sources + 1), n_sources + 1)  # the shares' backward passes are gone
    assert set(inf.deltas) == set(apart_inf.deltas) and inf.source_counts == apart_inf.source_counts
    for key, d in apart_inf.deltas.items():
        assert torch.equal(inf.deltas[key], d), key
    # the steps (and so their gradients) are float64 (InPlaceUpdate's precision): the reference is every g_b of a
    # float64 copy held at once, float64 at every op
    with exact_float64():
        held = bin_shares(bin_gradients(copy.deepcopy(model).double(), ref_batch, objective=objective))
    for name in ("grad_norm", "dot", "total_norm"):
        got, want = getattr(res.bins, name), getattr(held, name)
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-15), name
    assert torch.allclose(res.bins.share, held.share, rtol=1e-9, atol=1e-12)
    assert res.bins.groups == held.groups and res.bins.counts == held.counts
    assert torch.allclose(res.tokens, apart.tokens, rtol=1e-5, atol=1e-9)
    assert torch.allclose(res.bins.jvp_share, apart.bins.jvp_share, rtol=1e-5, atol=1e-9)
    assert abs(float(res.tokens.sum()) - 1.0) < 1e-4


def test_influence_per_lopti_stage(model, batch):
    low, high = lopti_stage_masks(batch, eta=0.5, pi_old=completion_probs(model, batch))
    res = influence(model, batch, stage_masks=(low, high), lr=LR)
    cf = counterfactual_change(model, batch, [("low", low), ("high", high)], lr=LR)
    assert torch.allclose(res.deltas[("low", -1)], cf.delta["low"], atol=1e-12)
    assert torch.allclose(res.deltas[("high", -1)], cf.delta["high"], atol=1e-12)
    # eta = 0.5 on the quarter bins: stage 1 sources are bins 0, 1 and stage 2 sources bins 2, 3
    stage_sources = {s: sorted(b for (st, b) in res.deltas if st == s and b >= 0) for s in ("low", "high")}
    assert stage_sources == {"low": [0, 1], "high": [2, 3]}
    # a stage-2 row starts from the model after the full stage-1 update
    edges = as_edges(None)
    bins = bin_index(completion_probs(model, batch), batch.completion_mask, edges)
    pi1 = cf.pi_after["low"]
    _, pi2_b3 = _hand_sgd(model, batch, [low, high & (bins == 3)])
    assert torch.allclose(res.deltas[("high", 3)], (pi2_b3 - pi1) * batch.completion_mask, atol=1e-6, rtol=0)


def test_analyze_batch_records(model, batch, tmp_path):
    low, high = lopti_stage_masks(batch, eta=0.5, pi_old=completion_probs(model, batch))
    snap = _snapshot(model)
    frames = analyze_batch(
        model, batch, step=4, stage_masks=(low, high), options=RebalanceOptions(token_shares=3)
    )
    assert _unchanged(model, snap)
    assert set(frames) == {"shares", "token_shares", "prob_change", "influence"}
    for kind, df in frames.items():
        assert dict(df.schema) == SCHEMAS[kind], kind
    pc = frames["prob_change"]
    assert sorted(pc["update_stage"].unique().to_list()) == ["high", "lopti", "low"]
    ts = frames["token_shares"]
    assert ts.height <= 4 * 3 and ts["delta_pi"].null_count() == 0
    files = write_records(tmp_path, frames, rank=1)
    assert sorted(f.name for f in files) == sorted(f"{k}-rank001-000000.parquet" for k in frames)
    back = pl.read_parquet(tmp_path / "records" / "prob_change-rank001-000000.parquet")
    assert back.equals(pc)


def test_analyze_batch_switches(model, batch):
    frames = analyze_batch(
        model, batch, step=0, options=RebalanceOptions(shares=False, token_shares=0, influence=False)
    )
    assert set(frames) == {"prob_change"}
    frames = analyze_batch(model, batch, step=0, options=RebalanceOptions(prob_change=False, influence=False))
    assert set(frames) == {"shares", "token_shares"}
    assert frames["token_shares"]["delta_pi"].null_count() == frames["token_shares"].height


def test_a_batch_without_gradient_has_null_shares_not_an_error(model, batch):
    """Every advantage 0 and no KL term (e.g. a sample of zero-variance groups at the first step): g = 0, so the
    shares are undefined (null rows, no per-token shares), and no counterfactual step is an update: its rows are
    null (no_update), counted in one notes record; the analyses must not stop training."""
    from dataclasses import replace

    flat = replace(batch, advantages=torch.zeros_like(batch.advantages))
    frames = analyze_batch(model, flat, step=0)
    assert set(frames) == {"shares", "prob_change", "influence", "notes"}
    sh = frames["shares"]
    assert sh["share"].null_count() == sh.height and float(sh["grad_norm"].abs().max()) == 0.0
    for kind in ("prob_change", "influence"):
        f = frames[kind]
        assert f["no_update"].all() and f["mean_abs"].null_count() == f.height, kind
    assert frames["notes"]["message"].item().startswith("step 0: 5 of 5 counterfactual updates carried no")


def test_change_frame_bins(model, batch):
    res = counterfactual_change(model, batch)
    edges = as_edges((0.0, 0.5, 1.0))
    bins = bin_index(res.pi_before, batch.completion_mask, edges)
    df = change_frame(res.delta["train"], batch, bins, edges, step=0, lr=LR)
    assert df["bin"].to_list() == [-1, 0, 1]
    assert df["count"][0] == df["count"][1] + df["count"][2] == batch.n_tokens


def test_bad_batch_is_named():
    ids = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="completion_mask"):
        ProbeBatch(ids, torch.ones_like(ids), torch.full((2, 3), 2), torch.zeros(2))
    with pytest.raises(ValueError, match="advantages"):
        ProbeBatch(ids, torch.ones_like(ids), torch.ones(2, 3), torch.zeros(3))
    with pytest.raises(ValueError, match="temperature"):
        ProbeBatch(ids, torch.ones_like(ids), torch.ones(2, 3), torch.zeros(2), temperature=0.0)
    with pytest.raises(ValueError, match="old_logp"):
        ProbeBatch(ids, torch.ones_like(ids), torch.ones(2, 3), torch.zeros(2), old_logp=torch.ones(2, 3))


def test_on_a_saved_model_with_generated_completions(tiny_model_dir, tmp_path):
    """End to end on the saved tiny policy (sdpa attention, real tokenizer): sampled completions cut at eos, GRPO
    advantages from rewards, every analysis written as records and read back."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from tokendyn.remedies import grpo_advantages

    tok = PreTrainedTokenizerFast.from_pretrained(str(tiny_model_dir))
    lm = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert lm.config._attn_implementation == "sdpa"
    prompts = ["Knights always tell the truth", "You meet 3 inhabitants: Zoey"]
    enc = tok([p for p in prompts for _ in range(4)], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    with torch.no_grad():
        out = lm.generate(**enc, do_sample=True, temperature=TEMPERATURE, top_k=0, max_new_tokens=10)
    comp = out[:, enc["input_ids"].shape[1] :]
    is_eos = (comp == tok.eos_token_id).long()
    after_eos = (is_eos.cumsum(1) - is_eos) > 0
    cmask = (~after_eos).long()
    rewards = cmask.sum(1).double() % 3  # any deterministic reward
    adv = grpo_advantages(rewards, group_size=4)
    attn = torch.cat([enc["attention_mask"], cmask], 1)
    b = ProbeBatch(out, attn, cmask, adv, temperature=TEMPERATURE)
    frames = analyze_batch(lm, b, step=0)
    shares = frames["shares"].filter((pl.col("group") == "all") & (pl.col("bin") >= 0))
    assert abs(shares["share"].sum() - 1.0) < 1e-5
    assert abs(shares["jvp_share"].sum() - 1.0) < 1e-4
    write_records(tmp_path, frames)
    from tokendyn.records import shard_files

    for kind in frames:
        assert pl.read_parquet(shard_files(tmp_path, kind)[0]).equals(frames[kind])


def test_rebalance_options_name_a_bad_field():
    with pytest.raises(ValueError, match="share_method must be one of stream, loop, batched"):
        RebalanceOptions(share_method="jvp")
    with pytest.raises(ValueError, match="lr_sweep"):
        RebalanceOptions(lr_sweep=(1e-3, 0.0))
    assert RebalanceOptions(lr_sweep=(1.0, 1e-3, 1.0)).lr_sweep == (1e-3, 1.0)


def test_float64_step_takes_the_model_dtype_gradient_of_an_on_policy_batch(model, batch):
    """On an on-policy batch, float64_step fixes pi_old as the loss's own log pi in the model's dtype, where it takes
    its gradients: its first gradient is bitwise the model-dtype step's (ratio exactly 1 at theta_0 in both), so a
    check compares the two steps' rounding and nothing else. With bf16 weights a float64 pi_old is off by percents
    there (measured: up to 5 % of the ratio), which moved the gradient."""
    half = copy.deepcopy(model).to(torch.bfloat16)
    on_policy = ProbeBatch(batch.input_ids, batch.attention_mask, batch.completion_mask, batch.advantages,
                           temperature=batch.temperature)  # fmt: skip
    grads = {}
    for precision in ("model", "float64_step"):
        fixed, _ = fix_pi_old(half, on_policy, precision=precision)
        with InPlaceUpdate(half, sgd(1e-3), precision=precision) as update:
            update.step(fixed, keep_gradient=True)
            grads[precision] = {n: t.clone() for n, t in update.last_gradient.tensors.items()}
    assert grads["model"].keys() == grads["float64_step"].keys()
    assert all(torch.equal(grads["model"][n], grads["float64_step"][n]) for n in grads["model"])
    fixed64, _ = fix_pi_old(half, on_policy, precision="float64")  # (the all-float64 path's own pi_old)
    fixed, _ = fix_pi_old(half, on_policy, precision="float64_step")
    assert float((fixed64.old_logp - fixed.old_logp).abs().max()) > 1e-3
