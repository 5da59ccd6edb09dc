"""verl's rollout correction end to end: ``python -m verl.trainer.main_ppo`` (``examples/verl_main_ppo.sh``, the
README's tokendyn lines: Reweight, Lopti, the probe, the analyses) with tokendyn's Hugging Face rollout server as a bf16
sampler (verl's ``actor_rollout_ref.rollout.dtype=bfloat16``) against the float32 actor, and verl's correction on in
its decoupled mode: ``algorithm.rollout_correction.rollout_is=token`` with a cap that binds (1.02),
``rollout.calculate_log_probs=True``, ``bypass_mode=False``. One GRPO step (Lopti's two updates).

Checked against verl itself: its own mismatch metric shows the bf16 sampler; every token's `sampler` record (log mu,
log pi_old, the weight) is the saved batch's, and its weight is what verl's own `compute_rollout_correction_weights`
gives on the saved batch's log-probs, in both updates; their mean is verl's ``rollout_corr/rollout_is_mean``.
(That the analyses' gradient with these weights is the actor's step: tests/test_verl_rollout_correction.py.)"""

from __future__ import annotations

import polars as pl
import pytest
import torch
from test_verl_main_ppo import run_main_ppo, step_metrics

# one main_ppo run (~100 s of both cores, ~4 GB): on the xdist worker of the other main_ppo run, never beside it
pytestmark = [pytest.mark.slow, pytest.mark.slow_tier]

MODE, THRESHOLD = "token", 1.02
CORRECTION = (
    "actor_rollout_ref.rollout.dtype=bfloat16",
    "actor_rollout_ref.rollout.calculate_log_probs=True",
    f"algorithm.rollout_correction.rollout_is={MODE}",
    f"algorithm.rollout_correction.rollout_is_threshold={THRESHOLD}",
    "algorithm.rollout_correction.bypass_mode=False",
)
# verl's training/rollout_probs_diff_max: float32 on both sides measured 2.3e-6 .. 3.8e-6 (test_verl_main_ppo.py)
BF16_DIFF_MIN = 1e-3


@pytest.fixture(scope="module")
def corrected_run(tmp_path_factory):
    return run_main_ppo(tmp_path_factory.mktemp("main_ppo_correction"), steps=1, more=CORRECTION)


def test_main_ppo_runs_with_verls_rollout_correction_against_a_bf16_sampler(corrected_run):
    proc = corrected_run["proc"]
    assert proc.returncode == 0, corrected_run["log"][-6000:]
    metrics = step_metrics(corrected_run["log"])[1]
    print(f"main_ppo wall time, rollout correction: {corrected_run['wall']:.0f} s; "
          f"rollout_probs_diff_max {metrics['training/rollout_probs_diff_max']:.2e}")  # fmt: skip
    assert (
        metrics["training/rollout_probs_diff_max"] > BF16_DIFF_MIN
    )  # the bf16 sampler's mismatch, seen by verl
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(THRESHOLD)  # the cap binds
    assert metrics["rollout_corr/rollout_is_min"] < 1.0
    for stage in ("low", "high"):
        assert metrics[f"actor/tokendyn/{stage}/bound_violations"] == 0


def verl_weights(batch: pl.DataFrame) -> dict[tuple[float, ...], list[float]]:
    """verl's own weights of every sequence of a saved batch, from its log-probs (log pi_old - log mu), keyed by the
    sequence's log pi_old."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    old = [torch.tensor(v, dtype=torch.float32) for v in batch["old_logp"]]
    mu = [torch.tensor(v, dtype=torch.float32) for v in batch["sampler_logp"]]
    pad = torch.nn.utils.rnn.pad_sequence
    mask = pad([torch.tensor(v, dtype=torch.float32) for v in batch["loss_mask"]], batch_first=True)
    weights, _ = compute_rollout_correction_weights(
        log_ratio=pad(old, batch_first=True) - pad(mu, batch_first=True), response_mask=mask,
        rollout_is=MODE, rollout_is_threshold=THRESHOLD,
    )  # fmt: skip
    return {tuple(o.double().tolist()): weights[i, : len(o)].double().tolist() for i, o in enumerate(old)}


def test_the_sampler_records_carry_verls_own_weights_of_the_saved_batch(corrected_run):
    assert corrected_run["proc"].returncode == 0
    probe = corrected_run["out"] / "probe"
    batch = pl.read_parquet(probe / "batches" / "update-0000-rank0.parquet")
    want = verl_weights(batch)
    mu = {
        tuple(o): s for o, s in zip(batch["old_logp"].to_list(), batch["sampler_logp"].to_list(), strict=True)
    }
    records = pl.read_parquet(sorted((probe / "records").glob("sampler-*.parquet")))
    assert sorted(records["step"].unique()) == [0, 1]  # Lopti's two updates, both with the weights
    worst, n = 0.0, 0
    for (step, _micro, _row), seq in records.sort("pos").group_by(
        "step", "micro", "row", maintain_order=True
    ):
        assert seq["pos"].to_list() == list(range(seq.height))
        key = tuple(seq["logp_old"].to_list())
        assert key in want, f"update {step}: a sequence the saved batch does not hold"
        assert seq["logp_sampler"].to_list() == mu[key]
        worst = max(worst, float((seq["is_weight"].to_torch() - torch.tensor(want[key])).abs().max()))
        n += seq.height
    print(f"sampler records vs verl's compute_rollout_correction_weights: {n} tokens, max |diff| {worst:.1e}")
    assert (
        worst < 1e-6
    )  # measured 0 (the same float32 arithmetic); a token's weight off by a row or a field: ~1e-2
    first = records.filter(pl.col("step") == 0)
    assert first.height == sum(map(len, batch["old_logp"].to_list()))  # every token of the batch, once
    capped = (first["is_weight"] == float(torch.tensor(THRESHOLD))).sum()  # verl caps in float32
    assert 0 < capped < first.height and (first["is_weight"] < 1).any()
    assert first["log_rho"].abs().mean() > 1e-3
    # verl's own metric of the same weights: their mean over the batch's response tokens
    verl_mean = step_metrics(corrected_run["log"])[1]["rollout_corr/rollout_is_mean"]
    assert first["is_weight"].mean() == pytest.approx(verl_mean, rel=1e-5)
    from tokendyn.analysis import analyze_run

    table = analyze_run(probe, write=False)["mismatch"]
    assert table.height > 0
