"""The split by the sign of the advantage (`tokendyn.analysis.sign_split`) against plain Python loops over synthetic
records whose truth is known: the sampler's mismatch joined to the token sample on the exact keys (unmatched tokens
counted, never given an advantage), and the update share by sign where the sample holds whole bins; then the live
scalars (`tokendyn.hooks.live_mismatch`) through `LiveProbeMetrics` reading record files as they land."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import polars as pl
import pytest

from tokendyn.analysis.sign_split import mismatch_by_sign, sign_of, update_share_by_sign
from tokendyn.common import UsageError
from tokendyn.records import SCHEMAS, to_frame, write_frames

PI_EDGES = (0.0, 0.25, 0.5, 0.75, 1.0)


def ref_bin(p: float) -> int:
    for b in range(4):
        if p < PI_EDGES[b + 1]:
            return b
    return 3


def full(kind: str, cols: dict) -> pl.DataFrame:
    n = len(next(iter(cols.values())))
    return to_frame(kind, {c: cols.get(c, [None] * n) for c in SCHEMAS[kind]})


def synthetic(seed: int = 0):
    """(sampler rows, tokens rows, the truth {key: (pi, log rho, advantage or None)} of the sampled keys): two
    micro-batches of 6 rows x 8 positions; the sample holds about half the tokens (with three probe points each, and
    some keys the sampler never saw); advantages per row in {-1, 0, 0.5, None}."""
    rng = random.Random(seed)
    sampler, tokens, truth = [], [], {}
    adv = {(m, r): rng.choice([-1.0, 0.0, 0.5, 0.0, None]) for m in range(2) for r in range(6)}
    for m in range(2):
        for r in range(6):
            for pos in range(8):
                p = rng.choice([rng.uniform(0.01, 0.99), 1.0])
                lr = rng.gauss(0, 0.05)
                key = (4, "train", 0, m, r, pos)
                sampler.append((*key, math.log(p), lr))
                if rng.random() < 0.5:
                    truth[key] = (p, lr, adv[(m, r)])
                    for point in ("layers.0.out", "layers.1.out", "final_norm.out"):
                        tokens.append((*key, adv[(m, r)], point))
    tokens += [
        (4, "train", 0, 9, 0, 0, 1.0, "final_norm.out"),
        (5, "train", 0, 0, 0, 0, -1.0, "final_norm.out"),
    ]
    keys = ("step", "stage", "rank", "micro", "row", "pos")
    s = {k: [row[i] for row in sampler] for i, k in enumerate(keys)}
    s.update(logp_old=[row[6] for row in sampler], log_rho=[row[7] for row in sampler])
    s["logp_sampler"] = [o - x for o, x in zip(s["logp_old"], s["log_rho"], strict=True)]
    t = {k: [row[i] for row in tokens] for i, k in enumerate(keys)}
    t.update(advantage=[row[6] for row in tokens], point=[row[7] for row in tokens])
    return full("sampler", s), full("tokens", t), truth, len(sampler)


def test_sign_of_every_case():
    assert [sign_of(a) for a in (2.0, -1e-30, 0.0, -0.0, None, float("nan"))] == [
        "pos", "neg", "zero", "zero", None, None]  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mismatch_by_sign_against_a_plain_loop(seed):
    s, t, truth, n = synthetic(seed)
    table = mismatch_by_sign(s, t)
    bins_of = {}
    for row in s.iter_rows(named=True):
        bins_of.setdefault(ref_bin(math.exp(row["logp_old"])), []).append(row)
    for b in range(-1, 4):
        rows = table.filter(pl.col("bin") == b)
        matched = {k: v for k, v in truth.items() if b < 0 or ref_bin(v[0]) == b}
        n_bin = n if b < 0 else len(bins_of.get(b, []))
        assert set(rows["sampler_tokens"]) == {n_bin} and set(rows["matched"]) == {len(matched)}
        assert set(rows["unmatched"]) == {n_bin - len(matched)}
        signs = {sign_of(a) for _, _, a in matched.values()}
        assert set(rows["sign"].to_list()) == {"pos", "neg", "zero"} | ({None} if None in signs else set())
        for r in rows.iter_rows(named=True):
            mine = [lr for _, lr, a in matched.values() if sign_of(a) == r["sign"]]
            assert r["count"] == len(mine), (b, r["sign"])
            if mine:
                assert r["mean_log_rho"] == pytest.approx(sum(mine) / len(mine), rel=1e-12)
                assert r["abs_mean"] == pytest.approx(sum(abs(x) for x in mine) / len(mine), rel=1e-12)
            else:
                assert r["mean_log_rho"] is None and r["abs_mean"] is None


def test_without_tokens_every_sampler_token_is_unmatched():
    s, _, _, n = synthetic(0)
    table = mismatch_by_sign(s, None)
    every = table.filter(pl.col("bin") == -1)
    assert set(every["unmatched"]) == {n} and every["count"].sum() == 0
    assert table["abs_mean"].null_count() == table.height  # unknown, never 0


def test_two_advantages_at_one_key_is_one_line_naming_the_field():
    s, t, _, _ = synthetic(0)
    bad = pl.concat([t, t.head(1).with_columns(pl.lit(7.0).alias("advantage"), pl.lit("x").alias("point"))])
    with pytest.raises(UsageError, match="advantage") as err:
        mismatch_by_sign(s, bad)
    assert "\n" not in str(err.value)


def shares_records(complete: dict[tuple[int, int], bool], seed: int = 0):
    """token_shares and shares of 2 steps x 4 bins, every unit's shares summing to 1; a bin sampled whole where
    ``complete`` says so, else one of its tokens left out of the sample. Returns (token_shares, shares, truth) with
    truth[(step, bin, sign)] = the exact sum over the bin's tokens of that sign."""
    rng = random.Random(seed)
    ts, sh, truth = [], [], {}
    for step in (0, 2):
        tokens = [(b, rng.choice([-1.0, 0.0, 1.0]), rng.uniform(-1, 2)) for b in range(4) for _ in range(5)]
        total = sum(x for *_, x in tokens)
        tokens = [(b, a, x / total) for b, a, x in tokens]
        for b in range(4):
            mine = [tok for tok in tokens if tok[0] == b]
            for a in (-1.0, 0.0, 1.0):
                truth[(step, b, sign_of(a))] = sum(x for _, aa, x in mine if aa == a)
            kept = mine if complete.get((step, b), True) else mine[1:]
            ts += [(step, b, a, x) for _, a, x in kept]
            sh.append((step, b, len(mine)))
    cols = {"step": [r[0] for r in ts], "stage": ["train"] * len(ts), "row": list(range(len(ts))),
            "pos": [0] * len(ts), "bin": [r[1] for r in ts], "bin_lo": [PI_EDGES[r[1]] for r in ts],
            "bin_hi": [PI_EDGES[r[1] + 1] for r in ts], "advantage": [r[2] for r in ts], "share": [r[3] for r in ts]}  # fmt: skip
    scols = {"step": [r[0] for r in sh], "stage": ["train"] * len(sh), "bin": [r[1] for r in sh],
             "bin_lo": [PI_EDGES[r[1]] for r in sh], "bin_hi": [PI_EDGES[r[1] + 1] for r in sh],
             "group": ["all"] * len(sh), "count": [r[2] for r in sh]}  # fmt: skip
    return full("token_shares", cols), full("shares", scols), truth


