"""Every loss option and remedy trains in `TokendynGRPOTrainer` with the probe and every analysis on: the records
of each kind are written, the per-bin update shares of a step sum to 1, the probe's exact checks report no violation,
and the run has the remedy's name. (Their gradients are checked against TRL's own step in test_one_loss.py, Clip-Cov
and KL-Cov against verl's losses in test_cov_remedies.py, the paper's preset against a plain loop in test_preset.py.)
"""

from __future__ import annotations

import polars as pl
import pytest
import torch
from test_trainer import _config, _trainer

from tokendyn.analysis import analyze_run
from tokendyn.analysis.tables import checks_violations
from tokendyn.trainers.presets import PRESETS
from tokendyn.trainers.runner import method_name

torch.set_num_threads(1)

RUNS = {
    "clip_cov": (
        dict(PRESETS["clip_cov"], clip_cov_ratio=0.05, clip_cov_lb=0.0, clip_cov_ub=50.0),
        "GRPO + Clip-Cov",
    ),
    "kl_cov": (dict(PRESETS["kl_cov"], kl_cov_ratio=0.05), "GRPO + KL-Cov"),
    "gspo": (PRESETS["gspo"], "GSPO"),
    "80_20": (PRESETS["80_20"], "GRPO + 80/20"),
    "ar_lopti": (
        {k: v for k, v in PRESETS["ar_lopti"].items() if k != "max_grad_norm"},
        "GRPO + Reweight(a=0.3) + Lopti(eta=0.5)",
    ),
    "vespo": (dict(loss_type="vespo"), "VESPO"),
    "dppo_tv": (dict(PRESETS["dppo_tv"], num_iterations=2), "GRPO + DPPO-TV"),
    "aspo": (dict(PRESETS["aspo"], num_iterations=2), "GRPO + ASPO"),
    "ce_gppo": (dict(PRESETS["ce_gppo"], num_iterations=2), "GRPO + CE-GPPO"),
    "lp_reg": (dict(PRESETS["lp_reg"], lp_reg_rho=0.5), "GRPO + Lp-Reg"),
    "w_reinforce": (PRESETS["w_reinforce"], "W-REINFORCE(l=0.1)"),
    "logp_reweight": (PRESETS["logp_reweight"], "GRPO + LogpReweight(c=0.1)"),
    "off-policy mask, adaptive entropy": (
        dict(loss_type="bnpo", off_policy_mask_threshold=0.0, use_adaptive_entropy=True, entropy_coef=0.05),
        "GRPO",
    ),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_the_remedy_trains_with_every_analysis(tiny_model_dir, tmp_path, name):
    options, expected = RUNS[name]
    steps = 2 if name == "ar_lopti" else 1
    cfg = _config(tmp_path, max_steps=steps, probe_every=1, probe_sample_sequences=4, **options)
    assert method_name(cfg) == expected
    trainer = _trainer(tiny_model_dir, cfg)
    trainer.train()
    run = tmp_path / "run"
    tables = analyze_run(run, write=False)
    kinds = {p.name.split("-rank")[0] for p in (run / "records").glob("*.parquet")}
    assert {"binstats", "checks", "shares", "token_shares", "prob_change", "influence"} <= kinds, kinds
    assert checks_violations(tables["checks"]) == 0
    shares = pl.read_parquet(sorted((run / "records").glob("shares-*.parquet")))
    per_step = (
        shares.filter((pl.col("group") == "all") & (pl.col("bin") >= 0))
        .group_by("step", "stage")  # Lopti: each stage's shares too
        .agg(pl.col("share").sum())
    )
    assert per_step.height >= 1 and float((per_step["share"] - 1).abs().max()) < 1e-6
