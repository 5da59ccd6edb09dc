"""The lr -> 0 limit of the counterfactual SGD step (`tokendyn.effects.limit`): d pi_t / d lr at lr = 0
from one JVP, against the finite step it is the limit of.

The reference is independent of the JVP: the exact counterfactual SGD step (`counterfactual_change`, a real
parameter update and a re-forward) on a float64 copy of the model, every op float64 (`exact_float64`), at small lr.
If the derivative is right, lr x derivative - finite step is the second-order term: it is small and shrinks like lr
(tenfold per decade), which a derivative off by any factor or term cannot do. On the configuration matrix's
architectures (tests/_matrix.py), the float64 models and the float32 ones (the derivative then in float32 with a
float64 log-softmax)."""

from __future__ import annotations

import copy
import warnings

import matplotlib

matplotlib.use("Agg")

import polars as pl  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from _matrix import ARCHS, T, build, sample_batch  # noqa: E402
from test_resolution import _greedy_batch, _one_minus_pi64  # noqa: E402

from tokendyn.effects.change import correct_ratios, counterfactual_change  # noqa: E402
from tokendyn.effects.influence import lopti_stage_masks  # noqa: E402
from tokendyn.effects.limit import limit_change  # noqa: E402
from tokendyn.effects.rebalance import RebalanceOptions, analyze_batch  # noqa: E402
from tokendyn.figures.data import MissingRecords  # noqa: E402
from tokendyn.figures.sweep import limit_table, limit_vs_step, sweep_table  # noqa: E402
from tokendyn.probe.float64 import exact_float64  # noqa: E402
from tokendyn.probe.tokenloss import ProbeBatch  # noqa: E402
from tokendyn.records import scan_records, write_frames  # noqa: E402

torch.set_num_threads(1)
SMALL = 1e-7  # small enough that the second-order term is < 1e-3 of the step on every architecture here
TOL = 1e-2  # the bound asked of the limit: lr x derivative within 1e-2 of max |delta pi| of the exact step


def _case(arch: str):
    """The matrix's float32 model of ``arch`` (its head scaled to a mean entropy of 1 nat), a float64 copy, and a
    batch of its own samples with pi_old one update behind and advantages of both signs."""
    model = build(arch).eval()
    s = sample_batch(model)
    batch = ProbeBatch(s.input_ids, torch.ones_like(s.input_ids), s.completion_mask, s.advantages.double(),
                       old_logp=s.old_logp.double(), temperature=T)  # fmt: skip
    return model, copy.deepcopy(model).double(), batch


def _step64(model64, batch: ProbeBatch, lr: float, stages=None) -> torch.Tensor:
    """The exact counterfactual SGD step on the float64 model, float64 at every op: delta pi of the last stage
    group (the full update)."""
    with exact_float64():
        res = counterfactual_change(model64, batch, stages, lr=lr, precision="model")
    return res.delta["lopti" if stages else "train"]


def _err(rate: torch.Tensor, lr: float, step: torch.Tensor) -> float:
    return float((rate * lr - step).abs().max() / step.abs().max())


def _signs_agree(rate: torch.Tensor, step: torch.Tensor, mask: torch.Tensor, noise: float) -> tuple[int, int]:
    """(tokens whose exact change is above ``noise`` x max |delta pi|, how many of them have the derivative's sign)."""
    clear = mask & (step.abs() > noise * step.abs().max())
    return int(clear.sum()), int((clear & (torch.sign(rate) == torch.sign(step))).sum())


