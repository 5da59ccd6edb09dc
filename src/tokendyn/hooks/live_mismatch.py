"""The live scalars of the sampler's tail and of the sign split (`tokendyn.hooks.live` logs them; b: the pi_old bin,
``all``: every token; definitions in `tokendyn.analysis.mismatch_tail` and `tokendyn.analysis.sign_split`):

- ``probe/sampler/tail_above/{t}/{bin{b}|all}``: the share of the tokens with rho > t, and
  ``probe/sampler/tail_below/{t}/{bin{b}|all}``: with rho < t, t a row's bound rho_hi, rho_lo written with ``:g``:
  the fixed band's ``tail_above/1.1`` and ``tail_below/0.909091`` (1 / 1.1), the correction's recorded clip_max as
  ``tail_above/{C_max}`` and clip_min as ``tail_below/{C_min}`` (none where the trainer's config records none, or
  C_min = 0: no lower bound);
- ``probe/sampler/abs_mean/{pos|neg|zero}/{bin{b}|all}``, ``probe/sampler/mean_log_rho/{pos|neg|zero}/...``: mean
  |log rho| and mean log rho of the sampler tokens whose advantage is positive, negative or zero, over the tokens
  the probe's `tokens` sample holds (joined on the exact keys; absent for a sign with no token);
- ``probe/update_share/{pos|neg|zero}/{bin{b}|all}`` (a Lopti stage's as ``probe/update_share/{low|high}/{sign}/...``):
  the update share of the tokens of each sign, where the `token_shares` sample holds the whole bin (absent
  elsewhere: a sampled sum is not the share).

The joins read rows of one step that land in different files (the sampler rows before the forward, the probe's
`tokens` rows at the end of the step, a Lopti step's two `shares` stages): `StepRows` buffers each kind's rows by
step, the newest `KEEP_STEPS` steps only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import polars as pl

from tokendyn.analysis.mismatch_tail import correction_thresholds, mismatch_tail
from tokendyn.analysis.sign_split import KEYS, mismatch_by_sign, update_share_by_sign

KEEP_STEPS = 3  # the newest steps whose rows a `StepRows` keeps: the joins' memory stays bounded
# the columns the joins read, per kind of records buffered by step
JOINED = {
    "sampler": (*KEYS, "logp_old", "log_rho"),
    "tokens": (*KEYS, "advantage"),
    "shares": ("step", "stage", "bin", "bin_lo", "bin_hi", "group", "count"),
    "token_shares": ("step", "stage", "bin", "bin_lo", "bin_hi", "advantage", "share"),
}

TRL_FIELDS = (
    "use_vllm",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_cap",
)


def config_of(args) -> dict:
    """The correction's fields of a trainer's args (those it has), checked now: a bad threshold is a one-line
    `UsageError` when the metrics are attached, not at the first log."""
    config = {k: getattr(args, k) for k in TRL_FIELDS if hasattr(args, k)}
    correction_thresholds(config)
    return config


def _tag(b: int) -> str:
    return "all" if b < 0 else f"bin{b}"


def _finite(x) -> bool:
    return x is not None and isinstance(x, int | float) and math.isfinite(x)


def tail_metrics(sampler: pl.DataFrame, config: Mapping | None) -> dict[str, float]:
    """``probe/sampler/tail_above/{rho_hi}/...`` (share with rho > rho_hi) and ``tail_below/{rho_lo}/...`` (share
    with rho < rho_lo) of one `sampler` records file, each threshold row's sides that it has."""
    table = mismatch_tail(sampler, config)
    out: dict[str, float] = {}
    for r in table.iter_rows(named=True) if table.height else ():
        for side, bound in (("above", "rho_hi"), ("below", "rho_lo")):
            if _finite(r[bound]) and _finite(r[side]):
                out[f"probe/sampler/tail_{side}/{r[bound]:g}/{_tag(r['bin'])}"] = float(r[side])
    return out


def sign_metrics(sampler: pl.DataFrame, tokens: pl.DataFrame | None) -> dict[str, float]:
    """``probe/sampler/{abs_mean|mean_log_rho}/{sign}/...`` of one `sampler` records file joined to ``tokens``."""
    if tokens is None or tokens.height == 0:
        return {}
    table = mismatch_by_sign(sampler, tokens)
    out: dict[str, float] = {}
    for r in table.iter_rows(named=True) if table.height else ():
        for col in ("abs_mean", "mean_log_rho"):
            if r["sign"] is not None and _finite(r[col]):
                out[f"probe/sampler/{col}/{r['sign']}/{_tag(r['bin'])}"] = float(r[col])
    return out


def update_sign_metrics(token_shares: pl.DataFrame, shares: pl.DataFrame | None) -> dict[str, float]:
    """``probe/update_share/{sign}/...`` of one `token_shares` records file, its completeness from ``shares``."""
    table = update_share_by_sign(token_shares, shares)
    out: dict[str, float] = {}
    for r in table.iter_rows(named=True) if table.height else ():
        if r["sign"] is not None and _finite(r["share"]):
            stage = "" if r["stage"] == "train" else f"{r['stage']}/"
            out[f"probe/update_share/{stage}{r['sign']}/{_tag(r['bin'])}"] = float(r["share"])
    return out


class StepRows:
    """One kind's record rows by step, files concatenated as they land (the `JOINED` columns they have); only the
    rows of the newest ``keep`` steps are kept."""

    def __init__(self, kind: str, keep: int = KEEP_STEPS):
        self.columns, self.keep = JOINED[kind], keep
        self.frame: pl.DataFrame | None = None

    def add(self, df: pl.DataFrame) -> set[int]:
        """Buffer ``df``'s rows; returns the steps they belong to."""
        df = df.select(c for c in self.columns if c in df.columns)
        if df.height == 0:
            return set()
        self.frame = df if self.frame is None else pl.concat([self.frame, df], how="diagonal_relaxed")
        newest = sorted(self.frame["step"].unique().to_list())[-self.keep :]
        self.frame = self.frame.filter(pl.col("step").is_in(newest))
        return set(df["step"].unique().to_list())

    def step(self, step: int) -> pl.DataFrame | None:
        """The buffered rows of ``step`` (None where there are none)."""
        rows = None if self.frame is None else self.frame.filter(pl.col("step") == step)
        return rows if rows is not None and rows.height else None
