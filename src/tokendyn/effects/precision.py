"""The analyses' step precision decided by its measured effect on the records, not by a worst-case bound.

A counterfactual step in the model's own dtype (float32, bf16) loses to rounding whatever part of the step falls
below the rounding of the weights; `tokendyn.effects.resolution` bounds that loss, and the bound is a worst case (on
SmolLM2-135M about 100x the measured effect). With ``step_precision`` "measured", a run makes the analyses of its
first analysed step both ways, with float64 steps and in the model's dtype, compares every number they report, and
keeps the model's dtype for the next analysed steps when the two agree to ``tol`` (else float64 steps); the check
is made again every ``every`` analysed steps (the policy moves, so can the answer). For float32 weights the float64
steps of a check are `FLOAT64_STEP`'s: the gradient in float32, as the candidate's, the step and pi after it in
float64 (`tokendyn.effects.change.InPlaceUpdate`), so the check measures what rounding the step to the weights'
dtype changes and nothing else, at the memory of the model's own backward (no float64 activations kept, no float64
gradient); against the all-float64 path its records differ by the float32 gradient's own rounding
(`tests/test_precision_matrix.py`). For bf16 / fp16 weights, whose gradient itself rounds at the check's
tolerance, they are the all-float64 path's (`reference_precision`). The steps of a
check are reported from the float64 ones, and the check itself is a `precision_check` record, one row per
counterfactual update (an influence source, the counterfactual update, a sweep point):

    scale     = max |dpi| of the float64 update (its tokens' largest change: max(|min|, |max|) over its bins)
    rel_diff  = max over its bins and its dpi statistics (mean, std, mean_abs, min, quantiles, max) of
                |model - float64| / scale
    ratio_diff = max over its bins of |correct ratio (model) - correct ratio (float64)|     (pos, neg, pooled)
    agreed    = rel_diff <= tol  and  every bin's ratio_diff <= max(tol, 1 / tokens counted)  and  the sign of every
                bin's mean dpi above tol * scale is equal  and  a statistic is null in one exactly when in the other

(a correct ratio may differ by one token of its bin: a token whose change is within rounding of 0 may tie or flip).
The model's dtype is kept only when every row of the check agreed. A model whose parameters are all float64 needs no
check (its own steps are float64). On FSDP2-sharded parameters the float64 steps of a check are `FLOAT64_STEP`'s
whatever the dtype (no float64 backward of a sharded model), the float64 point sharded as the model is (8 bytes a
parameter / world size, `tokendyn.effects.change.InPlaceUpdate`): for bf16 shards, or bf16 compute (FSDP2's mixed
precision), the check then measures the step's rounding and pi's, not the bf16-computed gradient's own. Every rank
keeps the same verdict (`tokendyn.probe.parallel.all_agree`): the analyses after it are collectives.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import polars as pl
from torch import nn

from tokendyn.effects.resolution import UnresolvedStepWarning
from tokendyn.probe.parallel import all_agree
from tokendyn.records import to_frame
from tokendyn.vocab import FLOAT64, FLOAT64_STEP, MEASURED

PRECISION_TOL = (
    5e-3  # the largest difference kept: 0.5 % of the update's largest |dpi| (a report prints 3 digits)
)
CHECK_EVERY = 8  # analysed steps from one check to the next
_STATS = ("mean", "std", "mean_abs", "min", "q01", "q05", "q25", "q50", "q75", "q95", "q99", "max")
_RATIOS = (("correct_pos", ("n_pos", "tie_pos")), ("correct_neg", ("n_neg", "tie_neg")))
_POOLED = "correct_pooled"
# an analysis' rows of one update, and the bin within it
_UPDATE_KEYS = {
    "prob_change": ("update", "update_stage", "source_bin", "lr", "limit"),
    "influence": ("update_stage", "source_bin"),
}
_BIN = {"prob_change": "bin", "influence": "target_bin"}


def _finite(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def compare_update(reference: list[dict], candidate: list[dict], tol: float = PRECISION_TOL) -> dict:
    """One update's check (module docstring) from its bins' rows, float64 (``reference``) and the model's dtype
    (``candidate``), in the same bin order: scale, max_abs_diff, rel_diff, ratio_diff, ratio_tokens (the largest
    of a ratio's difference times its tokens counted: the tokens it moved by), signs_equal, nulls_equal, agreed."""
    scale = max(
        (abs(r[c]) for r in reference for c in ("min", "max") if _finite(r.get(c))),
        default=0.0,
    )
    diff, ratio_diff, ratio_tokens, signs, nulls, ratios_ok = 0.0, 0.0, 0.0, True, True, True
    for ref, cand in zip(reference, candidate, strict=True):
        for c in _STATS:
            a, b = ref.get(c), cand.get(c)
            if _finite(a) != _finite(b):
                nulls = False
            elif _finite(a):
                diff = max(diff, abs(b - a))
        m_ref, m_cand = ref.get("mean"), cand.get("mean")
        if _finite(m_ref) and _finite(m_cand) and abs(m_ref) > tol * scale and (m_ref > 0) != (m_cand > 0):
            signs = False
        for c, (n, tie) in (*_RATIOS, (_POOLED, (None, None))):
            a, b = ref.get(c), cand.get(c)
            if _finite(a) != _finite(b):
                nulls = False
                continue
            if not _finite(a):
                continue
            pairs = [pair for _, pair in _RATIOS] if tie is None else [(n, tie)]  # pooled: both signs
            counted = sum((ref.get(k) or 0) - (ref.get(t) or 0) for k, t in pairs)
            d = abs(b - a)
            ratio_diff, ratio_tokens = max(ratio_diff, d), max(ratio_tokens, d * max(counted, 1))
            if d > max(tol, 1.0 / max(counted, 1)) + 1e-12:
                ratios_ok = False
    rel = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
    return {
        "scale": scale,
        "max_abs_diff": diff,
        "rel_diff": rel,
        "ratio_diff": ratio_diff,
        "ratio_tokens": ratio_tokens,
        "signs_equal": signs,
        "nulls_equal": nulls,
        "agreed": bool(rel <= tol and ratios_ok and signs and nulls),
    }


def _source(analysis: str, key: tuple) -> str:
    names = dict(zip(_UPDATE_KEYS[analysis], key, strict=True))
    if analysis == "influence":
        src = names["source_bin"]
        return f"influence {names['update_stage']} source {'all' if src < 0 else src}"
    if names["limit"]:
        return f"{names['update']} {names['update_stage']} limit"
    return f"{names['update']} {names['update_stage']} lr {names['lr']:g}"


# the `precision_check` record's columns (tokendyn.records), in order
_COLUMNS = (
    "step", "stage", "analysis", "update", "model_dtype", "tol", "scale", "max_abs_diff", "rel_diff", "ratio_diff",
    "ratio_tokens", "signs_equal", "nulls_equal", "agreed", "seconds_float64", "seconds_model",
)  # fmt: skip


def precision_check(
    reference: dict[str, pl.DataFrame],
    candidate: dict[str, pl.DataFrame],
    *,
    step: int,
    stage: str = "train",
    model_dtype: str,
    tol: float = PRECISION_TOL,
    seconds: tuple[float, float] = (math.nan, math.nan),
) -> pl.DataFrame:
    """The `precision_check` record of one analysed batch: its analyses made with float64 steps (``reference``)
    and in the model's dtype ``model_dtype`` (``candidate``), one row per counterfactual update of `prob_change` and
    `influence` (`compare_update`; not the sweep's lr -> 0 limit, which makes no step); an update that was no update in float64 is left out (nothing to compare: the
    other way it is no update too, decided before any step). ``seconds``: the wall time of each way."""
    rows = []
    for analysis, keys in _UPDATE_KEYS.items():
        if analysis not in reference or analysis not in candidate:
            continue
        ref, cand = reference[analysis], candidate[analysis]
        for key, ref_rows in ref.group_by(list(keys), maintain_order=True):
            if ref_rows["no_update"].fill_null(False).any():
                continue
            if analysis == "prob_change" and ref_rows["limit"].fill_null(False).any():
                continue  # the lr -> 0 limit is a derivative, not a step: the same either way
            match = pl.all_horizontal([pl.col(k).eq_missing(v) for k, v in zip(keys, key, strict=True)])
            cand_rows = cand.filter(match).sort(_BIN[analysis])
            ref_rows = ref_rows.sort(_BIN[analysis])
            if cand_rows.height != ref_rows.height:
                raise ValueError(
                    f"precision_check: {analysis} {key}: {cand_rows.height} rows, float64 {ref_rows.height}"
                )
            row = compare_update(ref_rows.to_dicts(), cand_rows.to_dicts(), tol)
            rows.append({
                "step": step,
                "stage": stage,
                "analysis": analysis,
                "update": _source(analysis, key),
                "model_dtype": model_dtype,
                "tol": tol,
                **row,
                "seconds_float64": float(seconds[0]),
                "seconds_model": float(seconds[1]),
            })  # fmt: skip
    if not rows:
        return to_frame("precision_check", {c: [] for c in _COLUMNS})
    return to_frame("precision_check", {c: [r[c] for r in rows] for c in _COLUMNS})


def model_dtype(model: nn.Module) -> str:
    """The dtype of the model's floating parameters ("float32", "bfloat16", ...; "mixed" when they differ)."""
    kinds = {str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()}
    return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "float64")


