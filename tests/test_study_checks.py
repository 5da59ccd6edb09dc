"""The seeded studies' rows that hold at small n and the checks that keep a study from reusing stale runs:
`tokendyn.analysis.seeds.differences_table` (bootstrap, seed-level t-interval, signs, Holm, verdict), the per-seed
accuracy table, a run's widened identity (`tokendyn.commands.study_identity`) against the committed runs, the
reference study's check, the sampler methods refused without --use_vllm, and the setup read from run.json."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from tokendyn.analysis import seeds as S
from tokendyn.cli import main
from tokendyn.commands import llm_study as L
from tokendyn.commands.study_engine import DONE, finished_runs, run_config
from tokendyn.commands.study_identity import check_reference, check_run, identity, run_mismatch
from tokendyn.common import UsageError

ROOT = Path(__file__).resolve().parents[1]
STUDIES = {"llm": (L.LLM, L.FULL), "llm-vllm": (L.SAMPLER, L.SAMPLER_FULL)}


def _evals(correct: dict[tuple[str, int], list[int]], rollout: int = 8) -> pl.DataFrame:
    rows = [{"method": m, "seed": s, "rollout": rollout, "digits": 2, "problem": j, "correct": c}
            for (m, s), cs in correct.items() for j, c in enumerate(cs)]  # fmt: skip
    return pl.DataFrame(rows).with_columns(pl.col("correct").cast(pl.Int8))


def _shifted(extra: int, n: int = 200, base: int = 100) -> tuple[list[int], list[int]]:
    """(method, base) outcomes on n problems: the base solves the first ``base``, the method ``extra`` more."""
    return [1] * (base + extra) + [0] * (n - base - extra), [1] * base + [0] * (n - base)


def test_a_row_carries_the_seed_level_t_interval_signs_and_holm_against_scipy():
    """Per-seed differences 5, 8, 8, 5 of 200 problems = (0.025, 0.04, 0.04, 0.025), i.e. the 4 seeds'
    accuracies (0.565, 0.55, 0.52, 0.545) - (0.54, 0.51, 0.48, 0.52): scipy.stats.ttest_rel gives t 7.5056,
    p 0.0049005, 95 % interval [0.018720, 0.046280] (scipy 1.17.1, quoted). Seeds 4 and 5 of the method have no
    base: left out and listed."""
    correct = {}
    for s, extra in enumerate((5, 8, 8, 5)):
        correct[("reweight", s)], correct[("grpo", s)] = _shifted(extra, base=90 + 3 * s)
    for s in (4, 5):
        correct[("reweight", s)] = [1] * 200
    row = S.differences_table(_evals(correct), [("reweight", "grpo")], 8, n_boot=400).row(0, named=True)
    assert row["seeds"] == 4 and row["agree"] == "4/4" and row["unpaired"] == "reweight: 4, 5"
    assert row["difference"] == pytest.approx(0.0325)
    assert (row["t_lo"], row["t_hi"]) == pytest.approx((0.01871960326722185, 0.04628039673277815), rel=1e-10)
    assert row["p"] == pytest.approx(0.004900523592442466, rel=1e-9)
    assert row["p_holm"] == row["p"] and row["holm_m"] == 1 and row["verdict"] == "reproduced"


def test_holm_family_is_the_rows_sharing_a_base_and_a_split_row_is_not_resolved():
    """Two rows minus grpo form one family (p_holm = Holm of their p); the row minus another base is its own
    family. A row that is consistently positive at 3 seeds but negative at the 4th: the bootstrap may exclude 0,
    the verdict names the checks that do not."""
    correct = {}
    for s, (e1, e2) in enumerate(((6, 20), (7, 22), (6, -4), (8, 18))):
        base = 80
        correct[("grpo", s)] = [1] * base + [0] * (200 - base)
        correct[("a", s)] = [1] * (base + e1) + [0] * (200 - base - e1)
        correct[("b", s)] = [1] * (base + e2) + [0] * (200 - base - e2)
    table = S.differences_table(_evals(correct), [("a", "grpo"), ("b", "grpo"), ("b", "a")], 8, n_boot=1000)
    fam = table.filter(pl.col("minus") == "grpo")
    p = fam["p"].to_numpy()
    # Holm by hand for m = 2: the smaller p times 2, the larger max(that, itself)
    lo, hi = np.argsort(p)
    want = np.empty(2)
    want[lo] = min(1, 2 * p[lo])
    want[hi] = max(want[lo], p[hi])
    assert fam["p_holm"].to_numpy() == pytest.approx(want) and set(fam["holm_m"]) == {2}
    a, b = (fam.filter(pl.col("method") == m).row(0, named=True) for m in ("a", "b"))
    assert a["agree"] == "4/4" and a["verdict"] == "better than GRPO"
    assert b["agree"] == "3/4" and b["verdict"].startswith("not resolved: ") and "signs 3/4" in b["verdict"]
    other = table.filter(pl.col("minus") == "a").row(0, named=True)
    assert other["holm_m"] == 1 and other["p_holm"] == other["p"]


def test_accuracy_per_seed_shows_each_method_and_its_missing_seeds():
    correct = {("grpo", 0): [1, 0, 0, 0], ("grpo", 1): [1, 1, 0, 0], ("lopti", 1): [1, 1, 1, 0]}
    t = S.seed_accuracy_table(_evals(correct), 8, order=("lopti", "grpo"))
    assert t.columns == ["method", "s0", "s1", "seeds", "mean"]
    assert t.rows() == [("lopti", None, 0.75, 1, 0.75), ("grpo", 0.25, 0.5, 2, 0.375)]


@pytest.mark.parametrize("name", sorted(STUDIES))
def test_the_committed_runs_stay_valid_under_the_widened_identity(name):
    """Every committed run of docs/study/{llm, llm-vllm}: its recorded method fields, RunArguments and config equal
    what this study would make, on every field it recorded that changes a result."""
    spec, size = STUDIES[name]
    runs = finished_runs(ROOT / "docs" / "study" / name)
    assert runs
    ident = identity(spec, size, "smollm2-135m")
    for (m, s), d in runs.items():
        run, cfg = run_config(spec, Path("w") / f"{m}-s{s}", m, s, size, "smollm2-135m")
        assert run_mismatch(d, run, cfg, spec.methods[m]) == "", (m, s)
        assert check_run(d, ident, run, cfg, spec.methods[m])


def test_a_finished_run_of_another_method_setting_is_refused_in_one_line(tmp_path):
    """The same study identity, the method's alpha changed: the committed run is stale, refused naming the field."""
    d = tmp_path / "reweight-s0"
    shutil.copytree(ROOT / "docs" / "study" / "llm" / "runs" / "reweight-s0", d)
    spec = replace(L.LLM, methods={**L.METHODS, "reweight": {"advantage_reweight_alpha": 0.5}})
    run, cfg = run_config(spec, Path("w") / "reweight-s0", "reweight", 0, L.FULL, "smollm2-135m")
    with pytest.raises(UsageError) as err:
        check_run(d, identity(spec, L.FULL, "smollm2-135m"), run, cfg, spec.methods["reweight"])
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("out: ") and "advantage_reweight_alpha 0.3 vs 0.5" in msg
    # a marker without method fields (a K&K run): the run.json config still tells
    marker = json.loads((d / DONE).read_text())
    marker.pop("method_fields", None)
    (d / DONE).write_text(json.dumps(marker))
    with pytest.raises(UsageError, match=r"config advantage_reweight_alpha 0.3 vs 0.5"):
        check_run(d, identity(spec, L.FULL, "smollm2-135m"), run, cfg, spec.methods["reweight"])