@pytest.mark.parametrize("arch", ARCHS)
def test_the_limit_is_the_float64_step_as_lr_goes_to_0(arch):
    _, model64, batch = _case(arch)
    with exact_float64():
        lim = limit_change(model64, batch)
    step = _step64(model64, batch, SMALL)
    assert _err(lim.rate, SMALL, step) <= TOL
    clear, agree = _signs_agree(lim.rate, step, batch.completion_mask, 1e-3)
    assert clear >= 15 and agree == clear, (clear, agree)
    # first order exactly: the remainder is the second-order term, ten times smaller per decade of lr
    ratio = _err(lim.rate, 1e-5, _step64(model64, batch, 1e-5)) / _err(
        lim.rate, 1e-6, _step64(model64, batch, 1e-6)
    )
    assert 7.0 < ratio < 14.0, ratio
    assert lim.signal and lim.direction_norm > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_the_float32_limit_matches_the_float64_step(arch):
    """In the model's own dtype (float32 weights, gradient and JVP; the log-softmax's tangent in float64)."""
    model, model64, batch = _case(arch)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lim = limit_change(model, batch)
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())  # untouched
    step = _step64(model64, batch, SMALL)
    assert _err(lim.rate, SMALL, step) <= TOL
    clear, agree = _signs_agree(lim.rate, step, batch.completion_mask, 1e-3)
    assert clear >= 15 and agree == clear, (clear, agree)
    assert correct_ratios(lim.rate, batch.advantages, batch.completion_mask) == correct_ratios(
        step, batch.advantages, batch.completion_mask
    )


def test_a_finite_step_at_a_large_lr_is_not_the_limit():
    """What the comparison can tell apart: at lr 1e-2 the qwen2 model's finite step is far from lr x derivative,
    a token moves the other way, and the correct ratio differs."""
    _, model64, batch = _case("qwen2")
    with exact_float64():
        lim = limit_change(model64, batch)
    step = _step64(model64, batch, 1e-2)
    mask = batch.completion_mask
    assert _err(lim.rate, 1e-2, step) > 1.0
    assert int(((torch.sign(lim.rate) != torch.sign(step)) & mask).sum()) >= 1
    assert (
        correct_ratios(lim.rate, batch.advantages, mask)["correct_pooled"]
        != correct_ratios(step, batch.advantages, mask)["correct_pooled"]
    )


def test_the_limit_of_lopti_two_stages_is_their_summed_gradient():
    """Lopti's two stages in order (pi_old fixed): as lr -> 0 the second stage's gradient is taken at theta_0, so
    the limit is along -(grad L_low + grad L_high)."""
    model, model64, batch = _case("llama")
    low, high = lopti_stage_masks(batch, eta=0.5)
    assert bool(low.any()) and bool(high.any())
    stages = [("low", low), ("high", high)]
    lim = limit_change(model, batch, stages)
    step = _step64(model64, batch, SMALL, stages)
    assert _err(lim.rate, SMALL, step) <= TOL
    one = limit_change(model, batch, stages[:1])  # the low stage alone is another direction
    assert _err(one.rate, SMALL, step) > 0.1


def test_the_limits_sign_holds_for_near_certain_tokens():
    """Greedy tokens with 1 - pi ~ 1e-7 (float64 reference): the float32 model's derivative has the exact float64
    step's sign on every one that moves above noise (its log-softmax tangent formed in float64)."""
    from _rebalance import tiny_model

    model = tiny_model(sharpen=20.0).eval()
    batch = _greedy_batch(model)
    adv = torch.linspace(-1.5, 1.5, batch.advantages.shape[0], dtype=torch.float64)
    batch = ProbeBatch(batch.input_ids, batch.attention_mask, batch.completion_mask, adv,
                       temperature=batch.temperature)  # fmt: skip
    near = batch.completion_mask & (_one_minus_pi64(model, batch) < 1e-5)
    assert int(near.sum()) >= 10, "the setup must hold near-certain tokens"
    lim = limit_change(model, batch)
    step = _step64(copy.deepcopy(model).double(), lim_batch(model, batch), 1e-6)
    clear, agree = _signs_agree(lim.rate, step, near, 1e-9)
    assert clear >= 10 and agree == clear, (clear, agree)


def lim_batch(model, batch: ProbeBatch) -> ProbeBatch:
    """The batch with pi_old fixed at the float32 model's pi (as `limit_change` fixes an on-policy batch), so that
    the float64 step starts from the same ratio."""
    from tokendyn.effects.change import fix_pi_old

    return fix_pi_old(model, batch)[0]


