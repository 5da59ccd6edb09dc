"""step_precision "measured" through the configuration matrix (`tests/_matrix.py`): on every architecture, float32
full and LoRA and bf16 weights, a run's first analysed step is the check (its records bitwise those of its float64
steps: `float64_step`'s for float32 weights, float32 gradient and float64 step, read here against the all-float64
path's, every Δπ statistic within 1e-4 of the update's largest |Δπ|, every correct ratio within one token, the same
nulls; the all-float64 path's for bf16) and the next analysed step steps in the way the check chose. Where it chose
the model's dtype, that step's records are read here against the all-float64 path's, column by column: every Δπ
statistic of every update within the check's 0.5 % of its largest |Δπ|, every correct ratio within one token, the
same nulls; where it chose float64 steps, bitwise the check's. The differences are printed per cell (pytest -s):
the float32-vs-float64 table through the matrix in docs/results.md."""

from __future__ import annotations

import warnings

import polars as pl
import pytest
import torch
from _matrix import ARCHS, PROMPT, REAL, T, build, sample_batch, with_adapter

from tokendyn.effects.precision import PRECISION_TOL, MeasuredPrecision, model_dtype, reference_precision
from tokendyn.effects.rebalance import RebalanceOptions, analyze_batch
from tokendyn.probe.tokenloss import ProbeBatch

torch.set_num_threads(1)
LR = 1e-2
STATS = ("mean", "std", "mean_abs", "min", "q01", "q05", "q25", "q50", "q75", "q95", "q99", "max")
CELLS = [(a, "float32", "full") for a in ARCHS] + [(a, "float32", "lora") for a in ARCHS]
CELLS += [(a, "bf16", "full") for a in ARCHS]
# the real LLM's cell (SmolLM2-135M-Instruct, 30 layers, V = 49,152: ~2 min on 2 CPU cores), with its longer checks
CELLS += [pytest.param(REAL, "float32", "full", marks=pytest.mark.real_llm_extra)]


def _updates(frames: dict[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """Each counterfactual update's per-bin rows (the influence matrix's sources, the counterfactual step)."""
    out = {}
    for (src,), rows in frames["influence"].group_by(["source_bin"], maintain_order=True):
        out[f"influence source {src}"] = rows.sort("target_bin")
    cf = frames["prob_change"].filter(pl.col("update") == "counterfactual")
    out["counterfactual"] = cf.sort("bin")
    return out


def _worst(want: dict, got: dict, cell) -> tuple[float, float]:
    """The largest difference of a Δπ statistic over the update's largest |Δπ| and of a correct count in tokens,
    between two runs' updates (the same updates, the same nulls)."""
    assert want.keys() == got.keys(), cell
    rel, tokens = 0.0, 0.0
    for name, a in want.items():
        g = got[name]
        scale = max(float(a["min"].abs().max()), float(a["max"].abs().max()))
        diff = max(float((a[s] - g[s]).abs().max() or 0.0) for s in STATS)
        rel = max(rel, diff / scale if scale > 0 else 0.0)
        tokens = max(tokens, _ratio_tokens(a, g))
        assert all(a[s].is_null().equals(g[s].is_null()) for s in STATS), (cell, name)
    return rel, tokens


def _ratio_tokens(a: pl.DataFrame, b: pl.DataFrame) -> float:
    """The largest change of a correct count, in tokens, between two frames of the same update's bins."""
    worst = 0.0
    for col, n in (("correct_pos", "n_pos"), ("correct_neg", "n_neg")):
        if col in a.columns:
            diff = ((a[col] - b[col]).abs() * a[n]).drop_nulls()
            worst = max(worst, float(diff.max() or 0.0))
    return worst


@pytest.mark.parametrize(("arch", "dtype", "adapter"), CELLS)
def test_measured_steps_equal_the_float64_path_to_the_checks_tolerance(arch, dtype, adapter):
    if adapter == "lora":
        pytest.importorskip("peft")
    model = with_adapter(build(arch), adapter).eval()
    b = sample_batch(model)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    batch = ProbeBatch(
        b.input_ids, torch.ones_like(b.input_ids), b.completion_mask.bool(), b.advantages, temperature=T
    )
    assert batch.n_completion == b.input_ids.size(1) - PROMPT
    base = dict(token_shares=0, view_sequences=0, shares=False, lr=LR)
    state = MeasuredPrecision()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (model-dtype steps below their rounding bound warn)
        check = analyze_batch(model, batch, step=0, options=RebalanceOptions(**base, step_precision="measured"),
                              precision_state=state)  # fmt: skip
        f64 = analyze_batch(model, batch, step=0, options=RebalanceOptions(**base, step_precision="float64"))
        ref = reference_precision(model_dtype(model))
        fref = (
            f64
            if ref == "float64"
            else analyze_batch(model, batch, step=0, options=RebalanceOptions(**base, step_precision=ref))
        )
        second = analyze_batch(model, batch, step=0, options=RebalanceOptions(**base, step_precision="measured"),
                               precision_state=state)  # fmt: skip
    assert ref == ("float64_step" if dtype == "float32" else "float64")
    for kind in fref:
        assert check[kind].equals(fref[kind]), kind  # the check step reports its float64 steps
    ref_rel, ref_tokens = _worst(_updates(f64), _updates(fref), (arch, dtype, adapter))
    assert ref_rel <= 1e-4 and ref_tokens <= 1, (ref_rel, ref_tokens)  # (the float32 gradient's rounding)
    agreed = bool(check["precision_check"]["agreed"].all())
    assert state.agreed is agreed
    want, got = _updates(f64), _updates(second)
    assert want.keys() == got.keys()
    rel, tokens = _worst(want, got, (arch, dtype, adapter))
    print(f"{arch} {dtype} {adapter}: {'agreed' if agreed else 'disagreed'}; the check's float64 steps ({ref}) "
          f"against all-float64 {ref_rel:.2g} of max |dpi|, ratios within {ref_tokens:.0f} tokens; the next step "
          f"in {second['prob_change']['step_dtype'].drop_nulls()[0]}: {rel:.2g} of max |dpi|, ratios within "
          f"{tokens:.0f} tokens")  # fmt: skip
    if agreed:
        assert (
            second["prob_change"]["step_dtype"].drop_nulls() == str(dtype).replace("bf16", "bfloat16")
        ).all()
        assert rel <= PRECISION_TOL and tokens <= 1, (rel, tokens)
    else:
        for kind in fref:
            assert second[kind].equals(fref[kind]), kind
