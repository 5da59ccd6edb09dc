"""The probe's memory bounds against independent references: the LM-head checks streamed over
vocabulary chunks against the whole head in float64 (and mpmath near pi = 1), sigma_max by power iteration against
torch.linalg.matrix_norm, the direct gradients under a memory cap against the uncapped run and one plain backward per token."""

from __future__ import annotations

import warnings
from pathlib import Path

import mpmath
import pytest
import torch
from _models import completion_logps, grpo_loss, make_batch, single_token_direct, tiny_qwen2

from tokendyn.probe import GradientProbe
from tokendyn.probe import direct as D
from tokendyn.probe import replay as R
from tokendyn.probe.head import (
    HeadShard,
    head_partial,
    head_quantities,
    logits_identity_error,
    rescaled,
    sigma_max_power,
)

torch.set_num_threads(1)
T = 0.7


def _whole_head(h, weight, bias, targets, temperature):
    """u = W^T (e_o - pi) / T, ||e_o - pi|| / (1 - pi_o), 1 - pi_o and logsumexp(z): the whole head in float64."""
    z = h.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    z = z / temperature
    pi = torch.softmax(z, dim=-1)
    d = torch.nn.functional.one_hot(targets, weight.shape[0]).double() - pi
    omp = 1 - pi.gather(-1, targets[:, None]).squeeze(-1)
    return d @ weight.double() / temperature, d.norm(dim=-1) / omp, omp, torch.logsumexp(z, -1)


def _head(vocab=61, hidden=16, k=24, dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, hidden, generator=g) * 0.6).to(dtype)
    b = (torch.randn(vocab, generator=g) * 0.3).to(dtype) if bias else None
    h = torch.randn(k, hidden, generator=g).to(dtype)
    targets = torch.randint(0, vocab, (k,), generator=g)
    return h, weight, b, targets


def _rel(a, b):
    return (
        float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())
        if a.dim() > 1
        else float(((a - b) / b).abs().max())
    )


