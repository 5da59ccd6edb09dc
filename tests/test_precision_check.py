"""step_precision "measured" (tokendyn.effects.precision): the check's arithmetic against rows made by hand, a check
step's records bitwise the float64 path's, the verdict steering the next steps, and the records of a real run."""

from __future__ import annotations

import copy
import math
import warnings

import polars as pl
import pytest
import torch
from test_step_resolution import policy_batch  # noqa: F401  (the shipped float32 policy and 16 of its samples)

from tokendyn.effects.precision import MeasuredPrecision, compare_update, precision_check
from tokendyn.effects.rebalance import RebalanceOptions, analyze_batch

torch.set_num_threads(1)
STATS = ("mean", "std", "mean_abs", "min", "q01", "q05", "q25", "q50", "q75", "q95", "q99", "max")


def _row(dpi: list[float], adv: list[float]) -> dict:
    """A bin's statistics written out from its tokens' dpi and advantages (quantiles: nearest-rank by hand)."""
    x = sorted(dpi)
    n = len(x)

    def q(p):
        return x[min(n - 1, round(p * (n - 1)))]

    pos = [d for d, a in zip(dpi, adv, strict=True) if a > 0]
    neg = [d for d, a in zip(dpi, adv, strict=True) if a < 0]
    tie_p, tie_n = sum(d == 0 for d in pos), sum(d == 0 for d in neg)
    up, down = sum(d > 0 for d in pos), sum(d < 0 for d in neg)
    mean = sum(x) / n
    return {
        "mean": mean, "std": math.sqrt(sum((v - mean) ** 2 for v in x) / n), "mean_abs": sum(map(abs, x)) / n,
        "min": x[0], "q01": q(.01), "q05": q(.05), "q25": q(.25), "q50": q(.5), "q75": q(.75), "q95": q(.95),
        "q99": q(.99), "max": x[-1], "n_pos": len(pos), "n_neg": len(neg), "tie_pos": tie_p, "tie_neg": tie_n,
        "correct_pos": up / (len(pos) - tie_p), "correct_neg": down / (len(neg) - tie_n),
        "correct_pooled": (up + down) / (len(pos) + len(neg) - tie_p - tie_n),
    }  # fmt: skip


ADV = [1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0]
REF = [0.2, 0.01, -0.05, -0.3, 0.04, -0.02, 0.1, -0.01, 0.003, -0.5]


def test_the_check_against_rows_made_by_hand():
    ref = [_row(REF, ADV)]
    same = compare_update(ref, [_row(REF, ADV)])
    assert same["agreed"] and same["rel_diff"] == 0 and same["scale"] == 0.5
    # every token 0.1 % of the largest |dpi| off: the largest statistic's difference is that
    close = compare_update(ref, [_row([d + 5e-4 for d in REF], ADV)])
    assert close["agreed"] and close["rel_diff"] == pytest.approx(1e-3, rel=1e-6)
    assert close["max_abs_diff"] == pytest.approx(5e-4, rel=1e-6)
    # 2 % off: beyond the 0.5 % kept
    far = compare_update(ref, [_row([d * 1.02 for d in REF], ADV)])
    assert not far["agreed"] and far["rel_diff"] == pytest.approx(0.02, rel=1e-6)  # max: -0.5 -> -0.51
    # one token of the bin flips (the smallest, 0.003 -> -0.003): a ratio moves by one token, kept
    one = REF.copy()
    one[8] = -0.003
    flip = compare_update(ref, [_row(one, ADV)])
    assert flip["agreed"] and flip["ratio_tokens"] == pytest.approx(1.0)
    # two tokens flip: not kept
    two = one.copy()
    two[7] = 0.01
    flips = compare_update(ref, [_row(two, ADV)])
    assert not flips["agreed"] and flips["ratio_tokens"] == pytest.approx(2.0)
    # the sign of a bin's mean above tol * scale turns: not kept, however small the difference
    mean_ref = {**ref[0], "mean": 0.01}
    turned = compare_update([mean_ref], [{**mean_ref, "mean": -0.0001}])
    assert not turned["signs_equal"] and not turned["agreed"]
    # a statistic null one way only (every token a tie in the model's dtype): not kept
    tied = compare_update(ref, [{**ref[0], "correct_pos": float("nan")}])
    assert not tied["nulls_equal"] and not tied["agreed"]


