"""The analyses' memory-bounded machinery against independent references (tokendyn.probe.tokenloss / shares / change
/ influence): chunked logits against a whole-tensor float64 log-softmax, streamed per-bin shares against every g_b
held at once, in-place counterfactual updates against updates of a parameter copy, and the model left bitwise as
it was. The references are written here, from the model's own forward and torch.autograd, not from the code under
test."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from _rebalance import VOCAB, tiny_batch, tiny_model
from transformers import Qwen2ForCausalLM

import tokendyn.probe.forward as fwd
import tokendyn.probe.tokenloss as tl
from tokendyn.effects.change import InPlaceUpdate, completion_probs, counterfactual_change
from tokendyn.effects.influence import influence, lopti_stage_masks
from tokendyn.effects.rebalance import RebalanceOptions, analyze_batch
from tokendyn.effects.shares import as_edges, gradient_shares, parameter_group
from tokendyn.probe.tokenloss import (
    Objective,
    completion_logp,
    completion_logp_entropy,
    loss_terms,
    token_loss,
)

torch.set_num_threads(1)
LR = 1e-3
OBJ = Objective(eps_low=0.2, eps_high=0.24)


@pytest.fixture
def small_chunks(monkeypatch):
    """5 tokens per chunk (V = 97): every batch here is split into many chunks, the last one ragged."""
    monkeypatch.setattr(fwd, "CHUNK_BYTES", 8 * VOCAB * 5)
    assert tl.chunk_tokens(VOCAB) == 5


@pytest.fixture(scope="module")
def model():
    return tiny_model(attn="eager")


@pytest.fixture(scope="module")
def batch(model):
    return tiny_batch(model, old_logp=True)


def _full_logits(model, batch, params=None):
    """z = logits / T of the positions predicting the completion, (B, C, V), from the model's whole forward."""
    c = batch.n_completion
    kwargs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    if params is None:
        out = model(**kwargs)
    else:
        out = torch.func.functional_call(model, params, (), kwargs)
    logits = out.logits[:, -(c + 1) : -1]
    return logits.to(torch.promote_types(logits.dtype, torch.float32)) / batch.temperature


def _ref_logp64(model, batch, params=None):
    """log pi in float64 from the whole [B, C, V] tensor (the measurement before chunking)."""
    with torch.no_grad():
        z = _full_logits(model, batch, params).double()
    ids = batch.completion_ids.unsqueeze(-1)
    return (z.gather(-1, ids).squeeze(-1) - torch.logsumexp(z, -1)).detach()


