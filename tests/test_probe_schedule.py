"""``probe_every`` counts rollouts: a probed rollout is probed in every optimizer step of its update, so a Lopti run
records both stages ("low" and "high") live, with the demo's schedule and at the CLI. Real runs of the real trainer
on the embedded default (tiny sizes); the expected steps and stages are written out by hand from the schedule
(4 optimizer steps a Lopti rollout on the embedded defaults: steps_per_generation 2, two stages)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
import torch

from tokendyn.analysis.schedule import is_probed, probed_rollout, read_schedule
from tokendyn.records import shard_files

torch.set_num_threads(1)

# the kinds the live probe writes per probed micro-batch (the sampler's only with vLLM: not here)
LIVE_KINDS = ("binstats", "hist", "bound", "checks", "tokens", "floor")
TOY = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=8, disable_tqdm=True)
ROOT = Path(__file__).resolve().parents[1]


def _records(run_dir: Path, kind: str) -> pl.DataFrame:
    files = shard_files(run_dir, kind)
    assert files, f"no {kind} records in {run_dir}"
    return pl.concat([pl.read_parquet(f) for f in files], how="diagonal_relaxed")


def _steps_and_stages(run_dir: Path, kind: str) -> set[tuple[int, str]]:
    return set(_records(run_dir, kind).select("step", "stage").unique().iter_rows())


def graded_reward(completions, **kwargs):
    """A reward that differs within a group (the fraction of vowels), so the analyses have a signal."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [sum(ch in "aeiou" for ch in t) / max(len(t), 1) for t in texts]


def test_a_step_is_probed_when_its_rollout_is():
    """Enumerated by hand: 4 optimizer steps a rollout, every 2nd rollout probed -> steps 0-3 and 8-11 of 0-11."""
    assert [s for s in range(12) if probed_rollout(s, 2, 4)] == [0, 1, 2, 3, 8, 9, 10, 11]
    assert [s for s in range(4) if probed_rollout(s, 1, 2)] == [0, 1, 2, 3]
    assert not any(probed_rollout(s, 0, 1) for s in range(4))


def test_committed_runs_are_read_as_counting_optimizer_steps():
    """A committed study run (made before `probe_schedule`) stored ``probe_every`` as optimizer steps (8 for a Lopti
    run probed every 4th rollout of 2 steps): read so, the probed steps are exactly the ones its records hold."""
    run = ROOT / "docs" / "study" / "llm" / "runs" / "lopti-s0"
    meta = json.loads((run / "run.json").read_text())
    schedule = read_schedule(meta)
    assert schedule == {"every": 8, "counts": "optimizer_steps", "optimizer_steps_per_rollout": None}
    recorded = set(_records(run, "binstats").get_column("step").unique().to_list())
    assert recorded == {s for s in range(meta["config"]["max_steps"]) if is_probed(s, schedule)}
    assert set(_records(run, "binstats").get_column("stage").unique().to_list()) == {
        "low"
    }  # its first stage only


def _titles(fig) -> str:
    texts = [fig._suptitle.get_text()] if fig._suptitle is not None else []
    return " ".join([*texts, *(ax.get_title() for ax in fig.axes)]).replace("\n", " ")


def test_figures_name_the_lopti_stages_they_draw():
    """On committed study runs whose Lopti run recorded its first stage only (the schedule before), the figures of
    the live records say so; a plain run's figures say nothing of stages."""
    import matplotlib.pyplot as plt

    from tokendyn.figures import gradients, tokens
    from tokendyn.figures.data import load_runs

    runs = ROOT / "docs" / "study" / "llm" / "runs"
    r = load_runs([runs / "grpo-s0", runs / "lopti-s0"])
    figs = [tokens.token_share(r.get("binstats"), r.get("tokens")), tokens.advantage_by_bin(r.get("tokens")),
            tokens.bound(r.get("tokens"), r.get("bound"), r.get("checks")),
            gradients.gradient_norm_by_bin(None, r.get("binstats"))]  # fmt: skip
    for fig in figs:
        assert "Lopti stages drawn: GRPO + Lopti(eta=0.5): low only" in _titles(fig)
        plt.close(fig)
    plain = load_runs([runs / "grpo-s0"])
    fig = tokens.advantage_by_bin(plain.get("tokens"))
    assert "Lopti stages" not in _titles(fig)
    plt.close(fig)


@pytest.mark.slow
def test_demo_schedule_records_both_lopti_stages(tmp_path):
    """The demo's Lopti run (its full size's schedule: every 4th rollout; toy batch) over 2 rollouts: rollout 0 is
    probed in all 4 optimizer steps, stage low in steps 0-1 and high in 2-3, in every live record kind; rollout 1
    (steps 4-7) in none. The analyses run once, on rollout 0, each stage's own update apart."""
    from tokendyn.commands.demo import FULL, _configs, with_size
    from tokendyn.trainers.runner import train

    size = with_size(FULL, rollouts=2, people=(3,), eval_people=(3,), eval_n=0, eval_every=2)
    toy = {**TOY, "probe_sample_sequences": 4, "probe_lr_sweep": None, "save_strategy": "no"}
    (_, run, cfg), = [r for r in _configs(tmp_path, size, None, toy) if r[0] == "lopti"]  # fmt: skip
    assert cfg.probe_every == FULL.probe_every == 4  # rollouts, as the demo's size says
    train(run, cfg, progress=False, reward=graded_reward)
    out = Path(cfg.output_dir)
    meta = json.loads((out / "run.json").read_text())
    assert meta["probe_schedule"] == {"every": 4, "counts": "rollouts", "optimizer_steps_per_rollout": 4}
    expected = {(0, "low"), (1, "low"), (2, "high"), (3, "high")}
    assert {s for s in range(8) if is_probed(s, read_schedule(meta))} == {0, 1, 2, 3}
    for kind in LIVE_KINDS:
        assert _steps_and_stages(out, kind) == expected, kind
    shares = _records(out, "shares")
    assert set(shares.get_column("stage").unique().to_list()) == {"train", "low", "high"}
    assert set(shares.filter(pl.col("stage") == "high").get_column("step").to_list()) == {
        2
    }  # stage 2's start
    for kind in ("prob_change", "influence"):
        updates = set(_records(out, kind).get_column("update_stage").unique().to_list())
        assert {"low", "high"} <= updates, kind
    from tokendyn.figures import tokens
    from tokendyn.figures.data import load_runs

    r = load_runs([out])
    title = _titles(tokens.advantage_by_bin(r.get("tokens")))
    assert "Lopti stages drawn: GRPO + Lopti(eta=0.5): low + high" in title


@pytest.mark.slow
def test_cli_probe_every_4_on_the_default_records_both_lopti_stages(tmp_path):
    """`tokendyn train --lopti_eta 0.5 --probe_every 4` on the embedded default (toy batch, one rollout): before,
    probe_every counted optimizer steps and probed step 0 only (stage low); now rollout 0 is probed in all its
    steps."""
    from tokendyn.cli import main

    out = tmp_path / "run"
    argv = ["train", "--output_dir", str(out), "--lopti_eta", "0.5", "--probe_every", "4", "--rollouts", "1"]
    argv += ["--people", "3", "--eval_n", "0", "--save_strategy", "no", "--threads", "1"]
    argv += [x for k, v in TOY.items() for x in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v))]
    before = torch.get_num_threads()
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(before)
    for kind in LIVE_KINDS:
        assert _steps_and_stages(out, kind) == {(0, "low"), (1, "low"), (2, "high"), (3, "high")}, kind