# ---- the records and the figure -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sweep_frames():
    _, model64, batch = _case("qwen2")
    with exact_float64(), warnings.catch_warnings():
        warnings.simplefilter("error")  # every step an update and resolved: no warning
        frames = analyze_batch(model64, batch, step=2, options=RebalanceOptions(lr_sweep=(SMALL, 1e-2),
                               token_shares=0, view_sequences=0))  # fmt: skip
    return frames


def test_the_limit_is_the_sweeps_first_point_per_unit_lr(sweep_frames):
    pc = sweep_frames["prob_change"]
    sweep = pc.filter(pl.col("update") == "sweep").sort("lr", "bin")
    assert sweep["lr"].unique().sort().to_list() == [0.0, SMALL, 1e-2]
    limit = sweep.filter(pl.col("lr") == 0)
    assert limit["limit"].all() and limit["param_step"].to_list() == [0.0] * limit.height
    assert limit["step_norm"].null_count() == limit.height and not limit["no_update"].any()
    assert not pc.filter(pl.col("lr") > 0)["limit"].any()
    small = sweep.filter(pl.col("lr") == SMALL)
    for a, b in zip(limit.iter_rows(named=True), small.iter_rows(named=True), strict=True):
        assert a["bin"] == b["bin"] and a["count"] == b["count"]
        if a["count"]:
            assert a["mean_abs"] == pytest.approx(b["mean_abs"] / SMALL, rel=1e-3)
            for c in ("correct_pos", "correct_neg", "tie_pos", "tie_neg"):
                assert a[c] == b[c] or (a[c] != a[c] and b[c] != b[c]), c


def test_the_figure_draws_the_limit_then_the_steps(sweep_frames):
    pc = sweep_frames["prob_change"].with_columns(pl.lit("GRPO").alias("run"))
    table = limit_table(pc).filter(pl.col("bin") >= 0)
    fig = limit_vs_step(pc)
    try:
        top = fig.axes[0]
        assert [t.get_text() for t in top.get_xticklabels()] == ["0\n(limit)", f"{SMALL:g}", "0.01"]
        x, y = top.lines[0].get_data()  # the first bin's correct ratio (A > 0) at the limit and each step
        want = table.filter(pl.col("bin") == 0).sort("lr")["correct_pos"].to_list()
        assert list(x) == [0, 1, 2] and list(y) == pytest.approx(want, nan_ok=True)
        bottom = fig.axes[len(fig.axes) // 2]
        per_lr = bottom.lines[0].get_ydata()
        assert per_lr[0] == pytest.approx(per_lr[1], rel=1e-2)  # the limit is the tiny step's mean |dpi| / lr
        assert abs(per_lr[2] / per_lr[0] - 1) > 0.05  # and the large step's is not
    finally:
        matplotlib.pyplot.close(fig)


def test_records_without_the_limit_still_read(sweep_frames, tmp_path):
    """A run written before the limit (and no_update) were recorded: its prob_change reads with those columns null,
    the step-size figure's table works, and the limit figure says what is missing instead of failing."""
    old = sweep_frames["prob_change"].filter(pl.col("lr") != 0).drop("limit", "no_update")
    (tmp_path / "records").mkdir()
    old.write_parquet(tmp_path / "records" / "prob_change-rank000-000000.parquet")
    back = scan_records(tmp_path, "prob_change").collect()
    assert back["limit"].null_count() == back.height and back["no_update"].null_count() == back.height
    back = back.with_columns(pl.lit("old").alias("run"))
    assert sorted(sweep_table(back)["lr"].unique().to_list()) == [SMALL, 1e-2]
    with pytest.raises(MissingRecords, match="no lr → 0 limit rows"):
        limit_table(back)
    write_frames(tmp_path / "new", sweep_frames)  # today's frames round-trip with their schema
    assert scan_records(tmp_path / "new", "prob_change").collect().equals(sweep_frames["prob_change"])