@dataclass
class MeasuredPrecision:
    """The run's state of ``step_precision`` "measured" (module docstring): ``every`` analysed steps from one check
    to the next (the first analysed step is one), ``tol`` the agreement kept; ``agreed`` the last check's verdict
    (None before the first), ``analysed`` the analysed steps so far, ``last`` the precision of the last one."""

    every: int = CHECK_EVERY
    tol: float = PRECISION_TOL
    agreed: bool | None = None
    analysed: int = 0
    last: str | None = None
    reference: str = FLOAT64_STEP  # the float64 steps of the last check (`reference_precision`)

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"precision: every must be an integer >= 1, got {self.every!r}")
        if not self.tol > 0:
            raise ValueError(f"precision: tol must be > 0, got {self.tol!r}")

    def due(self) -> bool:
        """Whether this analysed step is a check."""
        return self.analysed % self.every == 0

    def chosen(self) -> str:
        """The precision of an analysed step that is not a check: the model's dtype on agreement, else the check's
        own float64 steps (`FLOAT64_STEP`)."""
        return "model" if self.agreed else self.reference

    @staticmethod
    @contextmanager
    def quiet(state: MeasuredPrecision | None) -> Iterator[None]:
        """Inside: no `UnresolvedStepWarning` when the last analysed step stepped in the model's dtype on a check's
        agreement (its rounding bound is a worst case the check measured not to bind); else unchanged."""
        with warnings.catch_warnings():
            if state is not None and state.last == "model" and state.agreed:
                warnings.simplefilter("ignore", UnresolvedStepWarning)
            yield

    @staticmethod
    def used(configured: str, state: MeasuredPrecision | None) -> str:
        """The steps' precision of a further analysis of the step just analysed (the paired comparison): the
        configured one, or with "measured" the one the step's analyses used (float64 before any)."""
        if configured != MEASURED:
            return configured
        return state.last if state is not None and state.last is not None else "float64"