def _cut(frames: dict, kind: str) -> pl.DataFrame:
    return frames[kind].drop("stage")


@pytest.mark.parametrize("lr, agreed", [(1e-3, False), (1e-1, True)])
def test_a_check_step_reports_the_float64_records_and_steers_the_next(policy_batch, lr, agreed):  # noqa: F811
    """On the shipped float32 policy: a check step's records are the float64_step path's (float32 gradient, float64
    step), bitwise, and the all-float64 path's within the float32 gradient's rounding; its check is the difference
    of the two ways made separately; at lr 1e-3 float32 steps move correct ratios by up to 3 tokens (not kept), at
    lr 0.1 they agree within 1e-4 (kept); the next analysed step then steps in the chosen way, and the one after the
    schedule's period is a check again."""
    model, batch = policy_batch
    b = batch.select(slice(0, 4))
    base = dict(token_shares=0, view_sequences=0, lr=lr, lr_sweep=(lr,))
    state = MeasuredPrecision(every=2)
    measured = RebalanceOptions(**base, step_precision="measured")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (float32 steps below their rounding warn)
        got = analyze_batch(model, b, step=0, options=measured, precision_state=state)
        f64 = analyze_batch(model, b, step=0, options=RebalanceOptions(**base, step_precision="float64_step"))
        all64 = analyze_batch(model, b, step=0, options=RebalanceOptions(**base, step_precision="float64"))
        f32 = analyze_batch(model, b, step=0, options=RebalanceOptions(**base, step_precision="model"))
    for kind in f64:
        assert got[kind].equals(f64[kind]), kind
    assert all64.keys() == f64.keys()
    for kind in (
        "influence",
        "prob_change",
    ):  # float64 steps of a float32 gradient against every op in float64
        keys = ["update", "lr", "limit", "bin"] if kind == "prob_change" else ["source_bin", "target_bin"]
        joined = f64[kind].join(all64[kind], on=keys, suffix="_64", nulls_equal=True)
        assert joined.height == f64[kind].height
        scale = max(joined["min_64"].abs().max(), joined["max_64"].abs().max())
        rel = max((joined[c] - joined[f"{c}_64"]).abs().max() for c in STATS) / scale
        print(f"{kind}: float64_step against all-float64 {rel:.1e} of max |dpi|")
        assert rel < 1e-5, (kind, rel)
        assert (joined["step_dtype"] == joined["step_dtype_64"]).all()
    check = got["precision_check"]
    assert check.height == 1 + 1 + 5  # the counterfactual update, its sweep point (no limit), 5 sources
    assert bool(check["agreed"].all()) is agreed and state.agreed is agreed and state.last == "float64_step"
    # the check's numbers from the two ways' frames, read here column by column
    for analysis, bin_col, keys in (
        ("influence", "target_bin", ["source_bin"]),
        ("prob_change", "bin", ["lr"]),
    ):
        a = (
            f64[analysis].filter(pl.col("update") == "counterfactual")
            if analysis == "prob_change"
            else f64[analysis]
        )
        c = (
            f32[analysis].filter(pl.col("update") == "counterfactual")
            if analysis == "prob_change"
            else f32[analysis]
        )
        joined = a.join(c, on=[*keys, bin_col], suffix="_m")
        for key, rows in joined.group_by(keys):
            scale = max(rows["min"].abs().max(), rows["max"].abs().max())
            diff = max((rows[s] - rows[f"{s}_m"]).abs().max() for s in STATS)
            src = key[0]
            name = (f"influence train source {'all' if src < 0 else src}" if analysis == "influence"
                    else f"counterfactual train lr {lr:g}")  # fmt: skip
            row = check.filter(pl.col("update") == name)
            assert row["max_abs_diff"][0] == pytest.approx(diff, rel=1e-12, abs=1e-300)
            assert row["rel_diff"][0] == pytest.approx(diff / scale, rel=1e-12)
    if agreed:
        assert check["rel_diff"].max() < 1e-3
    else:
        assert check["ratio_tokens"].max() >= 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        second = analyze_batch(model, b, step=1, options=measured, precision_state=state)
        third = analyze_batch(model, b, step=2, options=measured, precision_state=state)
    assert "precision_check" not in second and "precision_check" in third
    want = "float32" if agreed else "float64"
    for kind in ("influence", "prob_change"):
        assert (second[kind]["step_dtype"].drop_nulls() == want).all(), kind
        assert second[kind].drop("step").equals((f32 if agreed else f64)[kind].drop("step")), kind


