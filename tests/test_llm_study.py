"""The seeded study's machinery (`tokendyn.commands.llm_study`), run end to end at a smoke-test size on the
embedded default (the real LLM's runs are the committed ones, `test_committed_llm_study_*`): result folders without
weights, skipped when done, another study's folder refused, the report from the folders alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

from tokendyn.cli import main
from tokendyn.commands import llm_study as L
from tokendyn.commands.llm_study_report import write_llm_study
from tokendyn.commands.study_engine import DONE, finished_runs, identity, run_config, with_size
from tokendyn.common import UsageError

torch.set_num_threads(1)
SIZE = with_size(L.QUICK, methods=("grpo", "random_halves"), seeds=(0, 1))
COMMITTED = Path(__file__).resolve().parents[1] / "docs" / "study" / "llm"


@pytest.fixture(scope="module")
def quick_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    said = []
    L.llm_study(out / "out", SIZE, model=None, work_dir=out / "work", say=said.append)
    return out, said


def test_every_run_leaves_its_results_and_no_weights(quick_study):
    root, said = quick_study
    out = root / "out"
    runs = finished_runs(out)
    assert sorted(runs) == [("grpo", 0), ("grpo", 1), ("random_halves", 0), ("random_halves", 1)]
    # seed by seed: both methods of seed 0 before seed 1
    order = [line.split("]", 2)[2].split("[/bold]")[0].strip() for line in said if line.startswith("[bold][")]
    assert order == ["grpo seed 0", "random_halves seed 0", "grpo seed 1", "random_halves seed 1"]
    assert not list(out.rglob("*.safetensors")) and not (root / "work" / "grpo-s0").exists()
    for (method, seed), d in runs.items():
        done = json.loads((d / DONE).read_text())
        assert done["method_fields"] == L.METHODS[method] and done["study"]["eval_n"] == SIZE.eval_n
        ev = pl.read_parquet(d / "eval.parquet")
        assert ev["rollout"].unique().to_list() == [1]  # the start is evaluated once, not per run
        assert ev.sort("problem")["problem"].to_list() == list(range(SIZE.eval_n))
        assert set(ev["method"]) == {method} and set(ev["seed"]) == {seed}
        meta = json.loads((d / "run.json").read_text())
        assert meta["seed"] == seed and meta["config"]["random_halves"] == (method == "random_halves")
        assert list((d / "records").glob("binstats-*.parquet"))  # the probe's records came along
    start = pl.read_parquet(out / "start" / "eval.parquet")
    assert start.height == SIZE.eval_n and set(start["rollout"]) == {0}


def test_a_second_call_trains_nothing_and_another_study_is_refused(quick_study, tmp_path):
    root, _ = quick_study
    out = root / "out"
    said = []
    L.llm_study(out, SIZE, model=None, work_dir=tmp_path / "work", say=said.append)
    # the four runs and the starting policy
    assert sum("done earlier" in line for line in said) == 4 + 1 and not any("rollouts ->" in s for s in said)
    with pytest.raises(
        UsageError, match=r"^out: .* holds a finished run of a different study \(eval_n 4 vs 3"
    ):
        L.llm_study(out, with_size(SIZE, eval_n=3), model=None, work_dir=tmp_path / "w")


def test_an_unfinished_run_starts_over(quick_study, tmp_path):
    root, _ = quick_study
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    shutil.rmtree(out / "runs" / "random_halves-s1")
    (tmp_path / "work" / "random_halves-s1").mkdir(parents=True)  # a stop in the middle of its training
    (tmp_path / "work" / "random_halves-s1" / "run.json").write_text("{}")
    said = []
    L.llm_study(out, SIZE, model=None, work_dir=tmp_path / "work", say=said.append)
    assert any("unfinished earlier run" in s for s in said)
    assert ("random_halves", 1) in finished_runs(out)


def test_the_report_comes_from_the_folders_alone(quick_study, tmp_path):
    root, _ = quick_study
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    path = write_llm_study(out, SIZE)
    text = path.read_text()
    assert "## Each method minus GRPO" in text and "random_halves** − GRPO after 1 rollouts" in text
    acc = pl.read_parquet(out / "tables" / "accuracy.parquet")
    assert set(acc["method"]) == {"grpo", "random_halves", "start"}
    assert (out / "figures" / "accuracy.png").is_file() and (out / "figures" / "differences.png").is_file()
    # the CLI's --report-only writes the same text, training nothing
    again = tmp_path / "again"
    shutil.copytree(root / "out", again)
    argv = [
        "study",
        "--policy",
        "smollm2-135m",
        "--quick",
        "--methods",
        "grpo,random_halves",
        "--report-only",
    ]
    assert main([*argv, "--out", str(again)]) == 0
    assert (again / "study.md").read_text() == text


def test_grpo_trained_again_sweeps_both_camps_and_trains_the_same(quick_study, tmp_path):
    """grpo_camps: GRPO with the same seed, its probed states also making every rule of both camps and the c / eta
    sweeps (its configuration; the embedded default's one rollout of sums has no signal to compare, so the `paired`
    rows read here are test_axis_tables' hand-made ones); its held-out outcomes equal grpo's problem by problem, and
    the report's both-camps table and guidance come from its folders."""
    from test_axis_tables import _rows

    from tokendyn.commands.study_engine import BOTH_CAMPS
    from tokendyn.records import write_frames

    root, _ = quick_study
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    size = with_size(SIZE, methods=("grpo", "grpo_camps"), seeds=(0,))
    _, camps_cfg = run_config(L.LLM, tmp_path / "w" / "c", "grpo_camps", 0, size, None)
    _, grpo_cfg = run_config(L.LLM, tmp_path / "w" / "g", "grpo", 0, size, None)
    for field, value in BOTH_CAMPS.items():
        got = getattr(camps_cfg, field)
        assert (list(got) if isinstance(value, list) else got) == value, field
        assert getattr(grpo_cfg, field) != getattr(camps_cfg, field), field
    # the comparison's own lr (k = 2 leaves the local regime at the analyses' 1e-3 on the real LLM); the analyses' kept
    assert camps_cfg.probe_compare_lr == L.CAMPS_LR < grpo_cfg.probe_lr == camps_cfg.probe_lr
    assert grpo_cfg.probe_compare_lr is None
    L.llm_study(out, size, model=None, work_dir=tmp_path / "work", say=lambda _: None)
    write_frames(out / "runs" / "grpo_camps-s0", {"paired": _rows(6)}, rank=0)
    text = write_llm_study(out, with_size(SIZE, methods=("grpo", "random_halves", "grpo_camps"))).read_text()
    assert (
        "their held-out outcomes equal GRPO's problem by problem at every evaluation for 1 of 1 seeds (0)."
        in text
    )
    assert "## Both camps from the GRPO runs' states (grpo_camps)" in text
    assert "## Guidance along the axis through both camps" in text
    diffs = pl.read_parquet(out / "tables" / "differences.parquet")
    assert "grpo_camps" not in set(diffs["method"])  # GRPO again: not a method compared with GRPO


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--methods", "grpo,ppo"], "methods"),
        (["--seeds", "0,0"], "seeds"),
        (["--rollouts", "0"], "rollouts"),
        (["--eval-n", "201"], "eval_n"),
        (["--people", "3"], "--people"),
    ],
)
def test_bad_values_are_one_line_naming_the_field(tmp_path, capsys, flags, field):
    assert main(["study", "--policy", "smollm2-135m", "--out", str(tmp_path / "o"), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0]
    assert not (tmp_path / "o").exists()


def assert_same_table(got: pl.DataFrame, want: pl.DataFrame, name: str) -> None:
    """Equal schema and rows; float columns to 1e-9 relative (1e-15 absolute), not bit for bit: the tables are sums
    and means taken by polars' threads, whose order (and so the last bits) varies between machines and runs (a
    fresh clone once differed by 1.7e-18 in a `diff` column). The reports print three or four digits."""
    assert got.schema == want.schema and got.height == want.height, name
    for c in want.columns:
        if want[c].dtype.is_float():
            a, b = got[c].to_numpy(), want[c].to_numpy()
            assert np.allclose(a, b, rtol=1e-9, atol=1e-15, equal_nan=True), (name, c)
        else:
            assert got[c].equals(want[c]), (name, c)


def test_committed_llm_study_is_what_its_result_files_give(tmp_path):
    """docs/study/llm (the real LLM's study, committed run by run): its study.md and tables are regenerated here
    from the committed result folders alone, no training, and equal the committed ones."""
    runs = finished_runs(COMMITTED)
    assert runs, f"no finished run committed under {COMMITTED}"
    out = tmp_path / "llm"
    shutil.copytree(COMMITTED / "runs", out / "runs")
    shutil.copytree(COMMITTED / "start", out / "start")
    write_llm_study(out, L.FULL)
    assert (out / "study.md").read_text() == (COMMITTED / "study.md").read_text()
    for table in sorted((COMMITTED / "tables").glob("*.parquet")):
        assert_same_table(pl.read_parquet(out / "tables" / table.name), pl.read_parquet(table), table.name)
    # every committed run is a run of the full study (same settings), with its wall time and thread count
    for d in runs.values():
        done = json.loads((d / DONE).read_text())
        assert done["study"] == identity(L.LLM, L.FULL, "smollm2-135m") and done["wall_time_s"] > 0
