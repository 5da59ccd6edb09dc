"""The update share the sampler correction's mask removes per bin (`tokendyn.analysis.masked`), against a plain-Python
recomputation from the `paired` rows; the table `tokendyn analyze` prints. The end-to-end case (TRL + vLLM with
sequence_mask binding, the masked sequences matched to TRL's own zero weights) is in tests/test_vllm.py."""

from __future__ import annotations

import math
import random

import polars as pl
import pytest

from tokendyn.analysis.masked import masked_share_table, masked_units, unpaired_units
from tokendyn.analysis.mismatch_share import mismatched_share_table
from tokendyn.common import UsageError

EDGES = (0.0, 0.25, 0.5, 0.75, 1.0)


def _paired(masked: set[tuple[int, int]], silent: set[tuple[int, int]], seed: int = 0) -> pl.DataFrame:
    """Rows of 2 steps x 5 sequences x 4 bins for rules base, no_correction, reweight: a masked unit carries nothing
    under base, a silent one (no signal) nothing under any rule."""
    rng = random.Random(seed)
    rows = []
    for rule in ("base", "no_correction", "reweight"):
        for step in (0, 3):
            for seq in range(5):
                for b in range(4):
                    share = rng.uniform(-0.05, 0.2)
                    if (step, seq) in silent or (rule == "base" and (step, seq) in masked):
                        share = 0.0
                    rows.append({"rule": rule, "mode": "equal_norm", "step": step, "seq": seq, "bin": b,
                                 "bin_lo": EDGES[b], "bin_hi": EDGES[b + 1], "count": rng.randint(1, 9),
                                 "sum_share": share, "sweep": None})  # fmt: skip
    return pl.DataFrame(rows)


def test_the_removed_share_is_the_masked_sequences_uncorrected_share():
    masked, silent = {(0, 1), (3, 4)}, {(0, 2)}
    frame = _paired(masked, silent)
    assert sorted(masked_units(frame, "equal_norm").iter_rows()) == sorted(
        masked
    )  # the silent one is not masked
    table = masked_share_table(frame, n_boot=200)
    rows = [r for r in frame.iter_rows(named=True) if r["rule"] == "no_correction"]
    for b in (0, 1, 2, 3, -1):
        mine = [r for r in rows if b == -1 or r["bin"] == b]
        removed = sum(r["sum_share"] for r in mine if (r["step"], r["seq"]) in masked) / 2
        whole = sum(r["sum_share"] for r in mine) / 2
        got = table.filter(pl.col("bin") == b).row(0, named=True)
        assert math.isclose(got["removed"], removed, rel_tol=1e-12), b
        assert math.isclose(got["of_bin"], removed / whole, rel_tol=1e-12), b
        assert got["removed_lo"] <= got["removed"] <= got["removed_hi"]
        assert got["masked_units"] == 2 and got["units"] == 10 and got["steps"] == 2
        assert got["tokens_masked"] == sum(r["count"] for r in mine if (r["step"], r["seq"]) in masked)


def test_nothing_masked_removes_nothing_and_no_rule_gives_no_table():
    table = masked_share_table(_paired(set(), {(0, 2)}), n_boot=100)
    assert table["removed"].to_list() == [0.0] * 5 and table["removed_hi"].to_list() == [0.0] * 5
    assert table["masked_units"].to_list() == [0] * 5
    assert masked_share_table(_paired(set(), set()).filter(pl.col("rule") != "no_correction")).height == 0


def test_the_mismatched_tokens_share_is_their_sum_over_the_view():
    """`mismatched_share_table` against a plain sum: the tokens with |log rho| > tau, each rule's shares of them."""
    rng = random.Random(1)
    view, rules = [], []
    for step in (0, 2):
        for seq in range(4):
            for pos in range(5):
                view.append({"step": step, "stage": "train", "seq": seq, "pos": pos,
                             "log_rho": rng.uniform(-0.3, 0.3)})  # fmt: skip
                for rule in ("base", "no_correction", "lopti"):
                    rules.append({"step": step, "stage": "train", "seq": seq, "pos": pos, "rule": rule,
                                  "mode": "equal_norm", "share": rng.uniform(-0.02, 0.1)})  # fmt: skip
    view.append(
        {"step": 2, "stage": "train", "seq": 3, "pos": 9, "log_rho": None}
    )  # no sampler log-prob: left out
    table = mismatched_share_table(pl.DataFrame(view), pl.DataFrame(rules), tau=0.1, n_boot=200)
    hot = {
        (v["step"], v["seq"], v["pos"]) for v in view if v["log_rho"] is not None and abs(v["log_rho"]) > 0.1
    }

    def carried(rule):
        return (
            sum(r["share"] for r in rules if r["rule"] == rule and (r["step"], r["seq"], r["pos"]) in hot) / 2
        )

    for rule in ("base", "no_correction", "lopti"):
        got = table.filter(pl.col("rule") == rule).row(0, named=True)
        assert math.isclose(got["mismatched_share"], carried(rule), rel_tol=1e-12)
        assert math.isclose(got["minus_base"], carried(rule) - carried("base"), rel_tol=1e-12, abs_tol=1e-15)
        assert (
            got["mismatched"] == len(hot) and got["tokens"] == 40 and got["token_fraction"] == len(hot) / 40
        )
        assert got["mismatched_share_lo"] <= got["mismatched_share"] <= got["mismatched_share_hi"]
    assert mismatched_share_table(pl.DataFrame(view).drop("log_rho"), pl.DataFrame(rules)).height == 0