class ScaledHead(Qwen2ForCausalLM):
    """A model whose forward scales its logits (as MiniCPM scales its hidden state): the head is not a plain affine
    map of the backbone's output, so the chunked path must fall back to the model's own logits."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_logp_equals_the_whole_tensor_log_softmax(monkeypatch, dtype):
    """float64 model: the chunked float64 log pi equals the whole-tensor one to 1e-12. float32 model: with one
    chunk (the default for this vocabulary) it is the same to 1e-12; with 5-token chunks the head's float32 matmul
    of a 5-row chunk rounds differently from the whole one (~1e-7 of |z|, the forward's own precision)."""
    m = tiny_model(attn="sdpa", dtype=dtype).eval()
    b = tiny_batch(m, old_logp=True)
    want64 = _ref_logp64(m, b)
    with torch.no_grad():
        lsm = torch.log_softmax(_full_logits(m, b), -1)
    ids = b.completion_ids.unsqueeze(-1)
    for chunk, tol64, tol in ((None, 1e-12, 1e-12), (5, 1e-12 if dtype == torch.float64 else 1e-5, 1e-5)):
        if chunk is not None:
            monkeypatch.setattr(fwd, "CHUNK_BYTES", 8 * VOCAB * chunk)
        with torch.no_grad():
            got64 = completion_logp(m, b, float64=True)
            got, ent = completion_logp_entropy(m, b)
        assert got64.dtype == torch.float64
        err64 = float((got64 - want64).abs().max())
        assert err64 < tol64, (chunk, err64)
        assert float((got - lsm.gather(-1, ids).squeeze(-1)).abs().max()) < tol
        assert float((ent - (-(lsm.exp() * lsm).sum(-1))).abs().max()) < 10 * tol
    # the check can fail: a one-token shift of the ids moves log pi by far more
    shifted = torch.roll(b.completion_ids, 1, dims=1).unsqueeze(-1)
    assert float((lsm.gather(-1, shifted).squeeze(-1).double() - want64).abs().max()) > 0.1


def test_a_scaled_head_falls_back_to_the_models_logits(small_chunks):
    base = tiny_model(attn="eager")
    m = ScaledHead(base.config)
    m.load_state_dict(base.state_dict())
    m.eval()
    b = tiny_batch(base, old_logp=True)
    got = completion_logp(m, b, float64=True)
    assert float((got - _ref_logp64(m, b)).abs().max()) < 1e-12
    assert float((got - _ref_logp64(base, b)).abs().max()) > 1e-2, "the scale matters"


def test_chunked_loss_gradient_equals_the_whole_tensor_loss_gradient(small_chunks, model, batch):
    """The chunks are recomputed in the backward (checkpointing): the gradient of L is the one of the loss on the
    whole [B, C, V] log-softmax, with and without the entropy terms."""
    params = dict(model.named_parameters())
    for obj in (OBJ, Objective(eps_low=0.2, eps_high=0.24, entropy_coef=0.05, top_entropy_quantile=0.5)):
        model.eval()
        got = torch.autograd.grad(token_loss(model, batch, obj).loss, list(params.values()))
        lsm = torch.log_softmax(_full_logits(model, batch), -1)
        logp = lsm.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
        ent = -(lsm.exp() * lsm).sum(-1)
        want = torch.autograd.grad(loss_terms(logp, batch, obj, ent).sum(), list(params.values()))
        model.train()
        num = sum(float((a - b).double().pow(2).sum()) for a, b in zip(got, want, strict=True))
        den = sum(float(b.double().pow(2).sum()) for b in want)
        assert den > 0 and (num / den) ** 0.5 < 1e-6, (num / den) ** 0.5


def _held_bin_gradients(model, batch, obj, token_mask=None):
    """Every g_b held at once (the old way), by one backward per bin of the masked loss, and g = their sum."""
    params = dict(model.named_parameters())
    model.eval()
    terms = token_loss(model, batch, obj).terms
    pi = torch.exp(batch.old_logp.double())
    edges = as_edges(None)
    bins = torch.bucketize(pi, edges[1:-1], right=True)
    per_bin = []
    for k in range(4):
        m = (bins == k) & batch.completion_mask
        if token_mask is not None:
            m = m & token_mask
        per_bin.append(torch.autograd.grad((terms * m).sum(), list(params.values()), retain_graph=True))
    model.train()
    g = [sum(gb[i] for gb in per_bin) for i in range(len(params))]
    return list(params), per_bin, g


@pytest.mark.parametrize("masked", [False, True])
def test_streamed_shares_equal_the_held_per_bin_gradients(small_chunks, model, batch, masked):
    token_mask = lopti_stage_masks(batch, eta=0.5)[0] if masked else None
    res = gradient_shares(model, batch, objective=OBJ, per_token=False, token_mask=token_mask)
    names, per_bin, g = _held_bin_gradients(model, batch, OBJ, token_mask)
    groups = res.bins.groups
    assert groups[0] == "all"
    want_sq = torch.zeros(4, len(groups), dtype=torch.float64)
    want_dot = torch.zeros(4, len(groups), dtype=torch.float64)
    want_tot = torch.zeros(len(groups), dtype=torch.float64)
    for i, n in enumerate(names):
        for j in (0, groups.index(parameter_group(n))):
            want_tot[j] += g[i].double().pow(2).sum()
            for k in range(4):
                want_sq[k, j] += per_bin[k][i].double().pow(2).sum()
                want_dot[k, j] += (per_bin[k][i].double() * g[i].double()).sum()
    scale = float(want_tot[0])
    assert float((res.bins.grad_norm.pow(2) - want_sq).abs().max()) < 1e-5 * scale
    assert float((res.bins.dot - want_dot).abs().max()) < 1e-5 * scale
    assert float((res.bins.total_norm.pow(2) - want_tot).abs().max()) < 1e-5 * scale
    share = want_dot / want_tot
    assert float((res.bins.share - share).nan_to_num().abs().max()) < 1e-5
    assert not hasattr(res.grads, "per_bin"), "the streamed result holds no gradients"
    if masked:
        assert float(res.bins.grad_norm[2:, 0].abs().max()) == 0.0


def _copy_based(model, batch, stages, make_opt, objective):
    """The old route, written out: a detached copy of the parameters with its own optimizer, stepped on
    sum_{t in mask} l_t through functional_call (the model untouched). Returns the copy after each stage and pi
    measured there (the same float64 measurement as the code under test, so only the update route differs)."""
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    opt = make_opt(list(params.values()))
    after, pis = [], []
    for mask in stages:
        model.eval()
        terms = token_loss(model, batch, objective, params).terms
        loss = terms.sum() if mask is None else (terms * mask).sum()
        grads = torch.autograd.grad(loss, list(params.values()))
        model.train()
        for p, gr in zip(params.values(), grads, strict=True):
            p.grad = gr
        opt.step()
        after.append({n: p.detach().clone() for n, p in params.items()})
        pis.append(completion_probs(model, batch, params))
    return after, pis


def _sgd(params):
    return torch.optim.SGD(params, lr=LR)


def _adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def _bitwise(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(model, snap):
    return all(torch.equal(p, snap[n]) for n, p in model.named_parameters())


def test_in_place_counterfactual_equals_the_copy_based_update(small_chunks, model, batch):
    snap = _bitwise(model)
    (want,), (pi_ref,) = _copy_based(model, batch, [None], _sgd, OBJ)
    with InPlaceUpdate(model, _sgd, OBJ, precision="model") as update:
        update.step(batch)
        assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())
        assert not _same(model, snap)
    assert _same(model, snap)
    res = counterfactual_change(model, batch, lr=LR, objective=OBJ, precision="model")
    assert _same(model, snap)
    err = float((res.pi_after["train"] - pi_ref).abs().max())
    assert err < 1e-12, err
    assert float(res.delta["train"].abs().max()) > 1e-3, "the step moves pi"
    # and against pi from the whole-tensor float64 log-softmax at the copy (float32 head rounding apart)
    ref = torch.exp(_ref_logp64(model.eval(), batch, want))
    model.train()
    assert float((res.pi_after["train"] - ref).abs().max()) < 1e-5


def test_in_place_lopti_stages_with_adam_equal_the_copy_based_update(small_chunks, model, batch):
    low, high = lopti_stage_masks(batch, eta=0.5)
    snap = _bitwise(model)
    res = counterfactual_change(
        model, batch, [("low", low), ("high", high)], optimizer=_adam, objective=OBJ, precision="model"
    )
    assert _same(model, snap)
    _, (pi1, pi2) = _copy_based(model, batch, [low, high], _adam, OBJ)
    assert float((res.pi_after["low"] - pi1).abs().max()) < 1e-12
    assert float((res.pi_after["high"] - pi2).abs().max()) < 1e-12


def test_in_place_influence_equals_copy_based_sources(small_chunks, model, batch):
    """Each source restarts from the stage's start (parameters and Adam state) and the full stage-1 update carries
    into stage 2: against fresh copies stepped by hand."""
    low, high = lopti_stage_masks(batch, eta=0.5)
    edges = as_edges(None)
    bins = torch.bucketize(torch.exp(batch.old_logp.double()), edges[1:-1], right=True)
    snap = _bitwise(model)
    res = influence(
        model, batch, edges, stage_masks=(low, high), optimizer=_adam, objective=OBJ, precision="model"
    )
    assert _same(model, snap)
    valid = batch.completion_mask
    pi0 = completion_probs(model, batch)
    for src in (0, 1):
        _, (pi,) = _copy_based(model, batch, [low & (bins == src) & valid], _adam, OBJ)
        assert float((res.deltas[("low", src)] - (pi - pi0) * valid).abs().max()) < 1e-12
    _, (pi1,) = _copy_based(model, batch, [low], _adam, OBJ)
    assert float((res.deltas[("low", -1)] - (pi1 - pi0) * valid).abs().max()) < 1e-12
    for src in (2, 3):
        _, (_, pi) = _copy_based(model, batch, [low, high & (bins == src) & valid], _adam, OBJ)
        assert float((res.deltas[("high", src)] - (pi - pi1) * valid).abs().max()) < 1e-12


def test_analyze_batch_leaves_model_grads_and_optimizer_bitwise(small_chunks, model, batch):
    """Every analysis, the lr sweep and Lopti stages on: parameters torch.equal, each .grad the very tensor it
    was (values unchanged), the trainer's optimizer state untouched; also when an analysis fails mid-way."""
    trainer_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.eval()
    token_loss(model, batch, OBJ).loss.backward()
    model.train()
    trainer_opt.step()  # populate the trainer's optimizer state; .grad stays set (as mid-accumulation)
    grads = {n: p.grad for n, p in model.named_parameters()}
    grad_values = {n: g.clone() for n, g in grads.items()}
    state = copy.deepcopy(trainer_opt.state_dict())
    snap = _bitwise(model)
    low, high = lopti_stage_masks(batch, eta=0.5)
    opts = RebalanceOptions(token_shares=2, lr_sweep=(1e-4, 1e-2))
    frames = analyze_batch(model, batch, step=0, options=opts, objective=OBJ, stage_masks=(low, high))
    assert {"shares", "token_shares", "prob_change", "influence"} <= set(frames)
    assert _same(model, snap)
    assert all(
        p.grad is grads[n] and torch.equal(p.grad, grad_values[n]) for n, p in model.named_parameters()
    )
    after = trainer_opt.state_dict()
    assert after["param_groups"] == state["param_groups"]
    for i, st in state["state"].items():
        assert all(torch.equal(v, after["state"][i][k]) for k, v in st.items())
    # a failure after the first stage's step: the model is still restored
    with pytest.raises(RuntimeError):
        counterfactual_change(model, batch, [("low", low), ("high", torch.ones(2, 3))], objective=OBJ)
    assert _same(model, snap)
    model.zero_grad(set_to_none=True)


def test_the_sweep_uses_the_same_in_place_update(small_chunks, model, batch):
    """A sweep row at lr equals the copy-based SGD step at that lr (and so differs between step sizes)."""
    opts = RebalanceOptions(
        shares=False, token_shares=0, influence=False, lr_sweep=(1e-2,), step_precision="model"
    )
    frames = analyze_batch(model, batch, step=0, options=opts, objective=OBJ)
    pc = frames["prob_change"]  # the sweep's row at lr 1e-2 (its first point is the lr -> 0 limit)
    sweep = pc.filter((pc["update"] == "sweep") & (pc["lr"] == 1e-2))
    (params,), (pi,) = _copy_based(model, batch, [None], lambda p: torch.optim.SGD(p, lr=1e-2), OBJ)
    pi0 = completion_probs(model, batch)
    delta = ((pi - pi0) * batch.completion_mask)[batch.completion_mask]
    row = sweep.filter(sweep["bin"] == -1)
    assert abs(row["mean_abs"][0] - float(delta.abs().mean())) < 1e-12
    num = sum(float((params[n] - q).double().pow(2).sum()) for n, q in model.named_parameters())
    den = sum(float(q.double().pow(2).sum()) for q in model.parameters())
    assert abs(row["param_step"][0] - (num / den) ** 0.5) < 1e-9 * (num / den) ** 0.5


def test_a_tied_head_follows_the_swapped_embedding(small_chunks):
    """GPT-2 ties its head to the embedding: with ``params`` the chunked head must use the swapped matrix (as the
    model with that matrix in place does), not the model's own."""
    from _models import tiny_gpt2

    from tokendyn.probe.tokenloss import ProbeBatch, trainable_parameters

    m = tiny_gpt2().eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.config.vocab_size, (3, 12), generator=g)
    b = ProbeBatch(ids, torch.ones_like(ids), torch.ones(3, 6), torch.randn(3), temperature=0.7)
    params = {n: p.detach().clone() for n, p in trainable_parameters(m).items()}
    assert "lm_head.weight" not in params
    params["transformer.wte.weight"] += 0.05 * torch.randn(
        params["transformer.wte.weight"].shape, generator=g
    )
    moved = copy.deepcopy(m)
    with torch.no_grad():
        moved.transformer.wte.weight.copy_(params["transformer.wte.weight"])
        got = completion_logp(m, b, params, float64=True)
        assert float((got - _ref_logp64(moved, b)).abs().max()) < 1e-6
        assert float((got - completion_logp(m, b, float64=True)).abs().max()) > 1e-2


