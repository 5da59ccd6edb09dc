"""No noise reported as data: a counterfactual step without a policy-gradient signal is "no update"
(null rows, counted, no warning), a genuinely unresolved update keeps its warning with the remedy that fits it, and
the analysis sample of the offline probe and of verl's probe is drawn from the sequences with a signal, as the
trainer's is.

The references are independent of the criterion under test: the advantages and the clip are set by hand, the loss's
gradient is checked zero by plain autograd, the sample's rows are built into a batch by hand."""

from __future__ import annotations

import warnings
from dataclasses import replace

import polars as pl
import pytest
import torch
from _rebalance import tiny_batch, tiny_model

from tokendyn.effects.change import change_frame, counterfactual_change, fix_pi_old
from tokendyn.effects.compare import compare_rules, make_rule, paired_frame
from tokendyn.effects.influence import influence
from tokendyn.effects.rebalance import RebalanceOptions, analyze_batch
from tokendyn.effects.resolution import policy_signal
from tokendyn.effects.shares import as_edges
from tokendyn.figures.readings import resolution_note
from tokendyn.probe.tokenloss import Objective, ProbeBatch, bin_index, completion_logp, token_loss

torch.set_num_threads(1)
MEASURED = ("count", "mean", "mean_abs", "q50", "n_pos", "tie_pos", "correct_pos", "correct_pooled")


@pytest.fixture(scope="module")
def model():
    return tiny_model(attn="eager")


@pytest.fixture(scope="module")
def batch(model):
    """Six sampled sequences, pi_old fixed at the model's float64 pi, per-token advantages (each row's own)."""
    b = tiny_batch(model)
    b, _ = fix_pi_old(model, b, precision="float64")
    return replace(b, advantages=b.advantages.clone())


def _bins(batch: ProbeBatch) -> torch.Tensor:
    return bin_index(torch.exp(batch.old_logp.double()), batch.completion_mask, as_edges(None))


def _null(frame: pl.DataFrame) -> bool:
    return all(frame[c].null_count() == frame.height for c in MEASURED)


def test_a_bin_whose_tokens_have_no_advantage_is_no_update(model, batch):
    """The demo's case: the tokens of the top bin have A = 0, and the loss has a KL term to a pi_ref computed in
    float32 (as the trainer's reference forward): that source's step is only the KL gradient of the float32 /
    float64 mismatch, ||dtheta|| ~ 1e-13. It is no update (null rows, no_update, counted in a notes record), with no
    warning; the other sources are measured as before."""
    bins = _bins(batch)
    top = int(bins.max())
    adv = torch.where(bins == top, torch.zeros_like(batch.advantages), batch.advantages)
    with torch.no_grad():
        ref = completion_logp(model, batch).float().double()  # pi_ref in float32
    b = replace(batch, advantages=adv, ref_logp=ref)
    objective = Objective(beta=0.04)
    assert not bool(((adv != 0) & (bins == top) & b.completion_mask).any())  # premise
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = influence(model, b, objective=objective)
        frames = analyze_batch(model, b, step=7, objective=objective,
                               options=RebalanceOptions(token_shares=0, view_sequences=0))  # fmt: skip
    res = got.resolution[("train", top)]
    assert res.no_update and 0 < res.step_norm < 1e-9  # a step was made, but of the KL term alone
    assert bool(torch.isnan(got.matrix()[top + 1]).all()) and not bool(torch.isnan(got.matrix()[0]).any())
    inf = frames["influence"]
    none = inf.filter(pl.col("source_bin") == top)
    assert none["no_update"].all() and _null(none)
    assert (
        none["step_rounding"].null_count() == none.height
        and none["step_resolved"].null_count() == none.height
    )
    rest = inf.filter(pl.col("source_bin") != top)
    assert not rest["no_update"].any() and rest["mean_abs"].null_count() == 0 and rest["step_resolved"].all()
    assert frames["notes"]["code"].to_list() == ["no_update_step_7"]
    assert (
        frames["notes"]["message"]
        .item()
        .startswith(
            f"step 7: 1 of {inf['source_bin'].n_unique()} counterfactual updates carried no policy-gradient signal"
        )
    )
    assert f"influence train source {top}" in frames["notes"]["message"].item()
    n = inf["source_bin"].n_unique()  # the report's reading says so too
    assert f" 1 of {n} counterfactual updates carried no policy-gradient signal" in resolution_note(inf)


