"""The tokens behind a spike, with a known truth: one completion of the model's own samples carries a planted token at
pi ~ 1e-4 and a large advantage in an otherwise calm batch (`_spike.plant_spike`); the localiser names that token
first, on the embedded default policy and on SmolLM2-135M. The shares themselves are checked against a plain float64
loop (one backward per token on a float64 copy of the model), and the trigger fires on the planted step's gradient
norm after calm steps."""

from __future__ import annotations

import copy

import pytest
import torch
from _spike import plant_spike

from tokendyn.effects.shares import gradient_shares
from tokendyn.effects.spike import SpikeMonitor, spike_tokens, spikes_frame
from tokendyn.effects.spike_trigger import SpikeWatch, strongest
from tokendyn.policy import load_policy
from tokendyn.probe.tokenloss import ProbeBatch
from tokendyn.records import SCHEMAS
from tokendyn.tasks.kk.datasets import puzzles, trl_rows

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def default_policy():
    model, tok = load_policy(None, dtype=torch.float32)
    return model.eval(), tok


def kk_prompts(n: int, seed: int = 0) -> list[str]:
    return [r["prompt"] for r in trl_rows(puzzles(3, n, seed, n))]


@pytest.fixture(scope="module")
def planted(default_policy):
    model, tok = default_policy
    return plant_spike(model, tok, kk_prompts(4), n_return=2, max_new_tokens=32)