def measured_analysis(
    analyze: Callable[..., tuple[dict[str, pl.DataFrame], object]],
    model: nn.Module,
    options,
    state: MeasuredPrecision,
    *,
    step: int,
    stage: str = "train",
    sharded: bool = False,
):
    """One analysed step under ``step_precision`` "measured": ``analyze(options)`` (the analyses with the
    `RebalanceOptions` given, returning (frames, rest)) in float64 and in the model's dtype when ``state`` says a
    check is due (the float64 frames returned, with the check's `precision_check` frame), else once in the
    precision the last check chose (its steps' unresolved-step warnings silenced when the check agreed: it measured
    what they lose; the candidate's of a check too). A model already in float64 makes one analysis in its dtype, no
    check; FSDP2-sharded parameters (``sharded``) check against sharded float64 steps (`reference_precision`).
    Returns (frames, rest, the precision used)."""
    dtype = model_dtype(model)
    due = state.due()
    state.analysed += 1
    if dtype == "float64":
        state.last = "model"
        frames, rest = analyze(replace(options, step_precision="model"))
        return frames, rest, "model"
    if not due:
        state.last = state.chosen()
        with MeasuredPrecision.quiet(state):
            frames, rest = analyze(replace(options, step_precision=state.last))
        return frames, rest, state.last
    state.reference = reference_precision(dtype, sharded)
    t0 = time.perf_counter()
    frames, rest = analyze(replace(options, step_precision=state.reference))
    t1 = time.perf_counter()
    with warnings.catch_warnings():  # (the candidate's steps: what they lose is what the check measures)
        warnings.simplefilter("ignore", UnresolvedStepWarning)
        low, _ = analyze(replace(options, step_precision="model"))
    t2 = time.perf_counter()
    check = precision_check(frames, low, step=step, stage=stage, model_dtype=dtype, tol=state.tol,
                            seconds=(t1 - t0, t2 - t1))  # fmt: skip
    state.agreed = bool(check["agreed"].all()) if check.height else False
    if sharded:  # (every rank must choose alike: the next analyses' collectives follow the choice)
        state.agreed = all_agree(state.agreed, model)
    state.last = state.reference
    frames = dict(frames)
    frames["precision_check"] = check
    return frames, rest, state.reference


def reference_precision(dtype: str, sharded: bool = False) -> str:
    """The float64 steps a check compares the model's dtype with: `FLOAT64_STEP` (the gradient in the model's
    dtype) for float32 weights, whose gradient's own rounding (1e-7 relative) is far below anything reported, so
    that the check measures the step's rounding alone; the all-float64 path for bf16 / fp16 weights, whose gradient
    rounds at 4e-3 (bf16), the check's own tolerance; `FLOAT64_STEP` for FSDP2-sharded parameters of any dtype (the
    float64 steps a sharded model can make)."""
    return FLOAT64_STEP if dtype == "float32" or sharded else FLOAT64


def check_summary(check: pl.DataFrame) -> str:
    """One line of a run's `precision_check` records: per check, the verdict and the largest difference."""
    if check.is_empty():
        return ""
    parts = []
    for (step,), rows in check.group_by(["step"], maintain_order=True):
        worst = rows.sort("rel_diff", descending=True, nulls_last=True).row(0, named=True)
        verdict = (
            "agreed: model-dtype steps kept" if rows["agreed"].all() else "disagreed: float64 steps kept"
        )
        parts.append(
            f"step {step}: {rows['model_dtype'][0]} vs float64 over {rows.height} updates, largest difference "
            f"{worst['rel_diff']:.2g} of max |dpi| ({worst['update']}), ratios within {rows['ratio_diff'].max():.2g}; "
            f"{verdict}"
        )
    return "; ".join(parts)


__all__ = [
    "CHECK_EVERY",
    "PRECISION_TOL",
    "MeasuredPrecision",
    "check_summary",
    "compare_update",
    "measured_analysis",
    "model_dtype",
    "precision_check",
]
