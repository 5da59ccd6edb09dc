"""Per-token loss alignment, per-bin gradients and the exact update shares (tokendyn.probe.tokenloss / shares)."""

from __future__ import annotations

import polars as pl
import pytest
import torch
from _rebalance import TEMPERATURE, tiny_batch, tiny_model

from tokendyn.effects.shares import (
    bin_gradients,
    bin_shares,
    gradient_shares,
    parameter_group,
    token_shares,
    token_shares_many,
)
from tokendyn.effects.token_sample import sample_tokens
from tokendyn.probe.tokenloss import (
    Objective,
    ProbeBatch,
    completion_logp,
    loss_terms,
    token_loss,
    trainable_parameters,
)
from tokendyn.records import SCHEMAS
from tokendyn.records import write_frames as write_records

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model32():
    return tiny_model(attn="eager")


@pytest.fixture(scope="module")
def batch32(model32):
    return tiny_batch(model32, old_logp=True)


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.detach().double().flatten() for g in grads.values()])


def test_completion_logp_predicts_token_t_from_position_t_minus_1(model32, batch32):
    """log pi_t of completion token j (sequence index t = S - C + j) against a direct computation: forward only
    the prefix input_ids[:, :t] and read the next-token distribution at its last position."""
    model32.eval()
    b = batch32
    s, c = b.input_ids.shape[1], b.n_completion
    with torch.no_grad():
        got = completion_logp(model32, b).double()
        direct = torch.empty_like(got)
        for j in range(c):
            t = s - c + j
            logits = model32(input_ids=b.input_ids[:, :t], attention_mask=b.attention_mask[:, :t]).logits[
                :, -1
            ]
            logp = torch.log_softmax(logits.double() / TEMPERATURE, -1)
            direct[:, j] = logp.gather(-1, b.input_ids[:, t : t + 1]).squeeze(1)
        # the wrong alignment (position t predicting token t) must differ: the check can fail
        full = model32(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.double() / TEMPERATURE
        shifted = torch.log_softmax(full[:, -c:], -1).gather(-1, b.completion_ids.unsqueeze(-1)).squeeze(-1)
    model32.train()
    assert torch.allclose(got, direct, atol=2e-5, rtol=0)
    assert (shifted - direct).abs().max() > 0.1
    pi = got.exp()[b.completion_mask]
    assert pi.min() < 0.25 and pi.max() > 0.75, "the sharpened head spreads pi over (0, 1)"


def test_loss_terms_formula_and_weights(model32, batch32):
    """l_t against the clipped surrogate written out by hand, L = sum_t l_t, and dL/dlog pi_t = w_t."""
    b = batch32
    obj = Objective(eps_low=0.2, eps_high=0.24)
    logp = completion_logp(model32, b).double().detach().requires_grad_(True)
    terms = loss_terms(logp, b, obj)
    m = b.completion_mask
    r = torch.exp(logp - b.old_logp)
    a = b.advantages
    hand = -torch.minimum(r * a, r.clamp(0.8, 1.24) * a) * m / m.sum()
    assert torch.allclose(terms, hand, atol=1e-12)
    assert ((r < 0.8) | (r > 1.24))[m].any(), "some tokens are clipped"
    (w,) = torch.autograd.grad(terms.sum(), logp)
    unclipped = ~(((r > 1.24) & (a > 0)) | ((r < 0.8) & (a < 0)))
    assert torch.allclose(w, (-a * r * unclipped * m / m.sum()).detach(), atol=1e-12)
    # on-policy: ratio 1, the plain surrogate -A log pi / N in gradient
    onp = ProbeBatch(b.input_ids, b.attention_mask, b.completion_mask, b.advantages, temperature=TEMPERATURE)
    (w0,) = torch.autograd.grad(loss_terms(logp, onp).sum(), logp)
    assert torch.allclose(w0, -a * m / m.sum(), atol=1e-12)


def test_parameter_groups():
    assert parameter_group("model.layers.3.mlp.up_proj.weight") == "layers.3"
    assert parameter_group("transformer.h.11.attn.c_attn.weight") == "layers.11"
    assert parameter_group("model.embed_tokens.weight") == "embeddings"
    assert parameter_group("model.norm.weight") == "final_norm"
    assert parameter_group("transformer.ln_f.bias") == "final_norm"
    assert parameter_group("lm_head.weight") == "lm_head"


@pytest.mark.parametrize("method", ["batched", "loop"])
def test_bin_gradients_sum_to_the_full_gradient(model32, batch32, method):
    obj = Objective(eps_low=0.2, eps_high=0.24)
    grads = bin_gradients(model32, batch32, objective=obj, method=method)
    assert grads.n_bins == 4 and all(n > 0 for n in grads.counts())
    assert sum(grads.counts()) == batch32.n_tokens
    params = trainable_parameters(model32)
    full = torch.autograd.grad(token_loss(model32, batch32, obj).loss, list(params.values()))
    g = torch.cat([x.double().flatten() for x in full])
    summed = _flat(grads.total())
    assert (summed - g).norm() / g.norm() < 1e-5
    for gb in grads.per_bin:  # every bin contributes, none equals the whole
        assert 0 < _flat(gb).norm() < g.norm() * 1.5
    assert all(p.grad is None for p in model32.parameters()), "no .grad written"
    assert model32.training, "mode restored"


def test_batched_and_loop_agree(model32, batch32):
    a = bin_gradients(model32, batch32, method="batched")
    b = bin_gradients(model32, batch32, method="loop")
    for ga, gb in zip(a.per_bin, b.per_bin, strict=True):
        assert (_flat(ga) - _flat(gb)).norm() <= 1e-5 * _flat(gb).norm() + 1e-12


def test_bin_shares_sum_to_one_and_norms(model32, batch32):
    grads = bin_gradients(model32, batch32)
    sh = bin_shares(grads)
    assert sh.groups[0] == "all"
    assert set(sh.groups[1:]) == {"embeddings", "layers.0", "layers.1", "final_norm", "lm_head"}
    assert torch.allclose(sh.share.sum(0), torch.ones(len(sh.groups), dtype=torch.float64), atol=1e-6)
    # ||g_b|| and ||g|| over all parameters against flat tensors; per-group squares add up to the total
    g = _flat(grads.total())
    assert abs(float(sh.total_norm[0]) - float(g.norm())) < 1e-9 * float(g.norm())
    for b, gb in enumerate(grads.per_bin):
        assert abs(float(sh.grad_norm[b, 0]) - float(_flat(gb).norm())) < 1e-9 * float(g.norm())
        assert abs(float(sh.dot[b, 0]) - float(_flat(gb) @ g)) < 1e-9 * float(g.norm()) ** 2
    assert torch.allclose(sh.grad_norm[:, 1:].pow(2).sum(1), sh.grad_norm[:, 0].pow(2), rtol=1e-9)
    lm = sh.groups.index("lm_head")
    assert abs(float(sh.grad_norm[0, lm]) - float(grads.per_bin[0]["lm_head.weight"].double().norm())) < 1e-6


@pytest.fixture(scope="module")
def model64():
    # fp64 needs sdpa (eager's float32 softmax turns padded rows NaN in fp64); the JVP uses the math kernel
    return tiny_model(attn="sdpa", dtype=torch.float64)


def test_jvp_shares_match_per_bin_shares_and_finite_differences(model64):
    b = tiny_batch(model64, old_logp=True)
    obj = Objective(eps_low=0.2, eps_high=0.24)
    res = gradient_shares(model64, b, objective=obj)
    s_t = res.tokens
    assert s_t.shape == b.completion_mask.shape
    assert float(s_t[~b.completion_mask].abs().max()) == 0.0
    assert abs(float(s_t.sum()) - 1.0) < 1e-8
    assert torch.allclose(res.bins.jvp_share, res.bins.share[:, 0], atol=1e-8, rtol=0)
    # central finite differences of every l_t along g: (l_t(theta + e g) - l_t(theta - e g)) / (2 e ||g||^2)
    params = trainable_parameters(model64)
    model64.eval()
    grad = torch.autograd.grad(token_loss(model64, b, obj).loss, list(params.values()))
    g = dict(zip(params, grad, strict=True))
    norm2 = sum(float(v.pow(2).sum()) for v in g.values())
    assert abs(norm2**0.5 - float(res.bins.total_norm[0])) < 1e-10 * norm2**0.5
    eps = 1e-4 / norm2**0.5
    with torch.no_grad():
        plus = {n: p + eps * g[n] for n, p in params.items()}
        minus = {n: p - eps * g[n] for n, p in params.items()}
        fd = (
            loss_terms(completion_logp(model64, b, plus), b, obj)
            - loss_terms(completion_logp(model64, b, minus), b, obj)
        ) / (2 * eps * norm2)
    model64.train()
    assert float((fd - s_t).abs().max()) < 1e-3 * float(s_t.abs().max())
    assert abs(float(fd.sum()) - 1.0) < 1e-4


def test_batched_jvps_equal_one_each_and_finite_differences(model64):
    """`token_shares_many`: two (advantages, direction, objective) in one vmapped forward-mode pass, each against its
    own `token_shares` and against central finite differences of its own terms along its own direction; batches
    whose forward differs (other tokens) fall back to one JVP each."""
    from dataclasses import replace

    from tokendyn.effects.change import fix_pi_old

    b, _ = fix_pi_old(model64, tiny_batch(model64))  # (pi_old at theta: r = 1, inside the clip on both sides)
    params = trainable_parameters(model64)
    g = torch.Generator().manual_seed(5)
    dirs = [
        {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in params.items()} for _ in range(2)
    ]
    b2 = replace(
        b, advantages=b.advantages * torch.linspace(0.5, 1.5, b.advantages.numel()).view_as(b.advantages)
    )
    objs = [Objective(eps_low=0.2, eps_high=0.24), Objective(eps_low=0.2, eps_high=0.24, entropy_coef=0.01)]
    items = [(b, dirs[0], objs[0]), (b2, dirs[1], objs[1])]
    many = token_shares_many(model64, items)
    model64.eval()
    for (batch, d, obj), got in zip(items, many, strict=True):
        one = token_shares(model64, batch, d, objective=obj)
        assert float((got - one).abs().max()) <= 1e-12 * float(one.abs().max())
        norm2 = sum(float(v.pow(2).sum()) for v in d.values())
        eps = 1e-2 / norm2**0.5  # (the error: 3.5e-5 here, 1e-4 at 1e-3 / ||v||, rounding below that)
        with torch.no_grad():
            plus = token_loss(model64, batch, obj, {n: p + eps * d[n] for n, p in params.items()}).terms
            minus = token_loss(model64, batch, obj, {n: p - eps * d[n] for n, p in params.items()}).terms
        fd = (plus - minus) / (2 * eps * norm2)
        assert float((fd - got).abs().max()) < 2e-4 * float(got.abs().max())
    other = replace(b, input_ids=b.input_ids.flip(0))
    apart = token_shares_many(model64, [(b, dirs[0], objs[0]), (other, dirs[1], objs[0])])
    assert torch.equal(apart[1], token_shares(model64, other, dirs[1], objective=objs[0]))
    model64.train()


def test_shares_of_a_token_subset_decompose_that_subsets_loss(model64):
    """A Lopti stage: with token_mask, g = grad sum_{t in mask} l_t (the counterfactual update's masked loss), bins outside the
    mask get g_b = 0 and no tokens, the shares sum to 1 and the per-token JVP shares agree with them."""
    from tokendyn.effects.influence import lopti_stage_masks

    b = tiny_batch(model64, old_logp=True)
    obj = Objective(eps_low=0.2, eps_high=0.24, beta=0.0)
    low, high = lopti_stage_masks(b, eta=0.5)
    params = trainable_parameters(model64)
    for mask, inside in ((low, (0, 1)), (high, (2, 3))):
        res = gradient_shares(model64, b, objective=obj, token_mask=mask)
        terms = token_loss(model64, b, obj).terms
        want = torch.autograd.grad((terms * mask.to(terms.dtype)).sum(), list(params.values()))
        g = torch.cat([x.double().flatten() for x in want])
        assert abs(float(res.bins.total_norm[0]) - float(g.norm())) < 1e-10 * float(g.norm())
        assert res.grads.counts() == [int(((res.grads.bins == k) & mask).sum()) for k in range(4)]
        for k in range(4):
            if k not in inside:
                assert res.grads.counts()[k] == 0 and float(res.bins.grad_norm[k, 0]) == 0.0
                assert float(res.bins.share[k, 0]) == 0.0
        # g is its own backward, not the sum of the g_b (streamed): the shares sum to 1 within that rounding
        assert abs(float(res.bins.share[:, 0].sum()) - 1.0) < 1e-9
        assert torch.allclose(res.bins.jvp_share, res.bins.share[:, 0], atol=1e-6, rtol=0)


def test_token_shares_with_eager_fp32_match_bins(model32, batch32):
    res = gradient_shares(model32, batch32)
    assert torch.allclose(res.bins.jvp_share, res.bins.share[:, 0], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="direction has tensors"):
        token_shares(model32, batch32, {"nope": torch.zeros(1)})


def test_shares_records_roundtrip(model32, batch32, tmp_path):
    res = gradient_shares(model32, batch32)
    df = res.bins.to_frame(step=7, stage="train")
    assert dict(df.schema) == SCHEMAS["shares"]
    all_rows = df.filter(pl.col("group") == "all")
    per_bin = all_rows.filter(pl.col("bin") >= 0)
    assert abs(per_bin["share"].sum() - 1.0) < 1e-6
    assert abs(per_bin["jvp_share"].sum() - 1.0) < 1e-4
    assert per_bin["bin_lo"].to_list() == [0.0, 0.25, 0.5, 0.75]
    files = write_records(tmp_path, {"shares": df}, rank=0) + write_records(tmp_path, {"shares": df}, rank=0)
    assert [f.name for f in files] == ["shares-rank000-000000.parquet", "shares-rank000-000001.parquet"]
    from tokendyn.records import shard_files

    assert shard_files(tmp_path, "shares") == files
    back = pl.read_parquet(files[0])
    assert back.equals(df)
    assert not [p for p in (tmp_path / "records").iterdir() if p.name.startswith(".")], "no temp file left"


def test_sample_tokens_per_bin():
    bins = torch.tensor([[0, 0, 0, 1, -1], [2, 0, 1, -1, -1]])
    idx = sample_tokens(bins, per_bin=2, seed=3)
    picked = bins[idx[:, 0], idx[:, 1]].tolist()
    assert sorted(picked) == [0, 0, 1, 1, 2]
    assert -1 not in picked