def test_one_token_with_an_advantage_is_an_update(model, batch):
    """The criterion is not a threshold on size: a bin where a single token keeps A != 0 is an update."""
    bins = _bins(batch)
    top = int(bins.max())
    keep = ((bins == top) & batch.completion_mask).nonzero()[0]
    adv = torch.where(bins == top, torch.zeros_like(batch.advantages), batch.advantages)
    adv[keep[0], keep[1]] = 0.5
    got = influence(model, replace(batch, advantages=adv))
    assert not got.resolution[("train", top)].no_update
    assert not bool(torch.isnan(got.matrix()[top + 1]).all())


def test_a_batch_without_advantage_makes_a_zero_step_that_is_no_update(model, batch):
    """beta 0, every A = 0: the step is exactly zero (the old records read every token a tie); now null, and not
    warned about even in the model's float32 (where a zero step is not a question of resolution)."""
    flat = replace(batch, advantages=torch.zeros_like(batch.advantages))
    for precision in ("float64", "model"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            res = counterfactual_change(model, flat, precision=precision)
        r = res.resolution["train"]
        assert r.no_update and r.step_norm == 0.0
        bins = _bins(flat)
        frame = change_frame(res.delta["train"], flat, bins, as_edges(None), step=0, resolution=r)
        assert frame["no_update"].all() and _null(frame)


def _clipped(model, batch: ProbeBatch) -> ProbeBatch:
    """Every A > 0 and pi_old = pi / e, so that every token's ratio r = e is above the clip (1.2), where the clipped
    term -clip(r) A is a constant: the PPO loss has zero gradient though every A != 0."""
    with torch.no_grad():
        lp = completion_logp(model, batch).double()
    adv = torch.where(batch.advantages == 0, torch.ones_like(batch.advantages), batch.advantages.abs())
    return replace(batch, advantages=adv, old_logp=(lp - 1.0) * batch.completion_mask)


def test_a_source_whose_every_token_is_clipped_is_no_update(model, batch):
    objective = Objective(eps_low=0.2, eps_high=0.2)
    b = _clipped(model, batch)
    tl = token_loss(model, b, objective)
    grads = torch.autograd.grad(tl.loss, [p for p in model.parameters()], allow_unused=True)
    assert all(
        g is None or float(g.abs().max()) == 0.0 for g in grads
    )  # premise: plain autograd, zero gradient
    assert bool((b.advantages != 0)[b.completion_mask].all())  # though every token has an advantage
    assert not policy_signal(tl.logp, b, None, objective)
    assert policy_signal(tl.logp, b, None, Objective())  # the unclipped surrogate on the same batch has one
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = influence(model, b, objective=objective, precision="model")
    assert got.resolution and all(r.no_update for r in got.resolution.values())
    assert _null(got.to_frame(step=0))


@pytest.mark.parametrize(
    "precision, lr, remedy",
    [
        (
            "model",
            1e-7,
            "float64 steps (--probe_step_precision float64) or a larger step (--probe_lr) resolve it",
        ),
        ("float64", 1e-15, "a larger step (--probe_lr) resolves it"),
    ],
)
def test_an_unresolved_update_keeps_its_warning_with_the_remedy_that_fits(
    model, batch, precision, lr, remedy
):
    """A real signal in a step too small for the dtype: warned about, with what can fix it in that dtype (float32:
    float64 steps or a larger lr; float64: only a larger lr), and measured (no_update false)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = counterfactual_change(model, batch, lr=lr, precision=precision)
    r = res.resolution["train"]
    assert not r.no_update and not r.resolved and r.step_norm > 0
    said = [str(w.message) for w in caught if "is not resolved" in str(w.message)]
    assert len(said) == 1 and said[0].endswith(remedy), said
    frame = change_frame(res.delta["train"], batch, _bins(batch), as_edges(None), step=0, resolution=r)
    assert (
        not frame["no_update"].any() and frame["count"].null_count() == 0 and not frame["step_resolved"].any()
    )


def test_compared_rules_without_a_signal_have_null_paired_rows(model, batch):
    flat = replace(batch, advantages=torch.zeros_like(batch.advantages))
    rules = [make_rule(n, Objective()) for n in ("base", "reweight")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = compare_rules(model, flat, rules, shares=False)
    assert all(r.resolution.no_update for r in got.values())
    frame = paired_frame(got, flat, torch.exp(flat.old_logp.double()), as_edges(None), step=0)
    assert frame["no_update"].all()
    for c in ("count", "n_pos", "up_pos", "tie_pos", "sum_dpi", "sum_diff", "sum_dpi_ref"):
        assert frame[c].null_count() == frame.height, c
    moved = compare_rules(model, batch, rules, shares=False)  # with the advantages: measured as before
    assert not any(r.resolution.no_update for r in moved.values())


# ---- the analysis sample: the first rows with a signal -----------------------------------------------------------
ROWS = [  # (completion ids, advantage); one prompt length, so that position ids do not depend on padding
    ([10, 11, 12, 13], 0.0),
    ([14, 15], 1.0),
    ([16, 17, 18], 0.0),
    ([19, 20, 21], -1.0),
    ([22, 23], 0.5),
    ([24, 25, 26, 27], -0.5),
]


def _rollouts(path, advantages=None):
    adv = [a for _, a in ROWS] if advantages is None else advantages
    pl.DataFrame(
        {
            "prompt_ids": [[5, 6, 7]] * len(ROWS),
            "completion_ids": [c for c, _ in ROWS],
            "advantage": adv,
            "old_logp": [[-0.7] * len(c) for c, _ in ROWS],
        }
    ).write_parquet(path)
    return path


def _hand_batch(rows, pad: int) -> ProbeBatch:
    """The rows as a `ProbeBatch` built here: prompt + completion right-padded with ``pad``."""
    width = max(len(ROWS[i][0]) for i in rows)
    ids = torch.full((len(rows), 3 + width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, i in enumerate(rows):
        c = ROWS[i][0]
        ids[b, :3] = torch.tensor([5, 6, 7])
        ids[b, 3 : 3 + len(c)] = torch.tensor(c)
        mask[b, : len(c)] = 1
    attn = torch.cat([torch.ones(len(rows), 3, dtype=torch.long), mask], 1)
    adv = torch.tensor([ROWS[i][1] for i in rows], dtype=torch.float64)
    return ProbeBatch(ids, attn, mask, adv, old_logp=torch.full(mask.shape, -0.7, dtype=torch.float64) * mask)


def test_the_offline_probe_analyses_the_first_rows_with_an_advantage(tiny_model_dir, tmp_path):
    import json

    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from tokendyn.config import resolve
    from tokendyn.effects.rebalance import analyze_update
    from tokendyn.hooks.offline import probe_rollouts
    from tokendyn.hooks.options import rebalance_options

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    objective = Objective(eps_low=0.2, eps_high=0.28)
    res = probe_rollouts(model, tok, _rollouts(tmp_path / "r.parquet"), tmp_path / "run", sample_sequences=3,
                         analyses="prob_change", objective=objective)  # fmt: skip
    assert res.analysed_rows == 3
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["analysed_row_indices"] == [1, 3, 4]
    got = pl.read_parquet(sorted((tmp_path / "run" / "records").glob("prob_change-*.parquet")))
    options = rebalance_options(resolve(None, {"analyses": "prob_change", "sample_sequences": 3}))
    want, _ = analyze_update(model, _hand_batch([1, 3, 4], tok.pad_token_id), step=0, options=options,
                             objective=objective)  # fmt: skip
    assert got.equals(want["prob_change"])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        none = probe_rollouts(model, tok, _rollouts(tmp_path / "z.parquet", [0.0] * len(ROWS)), tmp_path / "zero",
                              sample_sequences=3, analyses="prob_change", objective=objective)  # fmt: skip
    kinds = {p.name.split("-rank")[0] for p in (tmp_path / "zero" / "records").glob("*.parquet")}
    assert none.analysed_rows == 0 and "prob_change" not in kinds and "notes" in kinds
    notes = pl.read_parquet(sorted((tmp_path / "zero" / "records").glob("notes-*.parquet")))
    assert notes["message"].to_list() == [
        "no sequence of the sample has a non-zero advantage; analyses skipped"
    ]


def test_verls_probe_batch_takes_the_first_sequences_with_an_advantage():
    pytest.importorskip("verl")
    from tokendyn.integrations.verl.cpu import make_batch
    from tokendyn.integrations.verl.probe import probe_batch

    prompts = [[5, 6, 7]] * len(ROWS)
    responses = [c for c, _ in ROWS]
    adv = [[a] * len(c) for c, a in ROWS]
    old = [[-0.7] * len(c) for c, _ in ROWS]
    data = make_batch(prompts, responses, advantages=adv, old_log_probs=old, temperature=1.0)
    got = probe_batch(data, 2, 1.0)
    want = _hand_batch([1, 3], 0)
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.attention_mask, want.attention_mask)
    assert torch.equal(got.completion_mask, want.completion_mask)
    m = want.completion_mask
    assert torch.equal(got.advantages[m], want.advantages[m])
    assert torch.allclose(got.old_logp, want.old_logp, atol=1e-7)
    assert probe_batch(data, 10, 1.0).advantages.shape[0] == 4  # fewer when the batch has fewer
    zero = make_batch(prompts, responses, advantages=[[0.0] * len(c) for c in responses], old_log_probs=old)
    assert probe_batch(zero, 2, 1.0) is None
