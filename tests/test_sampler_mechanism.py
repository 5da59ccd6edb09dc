"""The mechanism tables (`tokendyn.analysis.sampler_mechanism`) against plain loops and numpy, and on committed runs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from tokendyn.analysis.sampler_mechanism import carried_by_bin, sequence_weights, weight_reward_stats

ROOT = Path(__file__).resolve().parents[1]


def _view(rng: np.random.Generator, steps=(0, 4), seqs=3, pos=5) -> pl.DataFrame:
    rows = []
    for s in steps:
        for q in range(seqs):
            for p in range(pos):
                rows.append(
                    {
                        "step": s,
                        "seq": q,
                        "pos": p,
                        "bin": int(rng.integers(0, 4)),
                        "log_rho": float(rng.normal(0, 0.15)) if rng.random() > 0.1 else None,
                        "share": float(rng.normal(0, 0.05)),
                    }
                )
    return pl.DataFrame(rows)


def test_carried_by_bin_matches_a_plain_loop():
    rng = np.random.default_rng(3)
    view = _view(rng)
    rules = pl.DataFrame(
        [
            {
                **{k: r[k] for k in ("step", "seq", "pos")},
                "rule": rule,
                "mode": "equal_norm",
                "share": float(rng.normal(0, 0.05)),
                "delta_pi": 0.0,
            }
            for r in view.iter_rows(named=True)
            for rule in ("base", "reweight")
        ]
    )
    got = carried_by_bin(view, rules)
    steps = 2
    shares = {("own", (r["step"], r["seq"], r["pos"])): r["share"] for r in view.iter_rows(named=True)}
    shares.update(
        {(r["rule"], (r["step"], r["seq"], r["pos"])): r["share"] for r in rules.iter_rows(named=True)}
    )
    want = {}
    for r in view.iter_rows(named=True):
        if r["log_rho"] is None or abs(r["log_rho"]) <= math.log(1.1):
            continue
        for rule in ("own", "base", "reweight"):
            key = (rule, r["bin"])
            want[key] = want.get(key, 0.0) + shares[(rule, (r["step"], r["seq"], r["pos"]))] / steps
    for row in got.iter_rows(named=True):
        assert row["carried"] == pytest.approx(want.get((row["rule"], row["bin"]), 0.0), abs=1e-12)
        if row["rule"] == "reweight":
            base = want.get(("base", row["bin"]), 0.0)
            assert row["minus_base"] == pytest.approx(
                want.get(("reweight", row["bin"]), 0.0) - base, abs=1e-12
            )
        if row["rule"] == "own":
            assert row["minus_base"] is None
    assert set(got["rule"]) == {"own", "base", "reweight"}


def test_carried_by_bin_is_empty_without_a_sampler():
    view = _view(np.random.default_rng(0)).with_columns(pl.lit(None, dtype=pl.Float64).alias("log_rho"))
    assert carried_by_bin(view).height == 0


def test_weight_reward_stats_match_numpy():
    rng = np.random.default_rng(1)
    n = 40
    adv = rng.normal(size=n).round(1)
    adv[:5] = 0.0  # no signal: left out
    weight = np.clip(1 + 0.3 * rng.normal(size=n), 0, None)
    weight[7] = 0.0  # a masked sequence
    key = {"step": 0, "stage": "train", "rank": 0, "micro": 0}
    sampler = pl.DataFrame(
        [{**key, "row": q, "pos": p, "is_weight": float(weight[q])} for q in range(n) for p in range(3)]
    )
    tokens = pl.DataFrame(
        [{**key, "row": q, "pos": p, "advantage": float(adv[q])} for q in range(n) for p in range(3)]
    )
    stats = weight_reward_stats(sequence_weights(sampler, tokens))
    sig = adv != 0
    assert stats["sequences"] == int(sig.sum())
    assert stats["r"] == pytest.approx(np.corrcoef(weight[sig], adv[sig])[0, 1], rel=1e-12)
    assert stats["removed_pos"] == pytest.approx(float(np.mean(1 - weight[adv > 0])), rel=1e-12)
    assert stats["removed_neg"] == pytest.approx(float(np.mean(1 - weight[adv < 0])), rel=1e-12)


def test_weight_reward_r_is_null_without_spread():
    key = {"step": 0, "stage": "train", "rank": 0, "micro": 0, "pos": 0}
    sampler = pl.DataFrame([{**key, "row": q, "is_weight": 1.0} for q in range(4)])
    tokens = pl.DataFrame([{**key, "row": q, "advantage": a} for q, a in enumerate([1.0, -1.0, 0.5, -0.5])])
    assert weight_reward_stats(sequence_weights(sampler, tokens))["r"] is None


def test_on_a_committed_bf16_run():
    """A GRPO run under vLLM bf16: mismatched tokens exist, the rules compared from its states are there, and the
    weights of its sequences are not all 1."""
    records = ROOT / "docs/study/llm-vllm/runs/grpo_vllm_bf16-s2/records"
    if not records.is_dir():
        pytest.skip("the committed study run is not in this checkout")

    def read(kind: str) -> pl.DataFrame:
        return pl.concat(
            [pl.read_parquet(f) for f in sorted(records.glob(f"{kind}-*"))], how="diagonal_relaxed"
        )

    table = carried_by_bin(read("token_view"), read("token_view_rules"))
    assert {"base", "reweight", "lopti"} <= set(table["rule"])
    assert table["mismatched"].sum() > 0
    stats = weight_reward_stats(sequence_weights(read("sampler"), read("tokens")))
    assert stats["sequences"] > 0 and stats["r"] is not None
