"""The probe's cost budget (`tokendyn.probe.budget`): the LM-head checks shrink where the head dominates the
model and stay whole where it does not, the direct gradients' replays keep to their share of the training flops on
average, and neither budget changes what is measured on the tokens it does measure."""

from __future__ import annotations

import polars as pl
import pytest
import torch
from _models import completion_logps, grpo_loss, make_batch, tiny_qwen2
from torch import nn

from tokendyn import instrument, load_run
from tokendyn.probe import budget

torch.set_num_threads(1)
T = 0.7


def _arithmetic_parameters(model: nn.Module) -> int:
    """Parameters of the modules that multiply (every module but the embedding lookup), counted module by module."""
    seen, n = set(), 0
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            continue
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
    return n


@pytest.mark.parametrize("tied", [False, True])
def test_flop_parameters_leave_out_only_the_embedding_lookup(tied):
    model = tiny_qwen2(vocab=300, hidden=32)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    total, emb = budget.flop_parameters(model)
    # tied: the shared table is also the head's V x H matrix, so it does arithmetic and stays in (once)
    assert total - emb == _arithmetic_parameters(model)
    assert emb == (0 if tied else 300 * 32)


def _steps(model, tmp_path, n_steps: int, **options):
    batch = make_batch(model, n=4, prompt=4, completion=24, seed=3)
    with instrument(model, tmp_path, rank=0, temperature=T, flush_seconds=0, **options) as probe:
        for step in range(n_steps):
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            logps = completion_logps(logits, batch, T)
            old = logps.detach()
            probe.begin_step(step=step, completion_mask=batch.completion_mask, advantages=batch.advantages,
                             old_logp=old, completion_ids=batch.completion_ids, logps=logps, temperature=T)  # fmt: skip
            grpo_loss(logps, old, batch.advantages, batch.completion_mask).backward()
            probe.end_step()
            model.zero_grad(set_to_none=True)
    return load_run(tmp_path), batch


def test_the_head_checks_shrink_to_their_budget_where_the_head_is_most_of_the_model(tmp_path):
    # V H = 4,000 x 16 dwarfs the layers: 256 check tokens would cost far more than 2 % of the step
    model = tiny_qwen2(vocab=4000, hidden=16, layers=1, sharpen=8.0)
    run, batch = _steps(model, tmp_path / "budget", 1, direct_tokens=0)
    n_tokens = int(batch.completion_mask.sum())
    checks = run["checks"].collect()
    k = int(checks["n_checked"][0])
    params, emb = budget.flop_parameters(model)
    n = batch.input_ids.numel()
    assert budget.CHECK_FLOOR == k < n_tokens  # the floor: the budget alone affords fewer
    assert budget.check_flops(k, 16, 4000, refresh=False) > 0.02 * budget.step_flops(params - emb, n)
    assert int(checks["identity_violations"].sum()) == 0 and int(checks["head_violations"].sum()) == 0
    whole = _steps(model, tmp_path / "whole", 1, direct_tokens=0, check_budget=None)[0]
    assert int(whole["checks"].collect()["n_checked"][0]) == n_tokens  # < 256: every token


def test_the_head_checks_stay_whole_where_the_head_is_cheap(tmp_path):
    # the layers' parameters are ~100 x the head's V H: every token's check costs < 2 % of the step
    model = tiny_qwen2(vocab=16, hidden=32, layers=12, sharpen=4.0)
    run, batch = _steps(model, tmp_path, 1, direct_tokens=0)
    assert int(run["checks"].collect()["n_checked"][0]) == int(batch.completion_mask.sum())


def test_checks_a_micro_batch_cannot_afford_wait_for_their_credit_and_the_bound_still_covers_every_token(
    tmp_path,
):
    # 112 tokens of a 10k-parameter model: even the floor's 32 tokens cost ~5 micro-batches' 2 %
    model = tiny_qwen2(vocab=16, hidden=32, layers=1, sharpen=4.0)
    n_steps = 12
    run, batch = _steps(model, tmp_path, n_steps, direct_tokens=0)
    checks = run["checks"].collect().sort("step")
    checked = checks.filter(pl.col("n_checked") > 0)["step"].to_list()
    assert checked[0] == 0 and 1 < len(checked) < n_steps
    assert set(checks.filter(pl.col("n_checked") == 0)["step"]) == set(range(n_steps)) - set(checked)
    # every micro-batch, checked or not, bounds every scored token at the LM-head input (against the last sigma)
    n_scored = int(((batch.completion_mask > 0) & (batch.advantages != 0).unsqueeze(1)).sum())
    assert checks["head_n"].to_list() == [n_scored] * n_steps
    assert int(checks["head_violations"].sum()) == 0 and int(checks["identity_violations"].sum()) == 0
    # the credit: what the checks spent is within one check of what the budget earned
    params, emb = budget.flop_parameters(model)
    earned = 0.02 * budget.step_flops(params - emb, batch.input_ids.numel()) * n_steps
    one = budget.check_flops(budget.CHECK_FLOOR, 32, 16, refresh=True)
    spent = sum(budget.check_flops(budget.CHECK_FLOOR, 32, 16, refresh=i == 0) for i in range(len(checked)))
    assert set(checks.filter(pl.col("n_checked") > 0)["n_checked"]) == {budget.CHECK_FLOOR}
    assert spent <= earned + one