# ---- gradient checkpointing in the analyses ----------------------------------------------------------------------
@pytest.mark.parametrize("reentrant", [False, True])
def test_analyses_under_gradient_checkpointing_equal_the_unchecked_ones_and_recompute(reentrant):
    """With the model's gradient checkpointing on (as a memory-bound training run has it), the analyses' gradient
    passes checkpoint the decoder layers (non-reentrant even when training's is reentrant, which autograd.grad
    refuses): every number equals the unchecked analyses', the layers really run again in the backward, and the
    model's flags and checkpoint function are left as they were."""
    from _rebalance import tiny_batch, tiny_model

    from tokendyn.effects.rebalance import RebalanceOptions, analyze_batch

    def run(model):
        batch = tiny_batch(model, old_logp=True)
        frames = analyze_batch(
            model, batch, step=0, options=RebalanceOptions(lr_sweep=(1e-3, 1.0)), objective=OBJ
        )
        return {k: v for k, v in frames.items()}

    plain = run(tiny_model())
    model = tiny_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    assert layers
    before = [(m.training, m._gradient_checkpointing_func) for m in layers]
    checked = run(model)
    assert [(m.training, m._gradient_checkpointing_func) for m in layers] == before
    recomputed = []  # the layers' calls through the checkpoint function
    import torch.utils.checkpoint as ckpt

    real = ckpt.checkpoint

    def spy(*a, **kw):
        recomputed.append(kw.get("use_reentrant"))
        return real(*a, **kw)

    ckpt.checkpoint = spy
    try:
        run(model)
    finally:
        ckpt.checkpoint = real
    assert recomputed and set(recomputed) == {False}, recomputed
    for kind in plain:
        a, b = plain[kind], checked[kind]
        assert a.columns == b.columns and a.height == b.height, kind
        for c in a.columns:
            if a[c].dtype.is_float():
                x, y = a[c].fill_null(float("nan")).to_numpy(), b[c].fill_null(float("nan")).to_numpy()
                assert (np.isnan(x) == np.isnan(y)).all(), (kind, c)
                x, y = np.nan_to_num(x), np.nan_to_num(y)
                assert abs(x - y).max() <= 1e-6 * max(1.0, abs(x).max()), (kind, c)
            else:
                assert a[c].to_list() == b[c].to_list(), (kind, c)