def test_a_float64_model_needs_no_check(policy_batch):  # noqa: F811
    model, batch = policy_batch
    model64 = copy.deepcopy(model).double()
    b = batch.select(slice(0, 2))
    state = MeasuredPrecision()
    got = analyze_batch(model64, b, step=0, options=RebalanceOptions(token_shares=0, step_precision="measured"),
                        precision_state=state)  # fmt: skip
    assert "precision_check" not in got and state.last == "model"
    assert (got["influence"]["step_dtype"] == "float64").all()


def test_an_empty_check_and_bad_schedules():
    frame = precision_check({}, {}, step=0, model_dtype="float32")
    assert frame.height == 0 and "agreed" in frame.columns
    with pytest.raises(ValueError, match="every must be an integer >= 1"):
        MeasuredPrecision(every=0)
    assert MeasuredPrecision.used("float64", None) == "float64"
    assert MeasuredPrecision.used("measured", None) == "float64"
    assert MeasuredPrecision.used("measured", MeasuredPrecision(agreed=True, last="model")) == "model"


def test_the_reports_reading_of_a_check(policy_batch):  # noqa: F811
    """A model-dtype step a check agreed to is not a WARNING of the report; one without such a check is."""
    from tokendyn.figures.readings import precision_note, resolution_note

    model, batch = policy_batch
    b = batch.select(slice(0, 4))
    state = MeasuredPrecision(every=2)
    opts = RebalanceOptions(token_shares=0, view_sequences=0, lr=1e-1, step_precision="measured")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the agreed model-dtype steps warn of nothing
        first = analyze_batch(model, b, step=0, options=opts, precision_state=state)
        second = analyze_batch(model, b, step=5, options=opts, precision_state=state)
    check = first["precision_check"]
    influence = pl.concat([first["influence"], second["influence"]])
    assert state.agreed and (second["influence"]["step_dtype"] == "float32").all()
    unresolved = int((~second["influence"]["step_resolved"]).sum())
    note = resolution_note(influence, check)
    if unresolved:
        assert "WARNING" not in note and f"{unresolved} rows come from steps in the model's dtype" in note
    assert "WARNING" in resolution_note(influence.with_columns(step_resolved=pl.lit(False)))
    said = precision_note(check)
    assert "step 0: float32 vs float64 over 6 updates" in said and "agreed: model-dtype steps kept" in said


def test_a_check_covers_its_own_run_only():
    """Two runs with unresolved float32 steps at step 1: run A's check at step 0 agreed, run B has none; the note
    covers A's rows and still warns of B's."""
    from tokendyn.figures.readings import resolution_note

    rows = pl.DataFrame({
        "run": ["A", "A", "B"], "step": [1, 1, 1], "step_dtype": ["float32"] * 3, "step_rounding": [0.02, 0.01, 0.03],
        "step_resolved": [False, False, False], "no_update": [False] * 3,
    })  # fmt: skip
    check = pl.DataFrame({"run": ["A"], "step": [0], "agreed": [True], "rel_diff": [1e-3]})
    note = resolution_note(rows, check)
    assert "2 rows come from steps in the model's dtype" in note and "WARNING: 1 of 3 rows" in note
    assert "WARNING: 3 of 3 rows" in resolution_note(rows, check.with_columns(agreed=pl.lit(False)))
