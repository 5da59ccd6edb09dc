"""The configuration matrix (`_matrix.py`): every architecture x dtype pair, each value of adapter, accumulation and
analyses on every architecture and every dtype, each cell against float64 autograd on the same model and batch.

A cell passes when every recorded number is within the tolerance of the arithmetic that ran and the probe's checks
report no violation, or when it is a listed refusal whose note the probe recorded. Beside it: the checks still catch
a gradient wrong by 1 % in bfloat16, and the direct gradients resolve near-certain tokens in float32."""

from __future__ import annotations

import pytest
import torch
from _matrix import (
    ARCHS,
    DTYPES,
    Cell,
    autocast,
    build,
    cells,
    run_cell,
    sample_batch,
    surrogate,
    token_logps,
)

from tokendyn import instrument, load_run

torch.set_num_threads(1)


@pytest.mark.parametrize("cell", cells(), ids=lambda c: c.id)
def test_cell(cell: Cell, tmp_path):
    result = run_cell(cell, tmp_path)
    print(cell.id, {k: f"{v:.2g}" for k, v in result.errors.items()}, result.refusal or "")
    assert result.ok, f"{cell.id}: {'; '.join(result.problems)}"


def test_the_matrix_covers_every_value_and_pair():
    cs = cells()
    assert {(c.arch, c.dtype) for c in cs} == {(a, d) for a in ARCHS for d in DTYPES}
    for axis in ("adapter", "micro", "analyses"):
        for other in ("arch", "dtype"):
            values = {}
            for c in cs:
                values.setdefault(getattr(c, other), set()).add(getattr(c, axis))
            assert all(len(v) == 2 for v in values.values()), (axis, other)


class _ScaleOneRow(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient of one position by `factor` (a wrong LM head)."""

    @staticmethod
    def forward(ctx, x, row, pos, factor):
        ctx.at, ctx.factor = (row, pos), factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad[ctx.at] *= ctx.factor
        return grad, None, None, None


def _identity_violations(dtype: str, factor: float, tmp_path) -> tuple[int, float]:
    cell = Cell("qwen2", dtype, "full", "one", "probe")
    model = build("qwen2")
    batch = sample_batch(model)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    row, pos = 0, 5 - 1 + 2  # the position predicting completion token 2 of row 0
    hook = model.lm_head.register_forward_pre_hook(
        lambda m, args: (_ScaleOneRow.apply(args[0], row, pos, factor),)
    )
    try:
        with instrument(
            model, tmp_path, rank=0, temperature=0.7, check_tokens=None, direct_tokens=0
        ) as probe:
            with autocast(cell):
                logp = token_logps(model, batch.input_ids)
            probe.begin_step(step=0, completion_mask=batch.completion_mask, advantages=batch.advantages,
                             old_logp=batch.old_logp, completion_ids=batch.completion_ids, logps=logp,
                             temperature=0.7)  # fmt: skip
            surrogate(logp, batch, int(batch.completion_mask.sum())).backward()
    finally:
        hook.remove()
    checks = load_run(tmp_path)["checks"].collect()
    return int(checks["identity_violations"].sum()), float(checks["tolerance_rel"].max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_gradient_wrong_by_one_percent_is_reported(dtype, tmp_path):
    """The head's own rounding is in the prediction, so the 16-bit tolerance is eps (2^-7), not the 2 % by which
    the forward's rounded logits move pi: one token's gradient scaled by 1.01 is a violation in every dtype, the
    same run unscaled has none."""
    assert _identity_violations(dtype, 1.0, tmp_path / "right")[0] == 0
    violations, tol_rel = _identity_violations(dtype, 1.01, tmp_path / "wrong")
    assert violations == 1 and tol_rel < 0.01


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma", "phi"])
def test_near_certain_tokens_are_resolved(arch, tmp_path):
    """A head sharp enough that sampled tokens reach 1 - pi ~ 1e-6 (float32 holds 1 - pi to ~1e-7 absolute): the
    direct gradients, seeded by the float64 head quantities, still match float64 autograd to float32 rounding (of
    the forward's hidden state, magnified by the logits' size: `_matrix.conditioning`)."""
    import _matrix

    old = _matrix.ENTROPY
    _matrix.ENTROPY = 0.02
    try:
        result = run_cell(Cell(arch, "float32", "full", "one", "probe"), tmp_path)
    finally:
        _matrix.ENTROPY = old
    assert result.ok, result.problems
    assert result.near_certain >= 3, "the head is not sharp enough to test near-certain tokens"
    assert result.errors["direct"] < 1e-4  # the total gradient of these tokens is off by up to eps / (1 - pi)


@pytest.mark.parametrize("arch", ["gpt2", "opt_pre_project_out", "opt_post", "qwen2"])
def test_direct_gradients_of_a_token_sample_replayed_in_row_groups(arch, tmp_path):
    """Three tokens of four rows, under a memory cap that replays one row at a time: the replay runs the layers on a
    subset of the rows (before, GPT-2's cache, passed positionally, kept the forward's keys and rows) and still
    equals float64 autograd."""
    result = run_cell(
        Cell(arch, "float32", "full", "one", "probe"), tmp_path, direct_tokens=3, direct_memory_mb=0.06
    )
    assert result.ok, result.problems
    assert result.direct_tokens == 3 and result.errors["direct"] < 64 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("arch", ARCHS)
def test_a_budgeted_replay_takes_a_prefix_and_keeps_it_exact(arch, tmp_path):
    """The default direct budget (one replay: the prefix of the sampled tokens one training step's flops afford,
    `tokendyn.probe.budget.direct_tokens_within`) on every architecture: at least one token, at most the 16 asked,
    each equal to float64 autograd as the unbudgeted replay is."""
    result = run_cell(
        Cell(arch, "float32", "full", "one", "probe"), tmp_path, direct_tokens=16, direct_budget=0.02
    )
    assert result.ok, result.problems
    assert 1 <= result.direct_tokens < 16 and result.errors["direct"] < 1e-4  # (it binds here: 3 of 16)
