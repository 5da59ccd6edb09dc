"""One counterfactual step, made once: the lr sweep's point at the analyses' own lr is the counterfactual update
already made (by `counterfactual_change`, or as the influence run's all-token sources), not a second step.

Checked against the separate computation: `analyze_batch` with the reuse (the default) and without it (``_reuse``
False: the sweep point made again by `counterfactual_change`) give the same `prob_change` and `influence` records,
bitwise; and the influence run's record of its all-token update (`InfluenceResult.change`) equals a direct
`counterfactual_change` call from the same state, field by field, bitwise. On three architectures of the matrix, with
and without Lopti's stages, at float64 and at the model's precision.
"""

from __future__ import annotations

import warnings

import polars as pl
import pytest
import torch
from _matrix import T, build, sample_batch
from polars.testing import assert_frame_equal

import tokendyn.effects.rebalance as rebalance
from tokendyn.effects.change import counterfactual_change, fix_pi_old
from tokendyn.effects.influence import influence, influence_and_shares, lopti_stage_masks
from tokendyn.effects.rebalance import RebalanceOptions, analyze_batch
from tokendyn.probe.tokenloss import ProbeBatch
from tokendyn.vocab import HIGH, LOPTI, LOW, TRAIN

torch.set_num_threads(1)
ARCHS = ("qwen2", "gpt2", "llama")
PRECISIONS = ("float64", "model")
LR = 1e-3
SWEEP = (LR, 0.1)
EDGES = (0.0, 0.25, 0.5, 0.75, 1.0)


def _case(arch: str):
    """The matrix's float32 model of ``arch`` and a batch of its own samples (pi_old one update behind, advantages
    of both signs), with the Lopti stage masks of the batch (eta 0.5)."""
    model = build(arch).eval()
    s = sample_batch(model)
    batch = ProbeBatch(s.input_ids, torch.ones_like(s.input_ids), s.completion_mask, s.advantages.double(),
                       old_logp=s.old_logp.double(), temperature=T)  # fmt: skip
    return model, batch, lopti_stage_masks(batch, eta=0.5)


@pytest.fixture(scope="module", params=ARCHS)
def case(request):
    return _case(request.param)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _analyze(model, batch, masks, precision: str, influence_on: bool, shares_on: bool, reuse: bool):
    opts = RebalanceOptions(shares=shares_on, token_shares=4 if shares_on else 0, influence=influence_on,
                            lr=LR, lr_sweep=SWEEP, step_precision=precision, view_sequences=0)  # fmt: skip
    calls = []
    real = rebalance.counterfactual_change

    def counted(*args, **kw):  # the real function, its calls counted
        calls.append(kw["lr"])
        return real(*args, **kw)

    rebalance.counterfactual_change = counted
    try:
        with warnings.catch_warnings():
            # (a model-precision step may be unresolved: the same flag both ways)
            warnings.simplefilter("ignore")
            frames = analyze_batch(model, batch, step=3, edges=EDGES, options=opts, stage_masks=masks,
                                   _reuse=reuse)  # fmt: skip
    finally:
        rebalance.counterfactual_change = real
    return frames, calls


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("lopti", [False, True], ids=["train", "lopti"])
@pytest.mark.parametrize(
    "influence_on,shares_on",
    [(True, True), (True, False), (False, True)],
    ids=["influence+shares", "influence", "no-influence"],
)
def test_records_equal_with_and_without_the_reuse(case, precision, lopti, influence_on, shares_on):
    model, batch, masks = case
    stage_masks = masks if lopti else None
    before = _params(model)
    got, calls = _analyze(model, batch, stage_masks, precision, influence_on, shares_on, reuse=True)
    want, calls_apart = _analyze(model, batch, stage_masks, precision, influence_on, shares_on, reuse=False)
    # the step at LR is made once: only the other sweep point calls counterfactual_change again
    main = [] if influence_on else [LR]
    assert calls == [*main, 0.1] and calls_apart == [*main, *SWEEP]
    assert set(got) == set(want)
    for name in ("prob_change", "influence", "shares", "token_shares", "notes"):
        if name in want:
            assert_frame_equal(got[name], want[name], check_exact=True)
    pc = got["prob_change"]
    sweep = pc.filter((pl.col("update") == "sweep") & (pl.col("lr") == LR))
    assert sweep.height == len(EDGES) and sweep["param_step"].drop_nulls().len() == sweep.height
    # the reused point is the counterfactual update's own rows (the full update: train, or lopti); bitwise but for
    # lopti read off the influence run, whose counterfactual row sums the stages' deltas, (pi_1 - pi_0) + (pi_2 -
    # pi_1), where the sweep (with or without the reuse) takes pi_2 - pi_0: equal to float64 rounding
    full = pc.filter(
        (pl.col("update") == "counterfactual") & (pl.col("update_stage") == (LOPTI if lopti else TRAIN))
    )
    stats = ["count", "mean", "std", "mean_abs", "min", "max", "n_pos", "tie_pos", "correct_pos"]
    exact = not (lopti and influence_on)
    assert_frame_equal(
        sweep.select(stats), full.select(stats), check_exact=exact, rel_tol=1e-9, abs_tol=1e-15
    )
    for p, (n, q) in zip(before.values(), model.named_parameters(), strict=True):
        assert torch.equal(p, q), n  # the model left bitwise as it was


def _equal_change(got, want, names) -> None:
    assert torch.equal(got.pi_before, want.pi_before)
    assert set(got.delta) == set(want.delta) == set(names)
    for name in names:
        assert torch.equal(got.delta[name], want.delta[name]), name
        assert got.param_step[name] == want.param_step[name], name
        assert got.resolution[name] == want.resolution[name], name
        if name != LOPTI:
            assert torch.equal(got.pi_after[name], want.pi_after[name]), name


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("lopti", [False, True], ids=["train", "lopti"])
def test_influence_all_token_update_is_counterfactual_change(case, precision, lopti):
    """The all-token sources' update (`InfluenceResult.change`) against `counterfactual_change` called directly on
    the same model and batch: the same update from the same state, the same lr and precision, bitwise."""
    model, batch, masks = case
    batch, pi0 = fix_pi_old(model, batch, precision=precision)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if lopti:
            stages = [(LOW, masks[0]), (HIGH, masks[1])]
            inf = influence(model, batch, EDGES, stage_masks=masks, lr=LR, pi_before=pi0, precision=precision)
            names = (LOW, HIGH, LOPTI)
        else:
            stages = None
            inf = influence(model, batch, EDGES, lr=LR, pi_before=pi0, precision=precision)
            names = (TRAIN,)
        direct = counterfactual_change(model, batch, stages, lr=LR, pi_before=pi0, precision=precision)
        _equal_change(inf.change, direct, names)
        if not lopti:
            both, _ = influence_and_shares(model, batch, EDGES, lr=LR, pi_before=pi0, precision=precision)
            _equal_change(both.change, direct, names)
    # and the influence record's all-token rows are that delta pi (the rows prob_change is read off)
    for name in names:
        if name != LOPTI:
            assert torch.equal(inf.deltas[(name, -1)], direct.delta[name])
