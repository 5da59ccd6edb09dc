"""The update share the sampler correction's mask removes per bin (`tokendyn.analysis.masked`), against a plain-Python
recomputation from the `paired` rows; the table `tokendyn analyze` prints. The end-to-end case (TRL + vLLM with
sequence_mask binding, the masked sequences matched to TRL's own zero weights) is in tests/test_vllm.py."""

from __future__ import annotations

import math
import random

import polars as pl

from tokendyn.analysis.masked import masked_share_table, masked_units
from tokendyn.analysis.mismatch_share import mismatched_share_table

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
                view.append({"step": step, "seq": seq, "pos": pos, "log_rho": rng.uniform(-0.3, 0.3)})
                for rule in ("base", "no_correction", "lopti"):
                    rules.append({"step": step, "seq": seq, "pos": pos, "rule": rule, "mode": "equal_norm",
                                  "share": rng.uniform(-0.02, 0.1)})  # fmt: skip
    view.append({"step": 2, "seq": 3, "pos": 9, "log_rho": None})  # no sampler log-prob: left out
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
