"""GradientProbe on real, small, locally built transformers models."""

from __future__ import annotations

import math

import pytest
import torch
from _models import completion_logps, grpo_loss, make_batch, tiny_gpt2, tiny_qwen2

from tokendyn.probe import GradientProbe, discover_points, select_points

torch.set_num_threads(1)
T = 0.7


def _plain_step(model, batch, probe=None, old_shift=0.0, autocast=False, **fields):
    """One GRPO micro-batch through the plain (unfused) head; returns (loss, logps)."""
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        logps = completion_logps(out.logits, batch, T)
    g = torch.Generator().manual_seed(5)
    old = (logps.detach() + old_shift * torch.randn(logps.shape, generator=g)).clamp(max=0)
    if probe is not None:
        probe.begin_step(
            completion_mask=batch.completion_mask,
            advantages=batch.advantages,
            old_logp=old,
            completion_ids=batch.completion_ids,
            logps=logps,
            temperature=T,
            **fields,
        )
    loss = grpo_loss(logps, old, batch.advantages, batch.completion_mask)
    loss.backward()
    return loss, logps


def _all_hooks(model):
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()
    )


def test_points_discovery_and_selection():
    qwen, gpt2 = tiny_qwen2(layers=3), tiny_gpt2()
    assert [p.name for p in discover_points(qwen)] == [
        "layers.0.out",
        "layers.1.out",
        "layers.2.out",
        "final_norm.out",
    ]
    pts = discover_points(gpt2)
    assert [p.name for p in pts] == ["layers.0.out", "layers.1.out", "final_norm.out"]
    assert pts[-1].module is gpt2.transformer.ln_f and pts[0].module is gpt2.transformer.h[0]
    assert [p.name for p in select_points(discover_points(qwen), "layers.*")] == [
        f"layers.{i}.out" for i in range(3)
    ]
    assert [p.name for p in select_points(discover_points(qwen), ["final_norm.out", "layers.1.out"])] == [
        "layers.1.out",
        "final_norm.out",
    ]
    with pytest.raises(ValueError, match="matches no point; available: layers.0.out"):
        select_points(discover_points(qwen), "layers.9.out")


def test_hook_gradients_equal_captum_and_w_is_the_autograd_weight():
    from captum.attr import LayerGradientXActivation

    model = tiny_qwen2(sharpen=8.0, attn="eager")
    batch = make_batch(model)
    coef = torch.randn(batch.completion_mask.shape, generator=torch.Generator().manual_seed(3))
    coef = coef * batch.completion_mask

    def objective(ids, c):  # one scalar per example: J_b = sum_t c_bt log pi_bt
        logits = model(input_ids=ids, attention_mask=batch.attention_mask).logits
        return (c * completion_logps(logits, batch, T)).sum(-1)

    with GradientProbe(model, check_tokens=None, direct_tokens=0, temperature=T, auto=True) as probe:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logps = completion_logps(logits, batch, T)
        probe.begin_step(
            completion_mask=batch.completion_mask,
            completion_ids=batch.completion_ids,
            logps=logps,
            temperature=T,
        )
        (coef * logps).sum().backward()
        result = probe.end_step()
    # w_t = dL/dlog pi_t by autograd equals the coefficient of log pi_t in the loss
    torch.testing.assert_close(result.w, coef.double(), rtol=0, atol=1e-7)
    modules = [model.model.layers[0], model.model.layers[1], model.model.norm]
    attr = LayerGradientXActivation(objective, modules, multiply_by_inputs=False).attribute(
        batch.input_ids, additional_forward_args=(coef,)
    )
    c, s = batch.c, batch.input_ids.shape[1]
    valid = batch.completion_mask.bool()
    for j, a in enumerate(attr):
        expected = a[:, s - c - 1 : s - 1].norm(dim=-1)  # position p(t) = one before o_t
        torch.testing.assert_close(result.norms[j][valid], expected[valid].float(), rtol=1e-5, atol=1e-9)