def test_update_share_by_sign_exact_where_the_sample_is_whole():
    ts, sh, truth = shares_records({(2, 1): False})
    table = update_share_by_sign(ts, sh)
    for r in table.iter_rows(named=True):
        assert r["units"] == 2
        if r["bin"] in (1, -1):  # bin 1 lost a token at step 2: its sum is a sample's, not the share
            assert r["share"] is None and r["complete_units"] == 1
            continue
        want = sum(truth[(step, r["bin"], r["sign"])] for step in (0, 2)) / 2
        assert r["complete_units"] == 2 and r["share"] == pytest.approx(want, abs=1e-12)
    whole = update_share_by_sign(*shares_records({})[:2])
    every = whole.filter(pl.col("bin") == -1)
    assert every["share"].sum() == pytest.approx(1.0)  # the shares of a unit sum to 1, averaged over units
    assert whole.filter(pl.col("bin") >= 0)["share"].sum() == pytest.approx(1.0)


def test_update_share_without_shares_records_is_null():
    ts, _, _ = shares_records({})
    table = update_share_by_sign(ts, None)
    assert table.height and table["share"].null_count() == table.height
    assert update_share_by_sign(None, None).height == 0


def test_live_scalars_from_the_record_files(tmp_path):
    """`LiveProbeMetrics.on_log` reads the files as they land: the tail at 1.1 and the recorded clip_max, the
    mismatch by sign (the tokens file of the same flush joined) and the update share by sign."""
    from tokendyn.analysis.mismatch_tail import mismatch_tail
    from tokendyn.hooks.live import LiveProbeMetrics
    from tokendyn.hooks.live_mismatch import config_of

    args = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                           vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max=3.0,
                           vllm_importance_sampling_clip_min=None)  # fmt: skip
    live = LiveProbeMetrics(tmp_path, config_of(args))
    live.on_train_begin(None, None, None)
    s, t, _, _ = synthetic(1)
    ts, sh, _ = shares_records({})
    write_frames(tmp_path, {"sampler": s, "tokens": t, "token_shares": ts, "shares": sh}, rank=0)
    logs: dict = {}
    live.on_log(None, SimpleNamespace(is_world_process_zero=True), None, logs=logs)
    tail = mismatch_tail(s, config_of(args))
    for tau, src in (("1.1", "fixed"), ("3", "clip_max")):
        r = tail.filter((pl.col("source") == src) & (pl.col("bin") == 0)).row(0, named=True)
        assert logs[f"probe/sampler/tail_above/{tau}/bin0"] == r["above"]
    every = tail.filter((pl.col("source") == "fixed") & (pl.col("bin") == -1))
    assert logs["probe/sampler/tail_below/0.909091/all"] == every["below"][0]  # rho < 1/1.1
    assert not [k for k in logs if k.startswith("probe/sampler/tail_below/3/")]  # a clip_max row has no below
    sign = mismatch_by_sign(s, t)
    r = sign.filter((pl.col("bin") == -1) & (pl.col("sign") == "neg")).row(0, named=True)
    assert logs["probe/sampler/abs_mean/neg/all"] == r["abs_mean"]
    assert logs["probe/sampler/mean_log_rho/neg/all"] == r["mean_log_rho"]
    latest = pl.col("step") == 2  # the file holds steps 0 and 2: the live scalar is the latest step's
    upd = update_share_by_sign(ts.filter(latest), sh.filter(latest))
    upd = upd.filter((pl.col("bin") == 2) & (pl.col("sign") == "pos"))
    assert logs["probe/update_share/pos/bin2"] == upd["share"][0]
    with pytest.raises(UsageError, match="vllm_importance_sampling_clip_max"):
        config_of(SimpleNamespace(**{**vars(args), "vllm_importance_sampling_clip_max": -2.0}))