@pytest.mark.parametrize("rows", [1, 7, 61, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_head_quantities_equal_the_whole_head_in_float64(rows, dtype):
    h, weight, bias, targets = _head(dtype=dtype)
    q = head_quantities(head_partial(h, HeadShard(weight, bias, 0, 61), targets, T, rows=rows), T)
    u, ratio, omp, lse = _whole_head(h, weight, bias, targets, T)
    assert float(omp.min()) > 1e-3  # far from pi = 1: the whole-head formula is accurate here
    assert _rel(q.direction, u) < 1e-12
    assert _rel(q.logits_ratio, ratio) < 1e-12
    assert _rel(q.one_minus_pi, omp) < 1e-12
    assert _rel(q.lse, lse) < 1e-12
    sigma = float(torch.linalg.matrix_norm(weight.double(), ord=2))
    assert float(q.sigma_lower.max()) <= sigma * (1 + 1e-12)
    torch.testing.assert_close(q.sigma_lower, (u * T).norm(dim=-1) / (ratio * omp), rtol=1e-12, atol=0)


def test_shards_of_the_vocabulary_merge_into_the_whole_head():
    """Three row shards (FSDP2 style, uneven), each summing over its own rows; rescaled to the common maximum and
    added, they give the whole head's quantities."""
    h, weight, bias, targets = _head(seed=3)
    parts = [
        head_partial(h, HeadShard(weight[a:b], bias[a:b], a, 61), targets, T, rows=5)
        for a, b in ((0, 20), (20, 45), (45, 61))
    ]
    big = torch.stack([p.m for p in parts]).amax(0)
    scaled = [rescaled(p, big) for p in parts]
    total = scaled[0]
    for p in scaled[1:]:
        for f in ("s1", "s2", "acc", "z_o", "w_o"):
            setattr(total, f, getattr(total, f) + getattr(p, f))
    q = head_quantities(total, T)
    u, ratio, omp, _ = _whole_head(h, weight, bias, targets, T)
    assert (
        _rel(q.direction, u) < 1e-12
        and _rel(q.logits_ratio, ratio) < 1e-12
        and _rel(q.one_minus_pi, omp) < 1e-12
    )


def test_streamed_direction_is_exact_near_pi_one():
    """pi_o = 1 - ~1e-13: e_o - pi cancels in float64 (relative error ~1e-3 in u), the streamed form does not;
    reference in 50-digit arithmetic."""
    g = torch.Generator().manual_seed(4)
    vocab, hidden = 13, 4
    weight = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    h = torch.randn(3, hidden, generator=g, dtype=torch.float64)
    z = h @ weight.T
    targets = z.argmax(-1)
    h = h * (20.0 / (z.max(-1).values - z.topk(2).values[:, 1])).unsqueeze(
        -1
    )  # margin 20 / T: 1 - pi ~ 1e-12
    q = head_quantities(head_partial(h, HeadShard(weight, None, 0, vocab), targets, T, rows=4), T)
    mpmath.mp.dps = 50
    for k in range(3):
        zk = [mpmath.mpf(float(x)) for x in (h[k] @ weight.T).tolist()]
        zk = [x / mpmath.mpf(T) for x in zk]
        lse = mpmath.log(mpmath.fsum(mpmath.exp(x) for x in zk))
        pi = [mpmath.exp(x - lse) for x in zk]
        o = int(targets[k])
        assert 1e-16 < float(1 - pi[o]) < 1e-9
        d = [(1 if v == o else 0) - pi[v] for v in range(vocab)]
        u = [mpmath.fsum(d[v] * weight[v, j].item() for v in range(vocab)) / T for j in range(hidden)]
        ratio = mpmath.sqrt(mpmath.fsum(x * x for x in d)) / (1 - pi[o])
        ref = torch.tensor([float(x) for x in u], dtype=torch.float64)
        assert float((q.direction[k] - ref).norm() / ref.norm()) < 1e-12
        assert abs(float(q.logits_ratio[k]) / float(ratio) - 1) < 1e-12
        assert abs(float(q.one_minus_pi[k]) / float(1 - pi[o]) - 1) < 1e-12


def test_logits_identity_error_streamed_equals_the_whole_head():
    h, weight, bias, targets = _head(seed=5, k=10)
    g = torch.Generator().manual_seed(6)
    w = torch.randn(10, generator=g, dtype=torch.float64)
    z = (h.double() @ weight.double().T + bias.double()) / T
    pred = w[:, None] * (torch.nn.functional.one_hot(targets, 61).double() - torch.softmax(z, -1))
    grad = (
        pred + 1e-4 * torch.randn(pred.shape, generator=g, dtype=torch.float64)
    ) / T  # a "measured" dL/dlogits
    expected = (grad * T - pred).norm(dim=-1) / pred.norm(dim=-1)
    lse = torch.logsumexp(z, -1)
    g32 = grad.float()
    shard = HeadShard(weight, bias, 0, 61)
    err = logits_identity_error(lambda a, b: g32[:, a:b], w, h, lse, shard, targets, T, rows=9)
    expected32 = (grad.float().double() * T - pred).norm(dim=-1) / pred.norm(
        dim=-1
    )  # the rows arrive in float32
    torch.testing.assert_close(err, expected32, rtol=1e-9, atol=0)
    assert float((err / expected - 1).abs().max()) < 1e-2


# ---- sigma_max ----------------------------------------------------------------------------------------------
def _lm_like_head(vocab, hidden, seed):
    """Gaussian rows plus a shared mean direction, as trained LM heads have (a clear top singular value)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, hidden, generator=g) + 0.5 * torch.randn(hidden, generator=g)


@pytest.mark.parametrize(
    "weight",
    [
        _lm_like_head(500, 64, 0),
        _lm_like_head(500, 64, 1).to(torch.bfloat16),
        torch.randn(61, 32, generator=torch.Generator().manual_seed(2)),  # Gaussian: a small spectral gap
    ],
    ids=["lm_like", "lm_like_bf16", "gaussian"],
)
def test_power_iteration_sigma_max_matches_matrix_norm_before_and_after_an_update(weight):
    true = float(torch.linalg.matrix_norm(weight.double(), ord=2))
    sigma, v, cold = sigma_max_power(HeadShard(weight, None, 0, weight.shape[0]), rows=37)
    assert sigma <= true * (1 + 1e-12)  # a lower bound
    assert abs(sigma / true - 1) < 1e-6, (sigma, true, cold)
    # an optimizer update of the head, then the refresh warm-started from the last singular vector
    w = weight.float().clone().requires_grad_()
    opt = torch.optim.Adam([w], lr=1e-2)
    (w.square().sum() * torch.linspace(0, 1, w.shape[0])[:, None].sum()).backward()
    opt.step()
    new = w.detach().to(weight.dtype)
    true_new = float(torch.linalg.matrix_norm(new.double(), ord=2))
    assert abs(true_new / true - 1) > 1e-4  # the update moved sigma_max
    sigma_new, _, warm = sigma_max_power(HeadShard(new, None, 0, new.shape[0]), v, rows=37)
    assert sigma_new <= true_new * (1 + 1e-12) and abs(sigma_new / true_new - 1) < 1e-6
    assert warm <= cold


def _on_policy_step(model, batch, probe, step: int) -> None:
    """Forward, the probe told the tokens, backward of the on-policy GRPO loss (pi_old = pi)."""
    logps = completion_logps(
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch, T
    )
    probe.begin_step(
        step=step,
        completion_mask=batch.completion_mask,
        advantages=batch.advantages,
        completion_ids=batch.completion_ids,
        logps=logps,
        temperature=T,
    )
    grpo_loss(logps, logps.detach(), batch.advantages, batch.completion_mask).backward()


def _probed_steps(sigma_every, steps=4, resume_at=None):
    """GRPO steps with SGD updates between them; returns (records per step, the head's sigma_max at each forward).
    resume_at: a new probe takes over at that step, given the old one's `sigma_state` (as from a checkpoint)."""
    model = tiny_qwen2(sharpen=12.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    results, truth = [], []

    def probe():
        return GradientProbe(
            model, check_tokens=None, direct_tokens=0, temperature=T, auto=True, sink=results.append,
            sigma_every=sigma_every,
        )  # fmt: skip

    parts = [(0, steps)] if resume_at is None else [(0, resume_at), (resume_at, steps)]
    state = generator = None
    for lo, hi in parts:
        with probe() as p:
            if state is not None:  # what a checkpoint carries (trainers/resume.py): the sample generator too
                p.load_sigma_state(state)
                p.generator.set_state(generator)
            for step in range(lo, hi):
                truth.append(float(torch.linalg.matrix_norm(model.lm_head.weight.detach().double(), ord=2)))
                _on_policy_step(model, make_batch(model, seed=30 + step), p, step)
                opt.step()
                opt.zero_grad()
        state, generator = p.sigma_state(), p.generator.get_state()
    return [r["checks"] for r in results], truth


def test_sigma_is_refreshed_every_sigma_every_checks_and_recorded_with_its_step():
    checks, truth = _probed_steps(sigma_every=1)
    assert abs(truth[-1] / truth[0] - 1) > 1e-3  # the updates move sigma_max
    for step, ck in enumerate(checks):
        assert ck["head_sigma_step"] == [step]
        assert abs(ck["head_sigma_max"][0] / truth[step] - 1) < 1e-6
        assert ck["head_violations"] == [0]
    checks, truth = _probed_steps(sigma_every=3, steps=5)
    assert [ck["head_sigma_step"][0] for ck in checks] == [0, 0, 0, 3, 3]
    for step in (0, 3):
        assert abs(checks[step]["head_sigma_max"][0] / truth[step] - 1) < 1e-6
    for step, refresh in ((1, 0), (2, 0), (4, 3)):
        # the refresh's value, raised where the micro-batch's own lower bound of the current sigma_max is larger
        value, stale = checks[step]["head_sigma_max"][0], checks[refresh]["head_sigma_max"][0]
        assert stale * (1 - 1e-6) <= value <= max(stale, truth[step]) * (1 + 1e-12)
        assert checks[step]["head_violations"] == [0]
    assert any(
        abs(checks[s]["head_sigma_max"][0] / truth[s] - 1) > 1e-4 for s in (1, 2, 4)
    )  # stale in between
    # a probe resumed from the state a checkpoint keeps refreshes on the same schedule: the same records
    resumed, _ = _probed_steps(sigma_every=3, steps=5, resume_at=2)
    assert resumed == checks
    with pytest.raises(ValueError, match="sigma_every: must be an integer >= 1"):
        GradientProbe(tiny_qwen2(), sigma_every=0)


# ---- direct gradients under a memory cap ----------------------------------------------------------------------
def test_plan_rows_packs_rows_and_slots_under_the_cap():
    per_row = [3, 0, 1, 2]  # tokens per row; row 1 has none
    assert R.plan_rows(per_row, 10, 5, 8, None) == [([0, 2, 3], 3)]
    assert R.plan_rows([0, 0], 10, 5, 8, None) == []
    assert R.plan_rows(per_row, 10, 5, 8, 1e9) == [([0, 2, 3], 3)]
    assert R.plan_rows(per_row, 10, 5, 2, 60) == [([0, 2, 3], 2)]  # 3 rows x (10 + 2 x 5) = 60
    assert R.plan_rows(per_row, 10, 5, 8, 50) == [
        ([0, 2], 3),
        ([3], 2),
    ]  # 2 x (10 + 15) = 50; then row 3 alone
    assert R.plan_rows(per_row, 10, 5, 8, 22) == [([0], 2), ([2], 1), ([3], 2)]  # row 0 alone: (22-10)//5 = 2
    with pytest.raises(D.DirectMemoryError, match="above the cap"):
        R.plan_rows(per_row, 10, 5, 8, 14)


def test_plan_rows_replays_every_row_at_once_where_dropout_is_active():
    per_row = [3, 0, 1, 2]
    assert R.plan_rows(per_row, 10, 5, 8, None, whole=True) == [([0, 1, 2, 3], 3)]
    assert R.plan_rows(per_row, 10, 5, 8, 4 * 20, whole=True) == [([0, 1, 2, 3], 2)]  # 4 x (10 + 2 x 5) = 80
    with pytest.raises(D.DirectMemoryError, match="replaying 4 row"):
        R.plan_rows(per_row, 10, 5, 8, 59, whole=True)  # 4 x (10 + 5) = 60 > 59
    assert R.active_dropout(
        [R.LayerCall("x", torch.nn.Dropout(0.1).train(), (), {}, (None, None), (False, None))]
    )
    assert not R.active_dropout(
        [R.LayerCall("x", torch.nn.Dropout(0.1).eval(), (), {}, (None, None), (False, None))]
    )


def test_layer_width_reads_the_widest_linear_map():
    assert R.layer_width(tiny_qwen2(hidden=32).model.layers[0], 32) == 64  # intermediate_size = 2 x hidden
    from _models import tiny_gpt2

    assert R.layer_width(tiny_gpt2().transformer.h[0], 32) == 128  # GPT-2's Conv1D c_fc: nf = 4 x n_embd
    assert R.layer_width(torch.nn.LayerNorm(32), 32) == 128  # no linear map: 4 x hidden


def test_a_replay_of_some_rows_equals_single_token_backwards(monkeypatch):
    """4 tokens over 6 rows (some rows without tokens): the replay runs the rows holding tokens, all together and
    then two at a time (groups of rows that are not 0..r-1, their local rows found by searchsorted)."""
    results = {}
    model = tiny_qwen2(sharpen=8.0, layers=3)
    batch = make_batch(model)
    s = batch.input_ids.shape[1]
    row_b, slot_b = R.replay_bytes(s, 32, 64, 4)
    for label, cap in (("uncapped", None), ("two rows", 2 * (row_b + slot_b) / 2**20)):
        shapes = []
        real = R.batched_grads

        def spy(outputs, inputs, seeds, real=real, shapes=shapes):
            out = real(outputs, inputs, seeds)
            shapes.append(tuple(out[-1].shape[:2]))
            return out

        monkeypatch.setattr(R, "batched_grads", spy)
        with GradientProbe(
            model, check_tokens=None, direct_tokens=4, sample_tokens=4, direct_memory_mb=cap, direct_budget=None,
            temperature=T, auto=True,
        ) as probe:  # fmt: skip
            _on_policy_step(model, batch, probe, 0)
            results[label] = (probe.end_step().records["tokens"], shapes)
        monkeypatch.undo()
    tok, shapes = results["uncapped"]
    rows = sorted({r for r, v in zip(tok["row"], tok["direct_norm"], strict=True) if v is not None})
    assert 2 <= len(rows) < 6 and rows != list(range(len(rows)))
    assert {r for _, r in shapes} == {len(rows)}
    two = [r for _, r in results["two rows"][1]]  # two rows of one token each per replay, at most
    assert max(two) <= 2 and len(two) > len(shapes), two
    expected = single_token_direct(tiny_qwen2(sharpen=8.0, layers=3), batch, tok, T)
    for label, (got, _) in results.items():
        pairs = [(g, e) for g, e in zip(got["direct_norm"], expected, strict=True) if g is not None]
        assert len(pairs) == 4 * 4, label
        assert [g for g, _ in pairs] == pytest.approx([e for _, e in pairs], rel=1e-5), label


def _direct_run(monkeypatch, cap, reentrant=False):
    """One probed micro-batch; returns (tokens records, the [slots, rows] shape of every batched gradient)."""
    shapes = []
    real = R.batched_grads

    def spy(outputs, inputs, seeds):
        out = real(outputs, inputs, seeds)
        shapes.append(tuple(out[-1].shape[:2]))
        return out

    monkeypatch.setattr(R, "batched_grads", spy)
    model = tiny_qwen2(sharpen=8.0, layers=3)
    if reentrant:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    batch = make_batch(model)
    with GradientProbe(
        model, check_tokens=None, direct_tokens=24, sample_tokens=24, direct_memory_mb=cap, direct_budget=None,
        temperature=T, auto=True,
    ) as probe:  # fmt: skip
        _on_policy_step(model, batch, probe, 0)
        res = probe.end_step()
    monkeypatch.undo()
    return res.records, shapes, batch


@pytest.mark.parametrize("reentrant", [False, True], ids=["plain", "reentrant"])
def test_a_tiny_direct_memory_cap_replays_row_groups_with_the_uncapped_norms(monkeypatch, reentrant):
    ref, shapes_ref, batch = _direct_run(monkeypatch, None, reentrant)
    b, s = batch.input_ids.shape
    tok = ref["tokens"]
    rows = [r for r, p in zip(tok["row"], tok["point"], strict=True) if p == "final_norm.out"]
    per_row = [rows.count(r) for r in range(b)]
    n_slots = max(per_row)
    assert 2 < n_slots <= 8 and sum(n > 0 for n in per_row) > 2
    # uncapped: every row with tokens at once; per replay (d/dy, d/dx) of the final norm, then layers 2 and 1
    assert shapes_ref == [(n_slots, b)] * 3
    # capped at one row with two slots: one row at a time, two slots per replay
    row_b, slot_b = R.replay_bytes(s, 32, 64, 4)
    capped, shapes, _ = _direct_run(monkeypatch, (row_b + 2.5 * slot_b) / 2**20, reentrant)
    replays = sum(-(-n // 2) for n in per_row if n)
    assert len(shapes) == 3 * replays and all(r == 1 and c <= 2 for c, r in shapes)
    a, c = tok["direct_norm"], capped["tokens"]["direct_norm"]
    assert sum(v is not None for v in a) == 24 * 4 and [v is None for v in a] == [v is None for v in c]
    diff = max(abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a, c, strict=True) if x is not None)
    assert diff <= 1e-6, diff
    if not reentrant:  # both against one plain backward per token
        expected = single_token_direct(tiny_qwen2(sharpen=8.0, layers=3), batch, tok, T)
        assert [v for v in c if v is not None] == pytest.approx(
            [v for v in expected if v is not None], rel=1e-5
        )


def test_a_direct_memory_cap_below_one_slot_skips_with_a_warning_naming_it(monkeypatch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec, _, _ = _direct_run(monkeypatch, 1e-4)
    assert any("direct_memory_mb=0.0001" in str(w.message) for w in caught)
    assert rec["bound"]["direct_n"] == [0, 0, 0, 0] and all(v is None for v in rec["tokens"]["direct_norm"])
    assert rec["checks"]["head_violations"] == [0]  # the rest of the step is recorded
    for bad in (0, -1.0, "512", True):
        with pytest.raises(ValueError, match="direct_memory_mb: must be None"):
            GradientProbe(tiny_qwen2(), direct_memory_mb=bad)


# ---- a vocabulary-sharded head (FSDP2), two processes -----------------------------------------------------------
def sharded_worker(out_dir: str) -> None:
    """torchrun worker (2 ranks, gloo): the head checks and sigma_max on a head sharded by FSDP2 against the whole
    head, then one probed step of a model whose LM head is sharded on its own (so it is a DTensor shard when the
    probe reads it) writing records for the parent to compare with one process."""
    import torch.distributed as dist
    from test_probe_distributed import dp_step
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tokendyn.probe import parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    head = nn.Linear(16, 61)
    full_w, full_b = head.weight.detach().clone(), head.bias.detach().clone()
    fully_shard(head, mesh=mesh)
    shard = parallel.head_shard(head)
    assert shard.group is not None and (shard.weight.shape[0], shard.offset) == ((31, 0), (30, 31))[rank]
    h, _, _, targets = _head(hidden=16, k=5 + 3 * rank, seed=10 + rank)  # a different sample size per rank
    q, lower = parallel.head_sample_quantities(h, shard, targets, T)
    u, ratio, omp, _ = _whole_head(h, full_w, full_b, targets, T)
    errs = [_rel(q.direction, u), _rel(q.logits_ratio, ratio), _rel(q.one_minus_pi, omp)]
    assert max(errs) < 1e-12, errs
    sigma, _, _ = sigma_max_power(shard, reduce=parallel.all_reduce_in(shard.group))
    true = float(torch.linalg.matrix_norm(full_w.double(), ord=2))
    assert abs(sigma / true - 1) < 1e-6 and lower <= true * (1 + 1e-12), (sigma, true, lower)

    model = tiny_qwen2(sharpen=30.0)
    batch = make_batch(model, n=8)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model.lm_head, mesh=mesh)  # resharded after its forward: the probe sees this rank's rows only
    fully_shard(model, mesh=mesh)
    groups = []
    real = parallel.head_shard
    parallel.head_shard = lambda m: groups.append(real(m)) or groups[-1]
    dp_step(model, batch, slice(4 * rank, 4 * rank + 4), 2, Path(out_dir) / "sharded_head")
    parallel.head_shard = real
    assert groups and all(s.group is not None and s.weight.shape[0] < 61 for s in groups)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow_tier  # the slow tier: `make test-slow` (several processes)
def test_a_sharded_lm_head_gives_the_one_process_records(tmp_path):
    import os
    import subprocess
    import sys

    import polars as pl
    from test_probe_distributed import _max_rel, dp_step
    from test_records import BIN_COLS, BOUND_COLS, CHECK_COLS, assert_frames_close

    from tokendyn.analysis import analyze_run
    from tokendyn.records import shard_files

    out = tmp_path / "two"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        *"-m torch.distributed.run --standalone --nproc_per_node 2".split(),
        __file__,
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    teardown_abort = (
        "terminate called without an active exception" in proc.stderr
    )  # see test_probe_distributed
    done = all((out / f".done-rank{r}").is_file() for r in range(2))
    assert proc.returncode == 0 or (teardown_abort and done), proc.stdout[-3000:] + proc.stderr[-3000:]

    model = tiny_qwen2(sharpen=30.0)
    batch = make_batch(model, n=8)
    dp_step(model, batch, slice(0, 8), 1, tmp_path / "one")
    one, two = analyze_run(tmp_path / "one", write=False), analyze_run(out / "sharded_head", write=False)
    assert_frames_close(one["bins"], two["bins"], ["stage", "point", "bin"], BIN_COLS)
    direct = ["direct_n", "C_direct", "D_direct", "unreached"]
    assert_frames_close(one["bound"], two["bound"], ["stage", "point"], [*BOUND_COLS, *direct])
    assert_frames_close(one["checks"], two["checks"], ["stage"], CHECK_COLS)
    assert (
        two["checks"]["identity_max_scaled_err"].item() < 1e-5
        and two["checks"]["head_violations"].item() == 0
    )
    tok_one = pl.read_parquet(shard_files(tmp_path / "one", "tokens"))
    tok = pl.read_parquet(shard_files(out / "sharded_head", "tokens")).with_columns(
        row=pl.col("row") + 4 * pl.col("rank")
    )
    joined = tok_one.join(tok, on=["row", "pos", "point"], how="full", suffix="_dp")
    assert joined.height == tok_one.height == tok.height and tok["direct_norm"].null_count() == 0
    for c in ("direct_norm", "direct_ratio", "logits_ratio", "ratio", "w", "norm"):
        assert _max_rel(joined[f"{c}_dp"], joined[c]) < 1e-5, c
    assert joined["identity_rel_err_dp"].max() < 1e-4  # float32 rounding of the measured gradient, not equal


HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, str(HERE))
    sharded_worker(sys.argv[1])
    done = Path(sys.argv[-1])
    done.mkdir(parents=True, exist_ok=True)
    (done / f".done-rank{os.environ.get('RANK', '0')}").write_text("ok")
