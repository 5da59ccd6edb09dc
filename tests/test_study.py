"""`tokendyn study`: the bootstrap against known answers, the verdict rule, input validation, and the quick study end
to end through the real runner (tiny Qwen2, toy sizes), resumed without recomputing a finished run."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import polars as pl
import pytest
import torch

from tokendyn.analysis.study import (
    EXCLUDED,
    NO_DATA,
    NOT_REPRODUCED,
    NOT_RESOLVED,
    REPRODUCED,
    bootstrap_two_way,
    bootstrap_units,
    verdict,
)
from tokendyn.cli import main
from tokendyn.commands.study import QUICK, study
from tokendyn.commands.study_engine import DONE, with_size

torch.set_num_threads(1)


def test_degenerate_sample_gives_the_exact_interval():
    assert bootstrap_two_way(np.ones((3, 50))) == (1.0, 1.0, 1.0)
    assert bootstrap_two_way(np.zeros((2, 7)), n_boot=300) == (0.0, 0.0, 0.0)
    groups = [np.arange(0, 4), np.arange(4, 9)]
    values = np.full(9, 0.25)
    assert bootstrap_units(groups, lambda idx: values[idx].mean(), n_boot=200) == (0.25, 0.25, 0.25)
    # one unit resamples to a point: no interval when at least two are required
    est, lo, hi = bootstrap_units([np.array([0])], lambda idx: values[idx].mean(), min_units=2)
    assert est == 0.25 and np.isnan(lo) and np.isnan(hi) and verdict(lo, hi) == NO_DATA


def test_two_way_interval_covers_a_known_bernoulli_mean():
    """Seeds x puzzles of independent Bernoulli(p): the 95 % interval holds p in about 95 % of repetitions (the
    two-way bootstrap is slightly conservative with no seed effect: at least 90 %, and it is not the trivial [0, 1])."""
    rng = np.random.default_rng(1)
    p, hits, widths = 0.3, 0, []
    reps = 150
    for r in range(reps):
        x = (rng.random((3, 60)) < p).astype(float)
        _, lo, hi = bootstrap_two_way(x, n_boot=400, seed=r)
        hits += lo <= p <= hi
        widths.append(hi - lo)
    assert 0.90 <= hits / reps <= 1.0
    assert 0.05 < np.mean(widths) < 0.3  # ~ 2 * 1.96 * sqrt(p (1 - p) / 180) = 0.13, a little wider


def test_units_bootstrap_covers_a_known_ratio():
    """Correct-ratio style statistic (ratio of sums over probed steps of several seeds) on synthetic binomial counts
    with true ratio q: the interval covers q in most repetitions."""
    rng = np.random.default_rng(2)
    q, hits, reps = 0.55, 0, 60
    for r in range(reps):
        n = rng.integers(20, 60, 12)
        up = rng.binomial(n, q)
        groups = [np.arange(0, 4), np.arange(4, 8), np.arange(8, 12)]
        _, lo, hi = bootstrap_units(
            groups, lambda idx, up=up, n=n: up[idx].sum() / n[idx].sum(), n_boot=300, seed=r
        )
        hits += lo <= q <= hi
    assert hits / reps >= 0.85


@pytest.mark.parametrize(
    "lo, hi, paper, expected",
    [(0.01, 0.2, 0.1, REPRODUCED), (0.01, 0.02, 0.1, REPRODUCED), (-0.3, -0.01, 0.1, NOT_REPRODUCED),
     (-0.1, 0.1, 0.05, NOT_RESOLVED), (-0.1, 0.1, 0.1, NOT_RESOLVED), (-0.1, 0.09, 0.1, EXCLUDED),
     (0.0, 0.1, None, NOT_RESOLVED), (-0.1, 0.01, float("nan"), NOT_RESOLVED), (None, 0.1, 0.1, NO_DATA),
     (float("nan"), 1.0, 0.1, NO_DATA)],
)  # fmt: skip
def test_verdict_rule(lo, hi, paper, expected):
    """'not resolved' only when the interval holds both 0 and the paper's value; one wholly below the paper's value
    that holds 0 excludes the paper's effect without resolving the sign."""
    assert verdict(lo, hi, paper) == expected


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--methods", "grpo,ppo"], "methods: each must be one of grpo, reweight, lopti"),
        (["--seeds", "0,0"], "seeds: distinct integers >= 0"),
        (["--seeds", "-1"], "seeds: distinct integers >= 0"),
        (["--rollouts", "0"], "rollouts: must be an integer >= 1, got 0"),
        (["--eval-n", "101"], "eval_n: must be in 1..100"),
        (["--eval-people", "3,9"], "eval_people: every size must be in 2..8"),
    ],
)
def test_cli_rejects_bad_input_in_one_line(argv, message, tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["study", "--quick", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.slow_tier  # the slow tier: `make test-slow`
def test_quick_study_end_to_end_and_resume(tmp_path, capsys):
    """`tokendyn study --quick` on the embedded default (2 seeds x 3 methods x 1 rollout, ~50 s on one thread), then
    the same command again: every finished run is read back, none recomputed."""
    out = tmp_path / "study"
    assert main(["study", "--quick", "--out", str(out)]) == 0
    report = out / "study.md"
    assert str(report) in capsys.readouterr().out
    text = report.read_text()
    for section in ("## Accuracy", "## Per bin", "## What reproduces", "## Paired comparison per bin",
                    "fig3_correct_ratio.png"):  # fmt: skip
        assert section in text
    paired = pl.read_parquet(out / "tables" / "paired_bins.parquet")
    assert set(paired["rule"]) == {"reweight", "lopti"} and paired.height == 2 * 4
    walls = math.fsum(json.loads(m.read_text())["wall_time_s"] for m in out.rglob(DONE))
    stated = re.search(r"Wall time of its runs and evaluations: ([\d,]+) s\.", text)
    # (to the second: a sum in another order can round a .5 the other way)
    assert stated and abs(float(stated.group(1).replace(",", "")) - walls) <= 0.5 + 1e-6
    acc = pl.read_parquet(out / "tables" / "accuracy.parquet")
    assert set(acc["method"]) == {"start", "grpo", "reweight", "lopti"}
    assert ((acc["lo"] <= acc["accuracy"]) & (acc["accuracy"] <= acc["hi"])).all()
    assert set(pl.read_parquet(out / "tables" / "reproduces.parquet")["verdict"]) <= {
        REPRODUCED, NOT_REPRODUCED, EXCLUDED, NOT_RESOLVED, NO_DATA}  # fmt: skip
    bins = pl.read_parquet(out / "tables" / "bins.parquet")
    for method in ("grpo", "reweight", "lopti"):
        shares = bins.filter(pl.col("method") == method)["token_share"]
        assert shares.sum() == pytest.approx(1.0)
    assert (out / "figures" / "accuracy.png").is_file()
    markers = sorted(out.rglob(DONE))
    assert len(markers) == 2 + 3 * 2
    stamps = [m.stat().st_mtime_ns for m in markers]
    said = []
    study(out, QUICK, say=said.append)
    assert [m.stat().st_mtime_ns for m in markers] == stamps
    assert sum("done earlier" in s for s in said) == len(markers)
    # a part of the study (one method, one seed: how a study is split across processes) reuses the finished runs
    said = []
    study(out, with_size(QUICK, methods=("lopti",), seeds=(1,)), say=said.append)
    assert [m.stat().st_mtime_ns for m in markers] == stamps and sum("done earlier" in s for s in said) == 2
    # a finished run of a different study is refused before any work, naming the field that differs
    with pytest.raises(ValueError, match="rollouts 1 vs 2"):
        study(out, with_size(QUICK, rollouts=2), say=lambda m: None)
    assert json.loads(markers[0].read_text())["study"]["rollouts"] == 1
    # --report-only (one engine for every study) trains nothing and writes the same report from the folders
    report.unlink()
    assert main(["study", "--quick", "--out", str(out), "--report-only"]) == 0
    assert report.read_text() == text and [m.stat().st_mtime_ns for m in markers] == stamps


def test_paired_bins_table_is_the_pooled_ratio_difference():
    """Per remedy and bin: the paired estimate is sum(rose) / sum(decided) of the remedy's update minus the base's,
    pooled over every (seed, step) of GRPO's `paired` units; across runs, the remedy's runs minus GRPO's (written
    out here from the arrays); every estimate inside its interval."""
    from tokendyn.analysis.study import Unit, paired_bins_table

    rng = np.random.default_rng(5)
    bins = [(0.0, 0.5), (0.5, 1.0)]

    def counts(steps):
        d = rng.integers(30, 60, (steps, 2)).astype(float)
        return rng.binomial(d.astype(int), 0.6).astype(float), d

    seeds = np.array([0, 0, 0, 1, 1, 1])
    paired = {}
    for rule in ("base", "reweight", "lopti"):
        paired[f"up_pos_{rule}"], paired[f"d_pos_{rule}"] = counts(6)
    correct = {}
    for m in ("grpo", "reweight", "lopti"):
        up, d = counts(6)
        correct[m] = Unit(seeds, {"up_pos": up, "d_pos": d}, bins)
    units = {"grpo": {"paired": Unit(seeds, paired, bins), "correct": correct["grpo"]}}
    units.update({m: {"correct": correct[m]} for m in ("reweight", "lopti")})
    table = paired_bins_table(units, n_boot=300)
    assert table.height == 4 and set(table["rule"]) == {"reweight", "lopti"}
    for row in table.iter_rows(named=True):
        r, b = row["rule"], row["bin"]
        ratio = lambda up, d, b=b: up[:, b].sum() / d[:, b].sum()  # noqa: E731
        want = ratio(paired[f"up_pos_{r}"], paired[f"d_pos_{r}"]) - ratio(
            paired["up_pos_base"], paired["d_pos_base"]
        )
        assert row["paired"] == pytest.approx(want, abs=1e-12)
        c, g = correct[r].values, correct["grpo"].values
        assert row["across_runs"] == pytest.approx(
            ratio(c["up_pos"], c["d_pos"]) - ratio(g["up_pos"], g["d_pos"]), abs=1e-12
        )
        assert row["paired_lo"] <= row["paired"] <= row["paired_hi"]
        assert row["across_lo"] <= row["across_runs"] <= row["across_hi"]
        assert row["pi_old"] == ("[0, 0.5)" if b == 0 else "[0.5, 1]")


def test_markdown_keeps_pipes_inside_cells():
    from tokendyn.analysis.study import markdown

    text = markdown(pl.DataFrame({"claim": ["||g_b|| falls"], "value": [1e-5]}))
    row = text.splitlines()[2]
    assert row.count(" | ") == 1 and "\\|\\|g_b\\|\\|" in row and "1e-05" in row


def test_both_camps_compares_every_rule_in_the_grpo_runs_only_and_keeps_earlier_studies(tmp_path):
    """`tokendyn study --both-camps`: the GRPO runs compare both camps over 2 inner updates and sweep c and eta, the
    other methods compare nothing; a study without the option has the identity it had before the option existed
    (its finished runs are reused), one with it another identity."""
    from tokendyn.commands.study import KK
    from tokendyn.commands.study_engine import BOTH_CAMPS, identity, run_config
    from tokendyn.vocab import RULE_CAMPS

    size = with_size(QUICK, both_camps=True)
    _, grpo = run_config(KK, tmp_path / "g", "grpo", 0, size, None, {})
    _, lopti = run_config(KK, tmp_path / "l", "lopti", 0, size, None, {})
    camps = {RULE_CAMPS[r] for r in grpo.probe_compare_rules}
    assert camps == {"tames", "protects", "other"} and grpo.probe_compare_inner_steps == 2
    assert list(grpo.probe_compare_c_sweep) == BOTH_CAMPS["probe_compare_c_sweep"]
    assert min(grpo.probe_compare_c_sweep) < 0 < max(grpo.probe_compare_c_sweep)
    assert not lopti.probe_compare_rules and not lopti.probe_compare_c_sweep
    assert "both_camps" not in identity(KK, QUICK, None, {})
    assert identity(KK, size, None, {}) != identity(KK, QUICK, None, {})
