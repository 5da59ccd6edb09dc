"""Records of one or more run directories as polars frames with a ``run`` column (the run's label).

A label is the run's method from ``run.json`` ("GRPO", "GRPO + Reweight(a=0.3)", ...), made unique with the folder
name when two runs share a method. Every record kind present in ``RUN_DIR/records`` is read, the probe's
(``binstats``, ``hist``, ``bound``, ``checks``, ``tokens``) and the rebalancing analyses' (``shares``,
``token_shares``, ``prob_change``, ``influence``) alike; ``metrics.parquet`` is the training log. No torch import.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from tokendyn.analysis.run import RunDirError, load_run
from tokendyn.records import SCHEMAS, shard_files

PROBE_KINDS = ("binstats", "hist", "bound", "checks", "tokens")
ANALYSIS_KINDS = ("shares", "token_shares", "prob_change", "influence")
COMPARISON_KINDS = ("paired",)  # the paired comparison of update rules, an option (--probe_compare_rules)
VIEW_KINDS = (
    "token_view",
    "token_view_rules",
    "spikes",  # the tokens behind a spike, which the view opens at (--probe_spike_k)
)  # every token of the view's sequences (--probe_view_sequences)
CHECK_KINDS = ("precision_check",)  # the measured step precision (--probe_step_precision measured)
SAMPLER_KINDS = ("sampler", "floor")  # the sampling engine's log-probs beside the trainer's (--use_vllm)
METRICS = "metrics"  # the training log, RUN_DIR/metrics.parquet
KINDS = (*PROBE_KINDS, *ANALYSIS_KINDS, *COMPARISON_KINDS, *CHECK_KINDS, *VIEW_KINDS, *SAMPLER_KINDS, METRICS)
LOPTI_STAGES = ("low", "high")


class MissingRecords(LookupError):
    """A figure or table needs record kinds that the given frames (or run directories) do not hold."""

    def __init__(self, what: str, kinds: Sequence[str], hint: str = "", *, reason: str | None = None) -> None:
        self.what, self.kinds = what, tuple(kinds)
        need = " or ".join(f"`{k}`" for k in self.kinds)
        text = f"{what}: {reason}" if reason else f"{what}: needs {need} records, none found"
        super().__init__(text + (f" ({hint})" if hint else ""))


def check_run_dir(path: str | os.PathLike) -> Path:
    """The path as a run directory (`tokendyn.load_run`'s check): it must exist and hold run.json,
    metrics.parquet or record files."""
    return load_run(path).path


@dataclass
class RunInfo:
    """One run directory: its label (unique across the runs loaded together), method and run.json content."""

    path: Path
    label: str
    method: str
    meta: dict = field(default_factory=dict)

    @property
    def config(self) -> dict:
        return self.meta.get("config") or {}


def _labels(paths: Sequence[Path], methods: Sequence[str]) -> list[str]:
    labels = []
    for p, m in zip(paths, methods, strict=True):
        dup = sum(x == m for x in methods) > 1
        labels.append(f"{m} ({p.name if p.name != 'run' else p.parent.name + '/' + p.name})" if dup else m)
    seen: dict[str, int] = {}
    out = []
    for lab in labels:  # still equal (same folder names): number them
        seen[lab] = seen.get(lab, 0) + 1
        out.append(lab if seen[lab] == 1 else f"{lab} #{seen[lab]}")
    return out


def _scan(files: list[Path]) -> pl.DataFrame:
    frames = [pl.read_parquet(f) for f in files]
    frames = [f for f in frames if f.height]
    if not frames:
        return pl.DataFrame()
    return pl.concat(frames, how="diagonal_relaxed")


@dataclass
class Records:
    """The records of several runs, one frame per kind with a leading ``run`` column (the run's label)."""

    runs: list[RunInfo]
    frames: dict[str, pl.DataFrame]

    def get(self, kind: str) -> pl.DataFrame | None:
        """The frame of a kind, or None when no run has it."""
        df = self.frames.get(kind)
        return df if df is not None and df.height else None

    def kinds(self) -> list[str]:
        return [k for k in KINDS if self.get(k) is not None]

    @property
    def labels(self) -> list[str]:
        return [r.label for r in self.runs]

    def without(self, *kinds: str) -> Records:
        """The same runs with some kinds left out (for tests and for figures drawn from a fallback)."""
        return Records(self.runs, {k: v for k, v in self.frames.items() if k not in kinds})


def load_runs(run_dirs: Iterable[str | os.PathLike]) -> Records:
    """Read every record kind and the metrics of each run directory (validated first, in order)."""
    loaded = [load_run(p) for p in run_dirs]  # every directory checked before any is read
    if not loaded:
        raise RunDirError("no run directory given")
    paths = [r.path for r in loaded]
    labels = _labels(paths, [r.method for r in loaded])
    runs = [RunInfo(r.path, lab, r.method, r.meta) for r, lab in zip(loaded, labels, strict=True)]
    parts: dict[str, list[pl.DataFrame]] = {k: [] for k in KINDS}
    for run, source in zip(runs, loaded, strict=True):
        for kind in KINDS:
            if kind in source.kinds:
                df = source[kind].collect()
            elif kind not in SCHEMAS and kind != METRICS:  # a kind this version does not know the schema of
                df = _scan(shard_files(run.path, kind))
            else:
                df = pl.DataFrame()
            if df.height:
                df = df.with_columns(pl.lit(run.label).alias("run")).select("run", pl.exclude("run"))
                if kind == METRICS:
                    df = _with_rollout(df, run)
                elif kind == "tokens":
                    df = _with_in_stage(df, run)
                parts[kind].append(df)
    frames = {k: pl.concat(v, how="diagonal_relaxed") for k, v in parts.items() if v}
    return Records(runs, frames)


def _with_rollout(metrics: pl.DataFrame, run: RunInfo) -> pl.DataFrame:
    """Add ``rollout`` = ceil(optimizer step / optimizer steps per rollout batch): the rollout batch a logged step
    belongs to (Lopti takes two optimizer steps per rollout), so methods are compared at equal rollouts, as the
    paper's RL steps; 0 = before training."""
    cfg = run.config
    try:
        per = int(cfg.get("steps_per_generation") or 1) * int(cfg.get("num_iterations") or 1)
        per = max(1, per // int(cfg.get("gradient_accumulation_steps") or 1))
    except (TypeError, ValueError):
        per = 1
    if cfg.get("lopti_eta") is not None or cfg.get("lopti_quantile") is not None:
        per *= 2
    eval_n = (run.meta.get("run") or {}).get("eval_n")  # held-out puzzles per size per evaluation
    n = int(eval_n) if isinstance(eval_n, int) and eval_n > 0 else None
    return metrics.with_columns(
        (pl.col("step") / per).ceil().alias("rollout"), pl.lit(n, dtype=pl.Int64).alias("heldout_n")
    )


def _with_in_stage(tokens: pl.DataFrame, run: RunInfo) -> pl.DataFrame:
    """Add ``in_stage``: whether a sampled token is updated in the stage it was recorded in. Lopti masks the other
    stage's advantages to 0 in the records; with a fixed eta (run.json) membership is pi_old < eta for the low
    stage, else (quantile variant, unknown config) a zero-advantage token counts as outside."""
    eta = run.config.get("lopti_eta")
    stage = pl.col("stage")
    if eta is not None:
        inside = (
            pl.when(stage == "low")
            .then(pl.col("pi_old") < eta)
            .when(stage == "high")
            .then(pl.col("pi_old") >= eta)
            .otherwise(True)
        )
    else:
        inside = pl.when(stage.is_in(LOPTI_STAGES)).then(pl.col("advantage") != 0).otherwise(True)
    return tokens.with_columns(inside.alias("in_stage"))


def ensure_run(df: pl.DataFrame, label: str = "run") -> pl.DataFrame:
    """A frame given without a ``run`` column (one run) gets one."""
    if isinstance(df, pl.LazyFrame):
        df = df.collect()
    return df if "run" in df.columns else df.with_columns(pl.lit(label).alias("run"))


def optional(df: pl.DataFrame | pl.LazyFrame | None) -> pl.DataFrame | None:
    """An optional input frame: collected, with a run column; None when absent or empty."""
    if df is None:
        return None
    df = ensure_run(df)
    return df if df.height else None


def need(
    df: pl.DataFrame | pl.LazyFrame | None, what: str, kinds: Sequence[str], hint: str = ""
) -> pl.DataFrame:
    """``df`` collected, with a run column; MissingRecords when it is None or empty."""
    if df is None:
        raise MissingRecords(what, kinds, hint)
    df = ensure_run(df)
    if not df.height:
        raise MissingRecords(what, kinds, hint)
    return df


_KIND_RANK = {"grpo": 0, "reweight": 1, "lopti": 2, "both": 3}


def run_order(df: pl.DataFrame) -> list[str]:
    """Run labels in the paper's order (GRPO, +Reweight, +Lopti, both), then by first appearance."""
    from tokendyn.figures.style import method_kind

    seen = list(dict.fromkeys(df.get_column("run").to_list()))
    return sorted(seen, key=lambda r: (_KIND_RANK.get(method_kind(r), 4), seen.index(r)))


def full_loss(shares: pl.DataFrame) -> pl.DataFrame:
    """The `shares` rows that decompose the whole loss (stage "train"), without a Lopti run's per-stage rows
    (stage "low" / "high": each stage loss's gradient at the stage start); all rows if none is "train"."""
    if "train" in shares.get_column("stage").unique().to_list():
        return shares.filter(pl.col("stage") == "train")
    return shares


def first_stage(df: pl.DataFrame) -> pl.DataFrame:
    """Per run, the rows of the stage recorded first (Lopti's two stages see the same rollout: counting tokens in
    one of them counts each sampled token once)."""
    firsts = (
        df.group_by("run", "stage").agg(pl.col("step").min().alias("_first")).sort("run", "_first", "stage")
    )
    keep = firsts.group_by("run", maintain_order=True).agg(pl.col("stage").first())
    return df.join(keep, on=["run", "stage"], how="semi")


def one_point(tokens: pl.DataFrame, point: str | None = None) -> pl.DataFrame:
    """Token rows of one probe point (a sampled token is repeated once per point): the given one, else the final
    norm when probed, else the first."""
    points = tokens.get_column("point").unique().to_list()
    if point is None:
        point = "final_norm.out" if "final_norm.out" in points else sorted(points)[0]
    return tokens.filter(pl.col("point") == point)


def bin_edges(
    df: pl.DataFrame, lo: str = "bin_lo", hi: str = "bin_hi", col: str = "bin"
) -> dict[int, tuple[float, float]]:
    """bin index -> (lo, hi), averaged over the rows (exact for fixed edges; quantile bins vary by step)."""
    e = df.filter(pl.col(col) >= 0).group_by(col).agg(pl.col(lo).mean(), pl.col(hi).mean()).sort(col)
    return {int(b): (float(a), float(c)) for b, a, c in e.iter_rows()}


def edges_vary(df: pl.DataFrame, lo: str = "bin_lo", col: str = "bin") -> bool:
    """Whether a bin's edges differ between rows (quantile bins)."""
    if not df.height:
        return False
    n = df.filter(pl.col(col) >= 0).group_by(col).agg(pl.col(lo).n_unique().alias("n"))
    return bool((n["n"] > 1).any())


def bin_label(lo: float, hi: float, last: bool) -> str:
    return f"[{lo:.2g}, {hi:.2g}{']' if last else ')'}"