def test_exact_checks_multiple_steps_with_optimizer_and_direct_equals_explicit_backward():
    model = tiny_qwen2(sharpen=12.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    results = []
    with GradientProbe(
        model,
        check_tokens=None,
        direct_tokens=8,
        direct_chunk=3,
        direct_budget=None,  # every direct token, whatever it costs (the budget: test_budget.py)
        temperature=T,
        auto=True,
        sink=results.append,
    ) as probe:
        for step in range(3):
            batch = make_batch(model, seed=10 + step)
            _plain_step(model, batch, probe, old_shift=0.15)
            opt.step()  # the step ends at the next forward, after W has changed
            opt.zero_grad()
    assert len(results) == 3
    for rec in results:
        ck = rec["checks"]
        assert ck["logits_violations"] == [0] and ck["head_violations"] == [0]
        assert ck["head_ratio_max"][0] <= ck["head_bound"][0]
        assert (
            ck["logits_lo"][0] <= ck["logits_ratio_min"][0]
            and ck["logits_ratio_max"][0] <= ck["logits_hi"][0]
        )
        assert ck["identity_max_scaled_err"][0] < 1e-5
        assert ck["identity_logits_max_rel_err"][0] is not None
        bs = rec["binstats"]
        n_valid = sum(
            c
            for c, q, p in zip(bs["count"], bs["quantity"], bs["point_index"], strict=True)
            if q == "norm" and p == 0
        )
        assert ck["n_checked"][0] == n_valid > 0  # check_tokens=None: every completion token is checked
    first = results[0]["checks"]
    assert first["identity_max_rel_err"][0] < 1e-5 and first["identity_logits_max_rel_err"][0] < 1e-5

    # "direct" = token t's own gradient: at the LM-head input it equals the total one; at inner layers it equals
    # an explicit single-token backward.
    model = tiny_qwen2(sharpen=12.0)
    batch = make_batch(model, seed=20)
    with GradientProbe(  # 12 tokens over 6 rows: several backward slots, batched 2 at a time
        model,
        check_tokens=None,
        direct_tokens=12,
        direct_chunk=2,
        direct_budget=None,
        sample_tokens=12,
        temperature=T,
        auto=True,
    ) as probe:
        _, logps = _plain_step(model, batch, probe)
        res = probe.end_step()
    tok = res.records["tokens"]
    assert sum(v is not None for v in tok["direct_norm"]) == 12 * 3
    hidden = {}
    hooks = [
        m.register_forward_hook(lambda mod, i, o, k=k: hidden.__setitem__(k, o))
        for k, m in (("layers.0.out", model.model.layers[0]), ("final_norm.out", model.model.norm))
    ]
    logps = completion_logps(
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch, T
    )
    for h in hooks:
        h.remove()
    s = batch.input_ids.shape[1]
    for i, point in enumerate(tok["point"]):
        if point == "layers.1.out" or tok["direct_norm"][i] is None:
            continue
        r, j = tok["row"][i], tok["pos"][i]
        (g,) = torch.autograd.grad(logps[r, j], hidden[point], retain_graph=True)
        expected = g[r, s - batch.c - 1 + j].norm().item() * abs(tok["w"][i])
        assert tok["direct_norm"][i] == pytest.approx(expected, rel=1e-5, abs=1e-12)
        if point == "final_norm.out":
            assert tok["direct_norm"][i] == pytest.approx(tok["norm"][i], rel=1e-5, abs=1e-12)


def test_fused_lm_head_identity_zero_violations_and_bitwise_gradients():
    from trl.trainer.utils import add_fused_lm_head

    def run(with_probe: bool):
        model = tiny_qwen2(sharpen=10.0)
        batch = make_batch(model)
        add_fused_lm_head(model, temperature=T)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        probe = GradientProbe(model, check_tokens=None, direct_tokens=16, direct_budget=None, temperature=T)
        labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
        labels[:, : -batch.c] = -100
        result = None
        with probe:
            if with_probe:  # the trainer's way: inputs announced before the forward, end_step after backward
                probe.begin_step(
                    7,
                    "low",
                    completion_mask=batch.completion_mask,
                    advantages=batch.advantages,
                    completion_ids=batch.completion_ids,
                    temperature=T,
                )
            out = model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                labels=labels,
                fused_lm_head=True,
            )
            lp = out.log_probs[:, -batch.c :]
            grpo_loss(lp, lp.detach() - 0.1, batch.advantages, batch.completion_mask).backward()
            if with_probe:
                result = probe.end_step()
        return model, result

    base, _ = run(False)
    probed, result = run(True)
    for (name, a), b in zip(base.named_parameters(), probed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    ck = result.records["checks"]
    assert ck["identity_max_rel_err"][0] < 1e-5 and ck["identity_n"][0] > 10
    assert ck["logits_violations"] == [0] and ck["head_violations"] == [0]
    assert result.records["bound"]["direct_n"] == [16, 16, 16]
    assert set(result.records["bound"]["stage"]) == {"low"} and set(result.records["bound"]["step"]) == {7}


def test_parameter_gradients_bitwise_identical_plain_head():
    grads = []
    for with_probe in (False, True):
        model = tiny_qwen2(sharpen=5.0)
        batch = make_batch(model)
        with GradientProbe(model, check_tokens=None, direct_tokens=8, temperature=T, auto=True) as probe:
            _plain_step(model, batch, probe if with_probe else None, old_shift=0.2)
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_no_hook_left_after_an_exception_inside_the_context():
    model = tiny_qwen2()
    batch = make_batch(model, sample=False)
    before = _all_hooks(model)
    probe = GradientProbe(model, auto=True)
    with pytest.raises(RuntimeError, match="boom"):
        with probe:
            assert _all_hooks(model) > before
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
            raise RuntimeError("boom")
    assert _all_hooks(model) == before and not probe.attached
    # the tensor hooks of the interrupted forward are gone too: its backward records nothing
    out.logits.sum().backward()
    assert probe._pass is None and probe.last is None


def test_bf16_autocast_gives_finite_float_statistics():
    model = tiny_qwen2(sharpen=6.0)
    batch = make_batch(model)
    dtypes = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    with GradientProbe(model, check_tokens=None, temperature=T, auto=True) as probe:
        _plain_step(model, batch, probe, autocast=True)
        res = probe.end_step()
    hook.remove()
    assert dtypes == [torch.bfloat16]  # the blocks really ran in bf16 (the residual stream stays float32)
    bs = res.records["binstats"]
    assert all(math.isfinite(v) for v in bs["sum"]) and sum(bs["count"]) > 0 and sum(bs["nonfinite"]) == 0
    assert res.norms.dtype == torch.float32 and bool(
        torch.isfinite(res.norms[:, batch.completion_mask.bool()]).all()
    )
    ck = res.records["checks"]
    assert math.isfinite(ck["identity_max_rel_err"][0])
    assert ck["logits_violations"] == [0] and ck["head_violations"] == [0]
    assert all(v is None or math.isfinite(v) for v in res.records["bound"]["ratio_max"])


def test_pi_equal_one_and_empty_bins_give_defined_outputs():
    model = tiny_qwen2(sharpen=3e4)  # huge logits: the greedy-like samples get pi = 1 exactly in float32
    batch = make_batch(model)
    with GradientProbe(
        model, bins=[0.0, 0.1, 0.2, 0.3, 1.0], check_tokens=None, temperature=T, auto=True
    ) as probe:
        _, logps = _plain_step(model, batch, probe)
        res = probe.end_step()
    valid = batch.completion_mask.bool()
    assert bool((res.pi[valid] == 1.0).any())
    one = valid & (res.pi == 1.0)
    final = res.norms[-1]
    assert float(final[one].max()) <= 1e-6 * float(final[valid].max())  # (e_o - pi) ~ 0
    tok = res.records["tokens"]
    rows = [i for i, p in enumerate(tok["pi"]) if p == 1.0]
    assert rows and all(tok["ratio"][i] is None for i in rows)
    lo, hi = res.records["checks"]["logits_lo"][0], res.records["checks"]["logits_hi"][0]
    assert all(lo <= tok["logits_ratio"][i] <= hi for i in rows)  # defined from the logits even at pi = 1
    bs = res.records["binstats"]
    norm_rows = [i for i, q in enumerate(bs["quantity"]) if q == "norm"]
    empty = [i for i in norm_rows if bs["count"][i] == 0]
    assert empty, "the test needs an empty bin"
    assert all(bs["min"][i] is None and bs["max"][i] is None and bs["sum"][i] == 0 for i in empty)
    assert res.records["checks"]["logits_violations"] == [0]


def test_bad_inputs_are_rejected_before_any_work():
    model = tiny_qwen2()
    batch = make_batch(model, sample=False)
    probe = GradientProbe(model)
    mask = batch.completion_mask
    with pytest.raises(ValueError, match="old_logp must be log-probabilities <= 0"):
        probe.begin_step(0, completion_mask=mask, old_logp=torch.full(mask.shape, 0.5))
    with pytest.raises(ValueError, match="advantages must have shape"):
        probe.begin_step(0, completion_mask=mask, advantages=torch.zeros(3))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        probe.begin_step(0, completion_mask=mask, temperature=0)
    with pytest.raises(ValueError, match="step must be an integer"):
        probe.begin_step(-1, completion_mask=mask)
    with pytest.raises(ValueError, match="sample_tokens"):
        GradientProbe(model, sample_tokens=-1)
    # one probe step is one forward + one backward
    with GradientProbe(model) as probe:
        probe.begin_step(0, completion_mask=mask, completion_ids=batch.completion_ids)
        model(input_ids=batch.input_ids)
        with pytest.raises(RuntimeError, match="still open without a backward"):
            probe.begin_step(1, completion_mask=mask)


def test_gpt2_family_checks():
    model = tiny_gpt2()
    batch = make_batch(model)
    with GradientProbe(model, check_tokens=None, temperature=T, auto=True) as probe:
        _plain_step(model, batch, probe, old_shift=0.1)
        res = probe.end_step()
    ck = res.records["checks"]
    assert (
        ck["identity_max_rel_err"][0] < 1e-5
        and ck["logits_violations"] == [0]
        and ck["head_violations"] == [0]
    )
    assert res.records["bound"]["point"] == ["layers.0.out", "layers.1.out", "final_norm.out"]


def test_watch_logps_and_custom_token_positions_align_like_the_default_layout():
    model = tiny_qwen2(sharpen=10.0)
    batch = make_batch(model)
    with GradientProbe(model, check_tokens=None, direct_tokens=0, temperature=T) as probe:
        probe.begin_step(0, completion_mask=batch.completion_mask, completion_ids=batch.completion_ids)
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        logps = completion_logps(out.logits, batch, T)
        probe.watch_logps(logps)  # w from the caller's log-probs, announced after the forward
        (logps * batch.completion_mask).sum().backward()
        ref = probe.end_step()
    # the same completions followed by 3 junk positions: completions are no longer at the end of each row
    pad = torch.zeros(batch.input_ids.shape[0], 3, dtype=torch.long)
    ids = torch.cat([batch.input_ids, pad], 1)
    amask = torch.cat([batch.attention_mask, pad], 1)
    s, c = batch.input_ids.shape[1], batch.c
    positions = torch.arange(s - c, s).expand(ids.shape[0], c)  # sequence index of o_t
    model.zero_grad()
    with GradientProbe(model, check_tokens=None, direct_tokens=0, temperature=T, auto=True) as probe:
        logits = model(input_ids=ids, attention_mask=amask).logits[:, :s]
        logps = completion_logps(logits, batch, T)
        probe.begin_step(completion_mask=batch.completion_mask, completion_ids=batch.completion_ids, logps=logps,
                     token_positions=positions, temperature=T)  # fmt: skip
        (logps * batch.completion_mask).sum().backward()
        moved = probe.end_step()
    valid = batch.completion_mask.bool()
    torch.testing.assert_close(moved.norms[:, valid], ref.norms[:, valid], rtol=1e-5, atol=1e-8)
    assert moved.records["checks"]["identity_max_rel_err"][0] < 1e-5


def test_a_second_probe_on_the_same_model_raises():
    """Two attached probes would read every gradient twice: the second attach is refused until the first
    detaches; the first can re-attach itself."""
    from _models import tiny_qwen2

    from tokendyn.probe import GradientProbe

    model = tiny_qwen2(0)
    first = GradientProbe(model).attach()
    with pytest.raises(RuntimeError, match="already has an attached GradientProbe"):
        GradientProbe(model).attach()
    assert first.attach() is first
    first.detach()
    with GradientProbe(model) as second:
        assert second.attached
    assert not hasattr(model, "_tokendyn_probe")


def test_a_packed_layout_through_token_rows_equals_one_row_per_sequence():
    """verl's remove-padding layout: every sequence of a micro-batch packed into one row (block-diagonal causal
    attention, positions restarting per sequence). Told each token's row (`token_rows`) and position, the probe
    records what it records with one row per sequence: norms, w, the exact checks and the direct gradients."""
    model = tiny_qwen2(sharpen=10.0)
    batch = make_batch(model)
    opts = dict(check_tokens=None, direct_tokens=64, direct_every=1, direct_budget=None, temperature=T)
    with GradientProbe(model, auto=True, **opts) as probe:
        _plain_step(model, batch, probe)
        ref = probe.end_step()
    model.zero_grad()
    n, s, c = batch.input_ids.shape[0], batch.input_ids.shape[1], batch.c
    lengths = batch.attention_mask.sum(1)  # prompt + the scored completion tokens of each row
    ids = torch.cat([batch.input_ids[i, : lengths[i]] for i in range(n)])[None]
    starts = torch.cumsum(lengths, 0) - lengths
    seg = torch.repeat_interleave(torch.arange(n), lengths)
    causal = torch.tril(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool))
    packed_mask = (causal & (seg[:, None] == seg[None, :]))[None, None]
    position_ids = torch.cat([torch.arange(int(k)) for k in lengths])[None]
    positions = (starts[:, None] + s - c + torch.arange(c)[None]).clamp(max=ids.shape[1] - 1)  # index of o_t
    with GradientProbe(model, auto=True, **opts) as probe:
        logits = model(input_ids=ids, attention_mask=packed_mask, position_ids=position_ids).logits[0]
        z = logits[(positions - 1).clamp(min=0)].float() / T  # [B, C, V]: the position before o_t predicts it
        logps = torch.log_softmax(z, -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
        old = logps.detach().clamp(max=0)  # as `_plain_step`'s (old_shift 0)
        probe.begin_step(completion_mask=batch.completion_mask, advantages=batch.advantages, old_logp=old,
                         completion_ids=batch.completion_ids, logps=logps, token_positions=positions,
                         token_rows=torch.zeros_like(positions), temperature=T)  # fmt: skip
        grpo_loss(logps, old, batch.advantages, batch.completion_mask).backward()
        packed = probe.end_step()
    valid = batch.completion_mask.bool()
    torch.testing.assert_close(packed.norms[:, valid], ref.norms[:, valid], rtol=1e-4, atol=1e-7)
    assert packed.records["checks"]["logits_violations"] == [0] and packed.records["checks"][
        "head_violations"
    ] == [0]
    assert packed.records["checks"]["identity_max_rel_err"][0] < 1e-5
    b_ref, b_packed = (
        ref.records["bound"],
        packed.records["bound"],
    )  # the direct gradients' envelopes per point
    assert b_packed["direct_n"] == b_ref["direct_n"] and min(b_ref["direct_n"]) > 0
    for col in ("direct_ratio_min", "direct_ratio_max", "direct_spearman"):
        torch.testing.assert_close(
            torch.tensor(b_packed[col]), torch.tensor(b_ref[col]), rtol=1e-4, atol=1e-7
        )
    with pytest.raises(ValueError, match="token_rows must be < 1"):
        with GradientProbe(model, auto=True, **opts) as probe:
            logits = model(input_ids=ids, attention_mask=packed_mask, position_ids=position_ids).logits[0]
            probe.begin_step(completion_mask=batch.completion_mask, logps=logps.detach().requires_grad_(),
                             token_positions=positions, token_rows=torch.ones_like(positions))  # fmt: skip