def _direct_steps(run) -> list[int]:
    tokens = run["tokens"].filter(pl.col("direct_norm").is_not_null()).collect()
    return sorted(set(tokens["step"].to_list()))


def test_direct_replays_keep_to_their_share_of_the_training_flops(tmp_path):
    model = tiny_qwen2(vocab=64, hidden=32, layers=2, sharpen=4.0)
    n_steps, b = 24, 0.25
    run, batch = _steps(model, tmp_path / "budget", n_steps, direct_tokens=8, direct_every=1, direct_budget=b)
    done = _direct_steps(run)
    assert done[0] == 0 and 1 < len(done) < n_steps  # the first micro-batch, then as the credit allows
    # the replays' flops (each from its own sample of rows) against what the budget earned: a token bucket spends
    # at most one replay beyond its earnings, and would have afforded one more only if it were starved
    params, emb = budget.flop_parameters(model)
    p = params - emb
    rows, seq = batch.input_ids.shape
    direct = (
        run["tokens"].filter(pl.col("direct_norm").is_not_null()).unique(["step", "row", "pos"]).collect()
    )
    costs, one_step = [], budget.step_flops(p, rows * seq)
    tokens = run["tokens"].collect()
    first_point, cut = tokens["point"][0], []
    for step in done:
        # the replay took the longest prefix of the step's first 8 sampled tokens (records keep the sample's order)
        sampled = tokens.filter((pl.col("step") == step) & (pl.col("point") == first_point)).head(8)
        k = budget.direct_tokens_within(
            sampled["row"].to_list(), p - 64 * 32, seq, budget.REPLAY_STEPS * one_step
        )
        replayed = direct.filter(pl.col("step") == step).select("row", "pos").sort("row", "pos")
        assert replayed.equals(sampled.head(k).select("row", "pos").sort("row", "pos"))
        cut.append(k < 8)
        per_row = direct.filter(pl.col("step") == step).group_by("row").len()["len"]
        cost = budget.direct_flops(p - 64 * 32, seq, per_row.len(), int(per_row.max()))
        # no replay costs more than one training step of its micro-batch, but a single token's
        assert 1 <= per_row.sum() <= 8 and (cost <= budget.REPLAY_STEPS * one_step or per_row.sum() == 1)
        costs.append(cost)
    assert any(cut)  # (the cap binds here)
    earned = b * budget.step_flops(p, rows * seq) * n_steps
    assert sum(costs) <= earned + max(costs)
    assert sum(costs) + max(costs) > earned - b * budget.step_flops(p, rows * seq)
    every = _direct_steps(
        _steps(model, tmp_path / "every", 6, direct_tokens=8, direct_every=1, direct_budget=None)[0]
    )
    assert every == list(range(6))


def test_a_budget_does_not_change_the_direct_gradients_it_computes(tmp_path):
    model = tiny_qwen2(vocab=64, hidden=32, layers=2, sharpen=4.0)
    a = _steps(model, tmp_path / "a", 1, direct_tokens=8)[0]["tokens"].collect()
    b = _steps(model, tmp_path / "b", 1, direct_tokens=8, direct_budget=None, check_budget=None)[0]
    b = b["tokens"].collect()
    cols = ["step", "row", "pos", "point", "direct_norm"]
    # the budget replays a prefix of the sampled tokens (one step's flops); on those, the same numbers
    a = a.select(cols).filter(pl.col("direct_norm").is_not_null()).sort(cols[:4])
    b = b.select(cols).filter(pl.col("direct_norm").is_not_null()).sort(cols[:4])
    assert 0 < a.height < b.height
    assert a.equals(b.join(a.select(cols[:4]), on=cols[:4], how="semi").sort(cols[:4]))


def _replay_prefix_by_enumeration(rows: list[int], layer_params: int, seq: int, cap: float) -> int:
    """The largest k whose prefix rows[:k] replays within cap, every k tried (1 when none does)."""
    fits = [
        k
        for k in range(1, len(rows) + 1)
        if 2.0 * layer_params * seq * len(set(rows[:k])) * (1 + 2 * max(rows[:k].count(r) for r in rows[:k]))
        <= cap
    ]
    return max(fits, default=min(1, len(rows)))


def test_one_replay_takes_the_longest_prefix_one_step_affords():
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(0, 20, (1,), generator=gen))
        rows = torch.randint(0, 5, (n,), generator=gen).tolist()
        cap = float(torch.randint(1, 200, (1,), generator=gen)) * 2.0 * 7 * 3
        assert budget.direct_tokens_within(rows, 7, 3, cap) == _replay_prefix_by_enumeration(rows, 7, 3, cap)
    # SmolLM2-135M (P_L = 106.2M of P = 134.5M), two rows of 160 tokens: two tokens in distinct rows fit, not three
    p, p_l, seq = 134_515_008, 134_515_008 - 49_152 * 576, 160
    assert budget.direct_tokens_within([0, 1, 0, 1, 0], p_l, seq, budget.step_flops(p, 2 * seq)) == 2
    assert budget.direct_tokens_within([0, 0, 0, 1], p_l, seq, budget.step_flops(p, 2 * seq)) == 3