def test_a_reference_of_other_settings_is_refused_in_one_line(tmp_path):
    ours = finished_runs(ROOT / "docs" / "study" / "llm-vllm")
    ref_root = tmp_path / "ref"
    shutil.copytree(ROOT / "docs" / "study" / "llm" / "runs" / "grpo-s0", ref_root / "runs" / "grpo-s0")
    check_reference(ours, finished_runs(ref_root))  # the committed pair: the same settings
    marker = json.loads((ref_root / "runs" / "grpo-s0" / DONE).read_text())
    marker["study"]["eval_n"] = 100
    (ref_root / "runs" / "grpo-s0" / DONE).write_text(json.dumps(marker))
    with pytest.raises(UsageError) as err:
        check_reference(ours, finished_runs(ref_root))
    assert (
        "\n" not in str(err.value)
        and str(err.value).startswith("--reference: ")
        and "eval_n 100 vs 200" in str(err.value)
    )
    from tokendyn.commands.sampler_study_report import write_sampler_study

    with pytest.raises(UsageError, match=r"^--reference: .* holds no finished run"):
        write_sampler_study(ROOT / "docs" / "study" / "llm-vllm", L.SAMPLER_FULL, tmp_path / "nothing")


@pytest.mark.parametrize(
    "flags, bad",
    [(["--methods", "grpo_vllm_bf16"], "grpo_vllm_bf16"), (["--use_vllm", "--methods", "grpo"], "grpo")],
)
def test_a_method_of_the_other_sampler_is_refused_in_one_line(flags, bad, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["study", "--policy", "smollm2-135m", "--quick", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    err = [e for e in err if "note:" not in e]
    assert len(err) == 1 and "methods" in err[0] and bad in err[0] and "--use_vllm" in err[0]
    assert not out.exists()


def test_the_setup_sentence_is_what_the_runs_recorded():
    from tokendyn.commands.sampler_study_report import setup_sentence
    from tokendyn.commands.study_report import NOT_RECORDED, run_records

    records = run_records(finished_runs(ROOT / "docs" / "study" / "llm-vllm"))
    text = setup_sentence(records)
    assert "8 prompts x 4 samples, lr 1e-05" in text and "sequence_mask, clip 3" in text
    assert "off in grpo_vllm_bf16_raw" in text and "enforce_eager True" in text and "float32 trainer" in text
    key = sorted(records)[0]
    changed = {k: json.loads(json.dumps(v)) for k, v in records.items()}
    changed[key]["config"]["vllm_importance_sampling_clip_max"] = 2.0
    for v in changed.values():
        v["sampler"].pop("enforce_eager")
    text = setup_sentence(changed)
    assert f"2 in {key[0]}" in text and f"enforce_eager {NOT_RECORDED}" in text


def test_the_kk_study_shows_the_same_rows_from_its_greedy_outcomes():
    """The K&K study's evaluations (method, seed, people, mode, puzzle, correct), sampled rows and the starting
    policy left out: the same row and per-seed table as the seeded studies'."""
    from tokendyn.commands.study import QUICK, greedy_differences

    rows = []
    for s in (0, 1, 2):
        for m, solved in (("grpo", 1), ("reweight", 2)):
            for mode in ("greedy", "sampled"):
                for j in range(4):
                    rows.append({"method": m, "seed": s, "people": 3, "mode": mode, "puzzle": j,
                                 "correct": int(j < solved + (mode == "sampled"))})  # fmt: skip
        rows += [{"method": "start", "seed": s, "people": 3, "mode": "greedy", "puzzle": j, "correct": 0}
                 for j in range(4)]  # fmt: skip
    diffs, per_seed = greedy_differences(pl.DataFrame(rows), replace(QUICK, seeds=(0, 1, 2)))
    (row,) = diffs.filter(pl.col("method") == "reweight").iter_rows(named=True)
    assert row["difference"] == 0.25 and row["agree"] == "3/3" and (row["t_lo"], row["t_hi"]) == (0.25, 0.25)
    # every seed +1 of 4 puzzles, so the seed-level checks resolve it; the bootstrap also resamples the 4 puzzles
    assert row["verdict"] == "not resolved: t-interval, Holm, signs above 0; bootstrap not"
    assert row["lo"] <= 0 < row["hi"] and row["rollout"] == QUICK.rollouts
    assert per_seed["method"].to_list() == ["grpo", "reweight"] and per_seed["s2"].to_list() == [0.25, 0.5]
