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


def test_llm_demo_trains_on_sums_and_analyses_the_same_rollouts(tmp_path):
    """The real LLM's demo: the arithmetic task in every run, the paired comparison in GRPO's run only, and the
    analyses on the same rollouts in every run although Lopti takes two optimizer steps per rollout."""
    from tokendyn.analysis.schedule import probed_rollout
    from tokendyn.commands.demo import LLM, POLICIES, _configs
    from tokendyn.trainers.runner import optimizer_steps_per_rollout

    source, full, _ = POLICIES["smollm2-135m"]
    assert (source, full) == ("smollm2-135m", LLM)
    runs = _configs(tmp_path, LLM, source, {})
    for name, run, cfg in runs:
        assert run.task == "arith" and run.arith_digits == [1, 2] and run.arith_eval_digits == [2]
        assert run.model_name_or_path == "smollm2-135m" and run.eval_n == 200
        assert cfg.learning_rate == 1e-5 and cfg.max_completion_length == 16
        per = optimizer_steps_per_rollout(cfg)
        probed = [s for s in range(LLM.rollouts * per) if probed_rollout(s, cfg.probe_every, per)]
        assert sorted({s // per for s in probed}) == [0, 3, 6], name  # probe_every counts rollouts
        assert len(probed) == 3 * per, name  # every optimizer step of a probed rollout
        assert bool(cfg.probe_compare_rules) == (name == "grpo")


@pytest.mark.parametrize(
    "kwargs, field",
    [({"policy": "gpt-17"}, "policy: must be one of default, smollm2-135m"),
     ({"policy": "smollm2-135m", "model": "some/model"}, "model: give --model or --policy smollm2-135m")],
)  # fmt: skip
def test_demo_policy_input_is_checked_before_any_work(tmp_path, kwargs, field):
    from tokendyn.common import UsageError

    with pytest.raises(UsageError, match=field):
        demo(tmp_path / "demo", say=lambda msg: None, **kwargs)
    assert not (tmp_path / "demo").exists()


def test_token_histogram_bins_are_half_open_and_the_last_closed():
    """Fig. 1a's bins [0, .25), [.25, .5), [.5, .75), [.75, 1]: a token exactly on an edge belongs to the bin above
    it, and pi = 1 to the last one (hand-counted)."""
    from tokendyn.trainers.evaluate import token_histogram

    shares = token_histogram([0.1, 0.25, 0.5, 0.7499, 0.75, 1.0])
    assert shares == pytest.approx([1 / 6, 1 / 6, 2 / 6, 2 / 6])
    with pytest.raises(ValueError, match="no sampled tokens"):
        token_histogram([])


def test_the_accuracy_table_reads_the_arithmetic_tasks_difficulties():
    """The report's held-out accuracy table and curves take the arithmetic task's per-difficulty columns
    (heldout/accuracy_2digit) as they take K&K's per-size ones (the real LLM's demo had no table before)."""
    import polars as pl

    from tokendyn.figures.training import accuracy_table, heldout_sizes

    m = pl.DataFrame(
        {
            "run": ["GRPO", "GRPO", "GRPO + Lopti(eta=0.5)", "GRPO + Lopti(eta=0.5)"],
            "rollout": [0, 7, 0, 7],
            "heldout/accuracy_2digit": [0.19, 0.59, 0.19, 0.435],
            "heldout/accuracy": [0.19, 0.59, 0.19, 0.435],
        }
    )
    assert heldout_sizes(m) == [("heldout/accuracy_2digit", "2 digits")]
    table = accuracy_table(m, last=1)
    rows = {r["run"]: r for r in table.iter_rows(named=True)}
    assert rows["starting policy"]["2 digits"] == pytest.approx(0.19)
    assert rows["GRPO"]["2 digits"] == pytest.approx(0.59)
    assert rows["GRPO + Lopti(eta=0.5)"]["mean"] == pytest.approx(0.435)
    assert rows["GRPO + Lopti(eta=0.5)"]["vs GRPO (%)"] == pytest.approx((0.435 / 0.59 - 1) * 100)