def test_a_unit_without_base_rows_is_left_out_not_masked():
    """A sequence whose base-rule rows are missing is unknown: not masked (a left join filled with 0 would call
    it masked), out of every sum, and counted in excluded_units; the rest against the plain sum over the others."""
    masked, gone = {(0, 1)}, (3, 2)
    frame = _paired(masked, set()).filter(
        ~((pl.col("rule") == "base") & (pl.col("step") == gone[0]) & (pl.col("seq") == gone[1]))
    )
    assert sorted(masked_units(frame, "equal_norm").iter_rows()) == sorted(masked)
    assert unpaired_units(frame, "equal_norm").rows() == [gone]
    table = masked_share_table(frame, n_boot=100)
    rows = [r for r in frame.iter_rows(named=True)
            if r["rule"] == "no_correction" and (r["step"], r["seq"]) != gone]  # fmt: skip
    got = table.filter(pl.col("bin") == -1).row(0, named=True)
    removed = sum(r["sum_share"] for r in rows if (r["step"], r["seq"]) in masked) / 2
    assert math.isclose(got["removed"], removed, rel_tol=1e-12)
    assert math.isclose(got["of_bin"], removed / (sum(r["sum_share"] for r in rows) / 2), rel_tol=1e-12)
    assert (got["units"], got["masked_units"], got["excluded_units"]) == (9, 1, 1)
    only_rule = _paired(set(), set()).filter(pl.col("rule") != "base")  # no base rule at all: unknown
    table = masked_share_table(only_rule, n_boot=20)
    assert table["removed"].null_count() == table.height and table["excluded_units"].to_list() == [10] * 5


def _view_and_rules(rng, stages=("train",)):
    view, rules = [], []
    for step in (0, 2):
        for stage in stages:
            for seq in range(3):
                for pos in range(4):
                    view.append({"step": step, "stage": stage, "seq": seq, "pos": pos,
                                 "log_rho": rng.uniform(-0.3, 0.3)})  # fmt: skip
                    for rule in ("base", "lopti"):
                        rules.append({"step": step, "stage": stage, "seq": seq, "pos": pos, "rule": rule,
                                      "mode": "equal_norm", "share": rng.uniform(-0.02, 0.1)})  # fmt: skip
    return pl.DataFrame(view), pl.DataFrame(rules)


def test_the_mismatched_share_joins_on_the_stage_and_a_missing_base_is_null():
    """Two stages at each step (the same positions): each rule's share is matched to its own stage's tokens (a join
    without the stage would pair every token with both stages' shares); a base rule missing at one unit makes
    minus_base null and is counted, not read as a zero share."""
    view, rules = _view_and_rules(random.Random(2), stages=("low", "high"))
    table = mismatched_share_table(view, rules, tau=0.1, n_boot=50)
    key = ["step", "stage", "seq", "pos"]
    hot = {tuple(r[k] for k in key) for r in view.iter_rows(named=True) if abs(r["log_rho"]) > 0.1}

    def carried(rows, rule):
        return sum(r["share"] for r in rows.iter_rows(named=True)
                   if r["rule"] == rule and tuple(r[k] for k in key) in hot) / 2  # fmt: skip

    for rule in ("base", "lopti"):
        got = table.filter(pl.col("rule") == rule).row(0, named=True)
        assert math.isclose(got["mismatched_share"], carried(rules, rule), rel_tol=1e-12)
        assert got["units"] == 12 and got["tokens"] == 48 and got["units_without_base"] == 0
    lopti = table.filter(pl.col("rule") == "lopti").row(0, named=True)
    assert math.isclose(lopti["minus_base"], carried(rules, "lopti") - carried(rules, "base"), rel_tol=1e-12)
    holed = rules.filter(~((pl.col("rule") == "base") & (pl.col("step") == 2) & (pl.col("stage") == "high")
                           & (pl.col("seq") == 1)))  # fmt: skip
    lopti = (
        mismatched_share_table(view, holed, tau=0.1, n_boot=50)
        .filter(pl.col("rule") == "lopti")
        .row(0, named=True)
    )
    assert lopti["minus_base"] is None and lopti["minus_base_lo"] is None and lopti["units_without_base"] == 1
    assert math.isclose(lopti["mismatched_share"], carried(rules, "lopti"), rel_tol=1e-12)
    no_base = mismatched_share_table(view, rules.filter(pl.col("rule") != "base"), tau=0.1, n_boot=20)
    assert no_base["minus_base"].to_list() == [None] and no_base["units_without_base"].to_list() == [12]


def test_rules_recorded_without_their_stage_take_the_views():
    """`token_view_rules` written before it carried its stage: the view's stage at the step when it is one."""
    view, rules = _view_and_rules(random.Random(3))
    old = mismatched_share_table(view, rules.drop("stage"), tau=0.1, n_boot=20)
    assert old.equals(mismatched_share_table(view, rules, tau=0.1, n_boot=20))
    two, rules2 = _view_and_rules(random.Random(3), stages=("low", "high"))
    with pytest.raises(UsageError, match="^token_view_rules: no stage column"):
        mismatched_share_table(two, rules2.drop("stage"))
