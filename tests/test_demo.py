"""Smoke test of the demo pipeline at toy size: the three runs (GRPO, +Reweight, +Lopti) through the real runner on
K&K with the tiny Qwen2 (it learns nothing: every reward is the same), then the figures and the report."""

from __future__ import annotations

import json

import pytest
import torch

from tokendyn.commands.demo import QUICK, demo, with_size

torch.set_num_threads(1)


@pytest.mark.slow
def test_demo_writes_three_runs_and_the_report(tiny_model_dir, tmp_path):
    out = tmp_path / "demo"
    size = with_size(QUICK, rollouts=1, people=(3,), eval_people=(3,), eval_n=1, eval_every=1, probe_every=1)
    toy = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=8, disable_tqdm=True)
    report = demo(out, model=str(tiny_model_dir), size=size, overrides=toy, say=lambda msg: None)
    assert report == out / "figures" / "report.html"
    methods = []
    for name in ("grpo", "reweight", "lopti"):
        meta = json.loads((out / name / "run.json").read_text())
        assert meta["status"] == "finished" and (out / name / "metrics.parquet").is_file()
        assert any((out / name / "records").glob("binstats-*.parquet"))
        methods.append(meta["method"])
    assert methods == ["GRPO", "GRPO + Reweight(a=0.3)", "GRPO + Lopti(eta=0.5)"]
    html = report.read_text()
    assert all(m in html for m in methods)
    assert (out / "figures" / "i_training.png").is_file()