def test_advantage_is_the_first_non_null_over_the_points():
    """A key whose first probe point holds a null advantage and a later one the value: the value, not the null."""
    from tokendyn.analysis.sign_split import advantages

    keys = {
        "step": [4] * 3,
        "stage": ["train"] * 3,
        "rank": [0] * 3,
        "micro": [0] * 3,
        "row": [1] * 3,
        "pos": [2] * 3,
    }
    t = full(
        "tokens", {**keys, "advantage": [None, -0.5, None], "point": ["layers.0.out", "layers.1.out", "x"]}
    )
    assert advantages(t)["advantage"].to_list() == [-0.5]
    s = full("sampler", {**{k: v[:1] for k, v in keys.items()}, "logp_old": [math.log(0.3)], "log_rho": [0.2],
                         "logp_sampler": [math.log(0.3) - 0.2]})  # fmt: skip
    neg = mismatch_by_sign(s, t).filter((pl.col("bin") == -1) & (pl.col("sign") == "neg"))
    assert neg["count"].to_list() == [1] and neg["mean_log_rho"][0] == pytest.approx(0.2)


def _log(live) -> dict:
    logs: dict = {}
    live.on_log(None, SimpleNamespace(is_world_process_zero=True), None, logs=logs)
    return logs


def test_live_joins_rows_that_land_in_different_flushes(tmp_path):
    """Step 4's sampler rows land (and are logged) a flush before its tokens rows; a Lopti step's stage-high shares
    land in a file after the stage-low ones: the sign split and the update share by sign of both stages still appear,
    each against a plain loop over the truth."""
    from tokendyn.hooks.live import LiveProbeMetrics

    live = LiveProbeMetrics(tmp_path, None)
    live.on_train_begin(None, None, None)
    s, t, truth, _ = synthetic(2)
    stages = {}
    for stage, seed in (("low", 0), ("high", 1)):
        ts, sh, want = shares_records({}, seed=seed)
        relabel = (pl.col("step") == 2, pl.lit(stage).alias("stage"))
        stages[stage] = (
            ts.filter(relabel[0]).with_columns(relabel[1]),
            sh.filter(relabel[0]).with_columns(relabel[1]),
            want,
        )
    write_frames(tmp_path, {"sampler": s, "shares": stages["low"][1]}, rank=0)
    _log(live)
    write_frames(tmp_path, {"tokens": t}, rank=0)  # the probe's rows of the same step, a later flush
    write_frames(tmp_path, {"shares": stages["high"][1]}, rank=0)  # stage 2's shares: a second file
    write_frames(tmp_path, {"token_shares": pl.concat([stages["low"][0], stages["high"][0]])}, rank=0)
    logs = _log(live)
    for b in range(-1, 4):
        tag = "all" if b < 0 else f"bin{b}"
        for sign in ("pos", "neg", "zero"):
            mine = [lr for p, lr, a in truth.values() if (b < 0 or ref_bin(p) == b) and sign_of(a) == sign]
            if not mine:
                assert f"probe/sampler/abs_mean/{sign}/{tag}" not in logs
                continue
            assert logs[f"probe/sampler/mean_log_rho/{sign}/{tag}"] == pytest.approx(sum(mine) / len(mine))
            assert logs[f"probe/sampler/abs_mean/{sign}/{tag}"] == pytest.approx(
                sum(abs(x) for x in mine) / len(mine)
            )
            for stage, (_, _, want) in stages.items():
                share = sum(want[(2, k, sign)] for k in range(4)) if b < 0 else want[(2, b, sign)]
                assert logs[f"probe/update_share/{stage}/{sign}/{tag}"] == pytest.approx(share, abs=1e-12)


def test_a_failing_live_family_is_one_warning_not_a_crash(tmp_path, caplog):
    """Tokens records whose probe points disagree on an advantage make the sign split raise: `on_log` returns, the
    other families are logged, and one warning line names the family and the error."""
    import logging

    from tokendyn.hooks.live import LiveProbeMetrics

    live = LiveProbeMetrics(tmp_path, None)
    live.on_train_begin(None, None, None)
    s, t, _, _ = synthetic(0)
    bad = pl.concat([t, t.head(1).with_columns(pl.lit(7.0).alias("advantage"), pl.lit("x").alias("point"))])
    write_frames(tmp_path, {"sampler": s, "tokens": bad}, rank=0)
    with caplog.at_level(logging.WARNING):
        logs = _log(live)
    assert "probe/sampler/tail_above/1.1/all" in logs and "probe/sampler/mean_log_rho/all" in logs
    assert not [k for k in logs if "/pos/" in k or "/neg/" in k]
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "sign_metrics" in lines[0] and "advantage differs" in lines[0]
    assert "\n" not in lines[0]