def loop_shares(model, batch: ProbeBatch, tokens: list[tuple[int, int]]) -> list[float]:
    """s_t = <grad l_t, g> / ||g||^2 of ``tokens`` by a plain float64 loop: a float64 copy of the model, a plain
    forward, the token-mean surrogate l_t = -A_t exp(log pi_t - sg(log pi_t)) / N (ratio 1, pi_old = pi), one
    backward for g and one per token."""
    m = copy.deepcopy(model).double().eval()
    params = [p for p in m.parameters() if p.requires_grad]
    c = batch.n_completion
    logits = m(batch.input_ids, attention_mask=batch.attention_mask).logits[:, -c - 1 : -1]
    logp = torch.log_softmax(logits, -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    mask = batch.completion_mask
    terms = -batch.advantages * torch.exp(logp - logp.detach()) * mask / mask.sum()
    g = torch.autograd.grad(terms.sum(), params, retain_graph=True)
    norm2 = sum(float((x * x).sum()) for x in g)
    out = []
    for r, j in tokens:
        gt = torch.autograd.grad(terms[r, j], params, retain_graph=True, allow_unused=True)
        out.append(sum(float((a * b).sum()) for a, b in zip(gt, g, strict=True) if a is not None) / norm2)
    return out


def test_the_planted_token_is_named_first_on_the_default_policy(default_policy, planted):
    model, tok = default_policy
    assert 3e-5 < planted.pi < 3e-4, planted.pi  # the truth: a token at pi ~ 1e-4
    found = spike_tokens(model, planted.batch)
    assert found.rank_of(planted.row, planted.pos) == 1
    assert found.top(1).tolist() == [[planted.row, planted.pos]]
    mask = planted.batch.completion_mask
    assert float(found.shares[mask].sum()) == pytest.approx(1.0, abs=1e-4)
    # the shares are the exact decomposition: the plain float64 loop gives the same numbers at the top 4 tokens and
    # the last 4 (the most negative shares)
    picked = found.order[:4].tolist() + found.order[-4:].tolist()
    ref = loop_shares(model, planted.batch, [tuple(t) for t in picked])
    got = [float(found.shares[r, j]) for r, j in picked]
    assert got == pytest.approx(ref, rel=1e-3, abs=1e-6)
    assert ref[:4] == sorted(ref[:4], reverse=True)
    assert found.pi_old[planted.row, planted.pos] == pytest.approx(planted.pi, rel=1e-3)


def test_the_spikes_record_names_the_token_with_its_numbers(default_policy, planted):
    model, tok = default_policy
    b = planted.batch
    # a sampler: log mu = log pi_old - 0.25 on every token, and an importance weight of 0.5 on every row
    from tokendyn.effects.probs import fix_pi_old

    fixed, _ = fix_pi_old(model, b)
    sampled = ProbeBatch(fixed.input_ids, fixed.attention_mask, fixed.completion_mask, fixed.advantages,
                         old_logp=fixed.old_logp, sampling_logp=fixed.old_logp - 0.25,
                         is_ratio=torch.full((b.input_ids.size(0), 1), 0.5))  # fmt: skip
    found = spike_tokens(model, sampled)
    watch = SpikeWatch(k=3.0, min_history=1)
    watch.check({"grad_norm": 0.1})
    trigger = strongest(watch.check({"grad_norm": found.grad_norm}))
    df = spikes_frame(found, sampled, step=7, top=5, trigger=trigger, k=3.0, tokenizer=tok)
    assert dict(df.schema) == SCHEMAS["spikes"] and df.height == 5
    first = df.row(0, named=True)
    assert (first["rank"], first["seq"], first["pos"], first["token_id"]) == (1, planted.row, planted.pos,
                                                                            planted.token_id)  # fmt: skip
    assert first["text"] == planted.text and first["context"].endswith(planted.text)
    assert first["bin"] == 0 and (first["bin_lo"], first["bin_hi"]) == (0.0, 0.25)
    assert first["pi_old"] == pytest.approx(planted.pi, rel=1e-3) and first["advantage"] == 3.0
    assert df["log_rho"].to_list() == pytest.approx([0.25] * 5, abs=1e-6)
    assert df["is_weight"].to_list() == [0.5] * 5
    assert first["trigger"] == "grad_norm" and first["trigger_median"] == 0.1 and first["k"] == 3.0
    assert df["share"].to_list() == sorted(df["share"].to_list(), reverse=True)
    assert first["grad_norm"] == found.grad_norm > 0
    # without a sampler: log rho and the weight are null, not 0
    plain = spikes_frame(spike_tokens(model, b), b, step=7, top=2)
    assert plain["log_rho"].null_count() == 2 and plain["is_weight"].null_count() == 2
    assert plain["trigger"].null_count() == 2 and plain["text"].to_list() == ["", ""]  # no tokenizer: ""


def test_shares_handed_in_give_the_same_ranking_without_a_backward(default_policy, planted):
    model, _ = default_policy
    full = spike_tokens(model, planted.batch)
    again = spike_tokens(model, planted.batch, shares=full.shares)
    assert torch.equal(again.order, full.order) and again.grad_norm is None
    torch.testing.assert_close(again.pi_old, full.pi_old)


def test_the_monitor_fires_on_the_planted_step_after_calm_ones(default_policy, planted):
    """Three calm batches (advantages +-0.1, the model's own samples) and then the planted one, each with the
    `shares` frame its analyses would write: the monitor reads ||g|| and L from those frames, stays quiet on the
    calm steps and writes the planted step's `spikes` record, the planted token first."""
    model, tok = default_policy
    monitor = SpikeMonitor(k=3.0, min_history=3, top=4)
    for seed in (1, 2, 3):
        calm = plant_spike(model, tok, kk_prompts(4, seed), seed=seed, big=0.1)  # no large advantage: calm
        frames = {"shares": gradient_shares(model, calm.batch, per_token=False).bins.to_frame(seed)}
        assert monitor.observe(model, calm.batch, step=seed, frames=frames, tokenizer=tok) is None
    frames = {"shares": gradient_shares(model, planted.batch, per_token=False).bins.to_frame(4)}
    df = monitor.observe(model, planted.batch, step=4, frames=frames, tokenizer=tok)
    assert df is not None and df.height == 4
    first = df.row(0, named=True)
    assert (first["seq"], first["pos"], first["step"]) == (planted.row, planted.pos, 4)
    # the record names the quantity that left its running range furthest
    assert first["trigger"] == "grad_norm" and first["trigger_ratio"] > 3.0
    assert first["trigger_value"] == pytest.approx(first[first["trigger"]], rel=1e-4)  # the frame's = its own
    # no sampler: the sampler's quantities are not watched; the signed loss is not judged by default
    assert set(monitor.watch.history) == {"grad_norm"}


def test_bad_input_fails_in_one_line(default_policy, planted):
    model, _ = default_policy
    b = planted.batch
    found = spike_tokens(model, b)
    with pytest.raises(ValueError, match=r"^spike: top must be an integer >= 1, got 0$"):
        spikes_frame(found, b, step=0, top=0)
    zero = ProbeBatch(b.input_ids, b.attention_mask, b.completion_mask, torch.zeros(b.input_ids.size(0)))
    with pytest.raises(ValueError, match=r"^shares: the direction is zero"):
        spike_tokens(model, zero)


@pytest.mark.real_llm_extra  # ~85 s on 2 CPU cores (loading, sampling, the JVP through 135M parameters)
def test_the_planted_token_is_named_first_on_smollm2():
    model, tok = load_policy("smollm2-135m", dtype=torch.float32)
    questions = ["What is 7 + 5?", "Name a colour.", "Say hello.", "Count to three."]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    p = plant_spike(model.eval(), tok, prompts, n_return=2, max_new_tokens=16)
    assert 3e-5 < p.pi < 3e-4, p.pi
    found = spike_tokens(model, p.batch)
    assert found.rank_of(p.row, p.pos) == 1
    df = spikes_frame(found, p.batch, step=0, top=3, tokenizer=tok)
    assert df.row(0, named=True)["text"] == p.text
