"""Record files on disk: every kind's schema, the file layout, the process rank, the record writer and the loader
shim for run directories written with retired names (polars only; no torch).

Shared by the producers (`tokendyn.probe`, `tokendyn.hooks`) and the readers (`tokendyn.analysis`, `tokendyn.figures`);
the one module that knows the file layout. Names (stages, points, parameter groups) are those of `tokendyn.vocab`.

Layout: RUN_DIR/records/{kind}-rank{RRR}-{NNNNNN}.parquet, one file per kind per flush, one shard per process
rank; NNNNNN counts this rank's flushes of that kind (a new writer continues after the files already there, so
nothing written earlier is overwritten). Each file is written to a hidden temp file in the same folder, then
renamed with os.replace (atomic on POSIX): readers never see a partial file.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import polars as pl

from tokendyn.common import atomic_write
from tokendyn.vocab import LOPTI_ORDERS, RETIRED, RETIRED_STAGE_COUNT, stage_name

RECORDS_DIR = "records"
_KEY = {"step": pl.Int64, "stage": pl.Utf8, "rank": pl.Int32, "micro": pl.Int32}
_REBALANCE_KEY = {"step": pl.Int64, "stage": pl.Utf8}
_CORRECT = {
    "n_pos": pl.Int64,
    "n_neg": pl.Int64,
    "tie_pos": pl.Int64,
    "tie_neg": pl.Int64,
    "correct_pos": pl.Float64,
    "correct_neg": pl.Float64,
    "correct_pooled": pl.Float64,
}
# the distribution of delta pi over a set of tokens (tokendyn.effects.change.delta_summary), then the correct ratios
_DELTA = {
    "count": pl.Int64,
    "mean": pl.Float64,
    "std": pl.Float64,
    "mean_abs": pl.Float64,
    "min": pl.Float64,
    **{f"q{q:02d}": pl.Float64 for q in (1, 5, 25, 50, 75, 95, 99)},
    "max": pl.Float64,
    **_CORRECT,
}
# how finely a counterfactual step was resolved (tokendyn.effects.resolution.Resolution): ||dtheta||, the dtype the
# parameters held during the step, the largest fraction of the step their rounding could take, and whether that is
# within STEP_ROUNDING_LIMIT; no_update: the step carried no policy-gradient signal (its measurements null); all
# null for a real update (and no_update for records written before it was recorded)
_RESOLUTION = {
    "step_norm": pl.Float64,
    "step_dtype": pl.Utf8,
    "step_rounding": pl.Float64,
    "step_resolved": pl.Boolean,
    "no_update": pl.Boolean,
}

# the sampler's columns, per token of a probed micro-batch (the `sampler` and `floor` kinds)
_SAMPLER_COLUMNS = {
    **_KEY,
    "row": pl.Int32,
    "pos": pl.Int32,
    "logp_old": pl.Float64,
    "logp_sampler": pl.Float64,
    "log_rho": pl.Float64,
    "is_weight": pl.Float64,
    "seq_masked": pl.Boolean,
}
SCHEMAS: dict[str, dict[str, pl.DataType]] = {
    # per (step, stage, rank, micro, point, bin, quantity); quantity in norm | norm_per_w | ratio
    "binstats": {
        **_KEY,
        "point": pl.Utf8,
        "point_index": pl.Int32,
        "bin": pl.Int32,
        "bin_lo": pl.Float64,
        "bin_hi": pl.Float64,
        "quantity": pl.Utf8,
        "count": pl.Int64,
        "sum": pl.Float64,
        "sumsq": pl.Float64,
        "min": pl.Float64,
        "max": pl.Float64,
        "nonfinite": pl.Int64,
    },
    # non-empty cells of the log-spaced histogram of each quantity
    "hist": {
        **_KEY,
        "point": pl.Utf8,
        "bin": pl.Int32,
        "quantity": pl.Utf8,
        "cell": pl.Int32,
        "lo": pl.Float64,
        "hi": pl.Float64,
        "count": pl.Int64,
    },
    # per point: envelope of ratio = ||delta|| / (|w| (1 - pi)) and spearman(||delta|| / |w|, 1 - pi);
    # unreached = the scored tokens of a micro-batch whose backward never delivered this point's gradient (an error)
    "bound": {
        **_KEY,
        "point": pl.Utf8,
        "point_index": pl.Int32,
        "n": pl.Int64,
        "ratio_min": pl.Float64,
        "ratio_max": pl.Float64,
        "spearman": pl.Float64,
        "nonfinite": pl.Int64,
        "unreached": pl.Int64,
        "direct_n": pl.Int64,
        "direct_ratio_min": pl.Float64,
        "direct_ratio_max": pl.Float64,
        "direct_spearman": pl.Float64,
    },
    # the exact checks at the LM head and the logits
    "checks": {
        **_KEY,
        "vocab_size": pl.Int64,
        "temperature": pl.Float64,
        "grad_dtype": pl.Utf8,
        "head_dtype": pl.Utf8,
        "identity_rounded": pl.Boolean,
        "entropy_term": pl.Boolean,
        "n_checked": pl.Int64,
        "identity_n": pl.Int64,
        "identity_max_rel_err": pl.Float64,
        "identity_mean_rel_err": pl.Float64,
        "identity_max_scaled_err": pl.Float64,
        "identity_violations": pl.Int64,
        "identity_logits_max_rel_err": pl.Float64,
        "logits_lo": pl.Float64,
        "logits_hi": pl.Float64,
        "logits_ratio_min": pl.Float64,
        "logits_ratio_max": pl.Float64,
        "logits_violations": pl.Int64,
        "head_sigma_max": pl.Float64,
        "head_sigma_step": pl.Int64,
        "head_bound": pl.Float64,
        "head_ratio_max": pl.Float64,
        "head_n": pl.Int64,
        "head_violations": pl.Int64,
        "tolerance": pl.Float64,
        "tolerance_rel": pl.Float64,
        "bound_tolerance": pl.Float64,
    },
    # the bounded token sample: one row per (sampled token, point)
    "tokens": {
        **_KEY,
        "row": pl.Int32,
        "pos": pl.Int32,
        "token_id": pl.Int64,
        "bin": pl.Int32,
        "pi_old": pl.Float64,
        "pi": pl.Float64,
        "advantage": pl.Float64,
        "w": pl.Float64,
        "point": pl.Utf8,
        "norm": pl.Float64,
        "ratio": pl.Float64,
        "direct_norm": pl.Float64,
        "direct_ratio": pl.Float64,
        "identity_rel_err": pl.Float64,
        "logits_ratio": pl.Float64,
    },
    # the sampler against the trainer: one row per completion token of a probed micro-batch whose rollout carries
    # the engine's log-probs (TRL + vLLM: `tokendyn.hooks.sampler`); log_rho = logp_old - logp_sampler; is_weight and
    # seq_masked null where no weight was applied or read (the offline probe: a rollouts file carries none)
    "sampler": _SAMPLER_COLUMNS,
    # the trainer against itself, the noise floor of any mismatch: the same tokens' log-probs recomputed in two
    # halves of the micro-batch at the same parameters (`tokendyn.hooks.sampler.split_logps`); the sampler's columns,
    # logp_old = the loss's forward, logp_sampler = the recomputation, is_weight 1, seq_masked false
    "floor": _SAMPLER_COLUMNS,
    # conditions that switched a check off (GradientProbe.note): one row per condition and rank; step null when
    # the condition holds for the whole run (found when the probe was built)
    "notes": {"step": pl.Int64, "rank": pl.Int32, "code": pl.Utf8, "message": pl.Utf8},
    # ---- rebalancing analyses (tokendyn.effects.shares / change / influence); bin -1 = all tokens
    # per (bin, parameter group): ||g_b||, <g_b, g>, ||g||, s_b = <g_b, g>/||g||^2; group "all" = every parameter,
    # else embeddings | layers.{i} | final_norm | lm_head | other (tokendyn.vocab); jvp_share = sum of the per-token
    # JVP shares of the bin (group "all" only); loss = L of the batch; share null where g = 0. stage "train": the
    # whole loss; a Lopti run's stages "low" / "high": the stage's loss at the stage start (step = the global step
    # then: stage 2 later than the rollout's other records)
    "shares": {
        **_REBALANCE_KEY,
        "bin": pl.Int32,
        "bin_lo": pl.Float64,
        "bin_hi": pl.Float64,
        "group": pl.Utf8,
        "count": pl.Int64,
        "grad_norm": pl.Float64,
        "dot": pl.Float64,
        "total_norm": pl.Float64,
        "share": pl.Float64,
        "jvp_share": pl.Float64,
        "loss": pl.Float64,
    },
    # sampled tokens: s_t = <grad l_t, g>/||g||^2; pos = completion index j (sequence index S - C + j);
    # delta_pi = the token's change under the counterfactual all-token update (null if not run)
    "token_shares": {
        **_REBALANCE_KEY,
        "row": pl.Int32,
        "pos": pl.Int32,
        "token_id": pl.Int64,
        "bin": pl.Int32,
        "bin_lo": pl.Float64,
        "bin_hi": pl.Float64,
        "pi_old": pl.Float64,
        "advantage": pl.Float64,
        "share": pl.Float64,
        "delta_pi": pl.Float64,
    },
    # distribution of delta pi per bin of pi_old after one update; update: counterfactual | sweep | real;
    # update_stage: train | low | high | lopti (tokendyn.vocab); source_bin: the bin the update used (-1 all tokens);
    # limit: the sweep's lr -> 0 point (lr 0), whose delta pi columns are d pi / d lr at lr = 0 (null before it was
    # recorded: no such rows)
    "prob_change": {
        **_REBALANCE_KEY,
        "update": pl.Utf8,
        "update_stage": pl.Utf8,
        "source_bin": pl.Int32,
        "bin": pl.Int32,
        "bin_lo": pl.Float64,
        "bin_hi": pl.Float64,
        "lr": pl.Float64,
        "param_step": pl.Float64,
        **_RESOLUTION,
        "limit": pl.Boolean,
        **_DELTA,
    },
    # M[source, target]: mean |delta pi| (and the distribution of delta pi, correct ratios) over target-bin tokens after an update with only
    # the source bin's tokens; update_stage train | low | high (Lopti)
    "influence": {
        **_REBALANCE_KEY,
        "update_stage": pl.Utf8,
        "source_bin": pl.Int32,
        "source_lo": pl.Float64,
        "source_hi": pl.Float64,
        "source_count": pl.Int64,
        "target_bin": pl.Int32,
        "target_lo": pl.Float64,
        "target_hi": pl.Float64,
        "lr": pl.Float64,
        **_RESOLUTION,
        **_DELTA,
    },
    # the measured step-precision check (tokendyn.effects.precision): one analysed batch's analyses with float64 steps
    # and in the model's dtype, one row per counterfactual update; rel_diff = the largest |difference| of its dpi
    # statistics / its largest |dpi| in float64 (scale); ratio_diff = the largest correct-ratio difference
    # (ratio_tokens: in tokens); agreed: within tol, ratios within one token, signs and nulls equal
    "precision_check": {
        **_REBALANCE_KEY,
        "analysis": pl.Utf8,
        "update": pl.Utf8,
        "model_dtype": pl.Utf8,
        "tol": pl.Float64,
        "scale": pl.Float64,
        "max_abs_diff": pl.Float64,
        "rel_diff": pl.Float64,
        "ratio_diff": pl.Float64,
        "ratio_tokens": pl.Float64,
        "signs_equal": pl.Boolean,
        "nulls_equal": pl.Boolean,
        "agreed": pl.Boolean,
        "seconds_float64": pl.Float64,
        "seconds_model": pl.Float64,
    },
    # paired counterfactual comparison (tokendyn.effects.compare): sums over one sequence's tokens of one bin of pi_old
    # after each rule's update from the same state; rule base | reweight | lopti | ...; mode equal_norm | optimizer
    "paired": {
        "step": pl.Int64,
        "rule": pl.Utf8,
        "mode": pl.Utf8,
        "seq": pl.Int32,
        "bin": pl.Int32,
        "bin_lo": pl.Float64,
        "bin_hi": pl.Float64,
        "count": pl.Int64,
        "n_pos": pl.Int64,
        "n_neg": pl.Int64,
        "up_pos": pl.Int64,
        "down_neg": pl.Int64,
        "tie_pos": pl.Int64,
        "tie_neg": pl.Int64,
        "sum_dpi": pl.Float64,
        "sum_dpi_ref": pl.Float64,
        "sum_diff": pl.Float64,
        "sum_diff2": pl.Float64,
        "sum_share": pl.Float64,
        "sum_dentropy": pl.Float64,
        "sum_kl_ref": pl.Float64,
        "lr": pl.Float64,
        "param_step": pl.Float64,
        "norm_ratio": pl.Float64,
        "inner_steps": pl.Int32,
        "sweep": pl.Utf8,
        "sweep_value": pl.Float64,
        "diverged": pl.Boolean,
        **_RESOLUTION,
    },
    # per-token records of the view's sequences (tokendyn.effects.token_view): one row per scored token
    "token_view": {
        **_REBALANCE_KEY,
        "seq": pl.Int32,
        "pos": pl.Int32,
        "token_id": pl.Int64,
        "text": pl.Utf8,
        "special": pl.Boolean,
        "bin": pl.Int32,
        "pi_old": pl.Float64,
        "advantage": pl.Float64,
        "group": pl.Utf8,
        "share": pl.Float64,
        "dpi_cf": pl.Float64,
        "dpi_real": pl.Float64,
        "head_ratio": pl.Float64,
        # the sampler at the token (null where the rollout has no sampler log-probs): log pi_old - log mu, and the
        # importance weight the loss applied
        "log_rho": pl.Float64,
        "is_weight": pl.Float64,
    },
    # the paired comparison's rules at the view's tokens: one row per (token, rule, mode)
    "token_view_rules": {
        **_REBALANCE_KEY,
        "seq": pl.Int32,
        "pos": pl.Int32,
        "rule": pl.Utf8,
        "mode": pl.Utf8,
        "delta_pi": pl.Float64,
        "share": pl.Float64,
    },
}
KINDS = tuple(SCHEMAS)
_NAME = re.compile(r"^(?P<kind>[a-z_]+)-rank(?P<rank>\d+)-(?P<seq>\d+)\.parquet$")


def records_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / RECORDS_DIR


def shard_files(run_dir: str | os.PathLike, kind: str) -> list[Path]:
    """All shard files of one kind, every rank, in (rank, seq) order."""
    d = records_dir(run_dir)
    if not d.is_dir():
        return []
    found = []
    for f in d.iterdir():
        m = _NAME.match(f.name)
        if m and m["kind"] == kind:
            found.append((int(m["rank"]), int(m["seq"]), f))
    return [f for _, _, f in sorted(found)]


def to_frame(kind: str, columns: dict[str, list] | pl.DataFrame) -> pl.DataFrame:
    """A DataFrame with exactly the schema of `kind` (missing or extra columns are an error)."""
    if kind not in SCHEMAS:
        raise ValueError(f"records: unknown kind {kind!r}; known: {', '.join(KINDS)}")
    schema = SCHEMAS[kind]
    names = list(columns.columns if isinstance(columns, pl.DataFrame) else columns)
    if set(names) != set(schema):
        missing, extra = set(schema) - set(names), set(names) - set(schema)
        raise ValueError(
            f"records: {kind} columns differ from the schema: missing {sorted(missing)}, extra {sorted(extra)}"
        )
    if isinstance(columns, pl.DataFrame):
        return columns.select([pl.col(c).cast(t) for c, t in schema.items()])
    return pl.DataFrame({c: columns[c] for c in schema}, schema=schema, strict=False)


def _checked(kind: str, columns: dict[str, list] | pl.DataFrame) -> pl.DataFrame | dict[str, list]:
    """A frame of `kind` (`to_frame`), or, for column lists, a copy whose names and lengths were checked (built
    into a frame when the writer flushes)."""
    if isinstance(columns, pl.DataFrame):
        return to_frame(kind, columns)
    if kind not in SCHEMAS:
        raise ValueError(f"records: unknown kind {kind!r}; known: {', '.join(KINDS)}")
    if set(columns) != set(SCHEMAS[kind]):
        to_frame(kind, columns)  # raises, naming the missing and extra columns
    lengths = {len(v) for v in columns.values()}
    if len(lengths) > 1:
        raise ValueError(f"records: {kind} columns have unequal lengths {sorted(lengths)}")
    return {c: list(columns[c]) for c in SCHEMAS[kind]}


def process_rank() -> int:
    """This process's rank: torch.distributed's when a process group is up, else $RANK, else 0 (torch is only
    asked when something imported it already: records stay torch-free)."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0"))


def write_parquet(df: pl.DataFrame, path: str | os.PathLike) -> Path:
    """Write parquet atomically (`tokendyn.common.atomic_write`: a temp file beside ``path``, fsync, rename)."""
    return atomic_write(path, df.write_parquet)


def _next_seq(run_dir: str | os.PathLike, kind: str, rank: int) -> int:
    seqs = [
        int(m["seq"])
        for f in shard_files(run_dir, kind)
        if (m := _NAME.match(f.name)) and int(m["rank"]) == rank
    ]
    return max(seqs, default=-1) + 1


def write_frames(
    run_dir: str | os.PathLike, frames: dict[str, pl.DataFrame], rank: int | None = None
) -> list[Path]:
    """Write each non-empty frame as RUN_DIR/records/{kind}-rank{rank:03d}-{seq:06d}.parquet (seq: this rank's next
    free number for that kind), atomically. Returns the files written."""
    rank = process_rank() if rank is None else int(rank)
    checked = {kind: to_frame(kind, df) for kind, df in frames.items()}
    out = []
    d = records_dir(run_dir)
    for kind, df in checked.items():
        if df.height == 0:
            continue
        path = d / f"{kind}-rank{rank:03d}-{_next_seq(run_dir, kind, rank):06d}.parquet"
        out.append(write_parquet(df, path))
    return out


FLUSH_SECONDS = 30.0  # default bound on the records a kill can lose: those added in the last 30 s


class RecordWriter:
    """Buffers records per kind and writes one parquet file per kind per flush, for one rank.

    `add(records)` takes kind -> columns (what a probe's sink receives). It flushes every `flush_every` adds, and
    at the latest `flush_seconds` after the last flush once something is buffered (at the next add, or from a
    timer thread if no add comes; 0 = at every add): a kill loses at most the records added in the last
    `flush_seconds` (plus those of the micro-batch being recorded). `flush()` writes at once and disarms the timer.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        rank: int | None = None,
        flush_every: int = 1,
        flush_seconds: float = FLUSH_SECONDS,
    ) -> None:
        if not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(f"records: flush_every must be an integer >= 1, got {flush_every!r}")
        if (
            isinstance(flush_seconds, bool)
            or not isinstance(flush_seconds, int | float)
            or not flush_seconds >= 0
        ):
            raise ValueError(f"records: flush_seconds must be a number >= 0, got {flush_seconds!r}")
        self.run_dir = Path(run_dir)
        self.rank = process_rank() if rank is None else int(rank)
        self.flush_every = flush_every
        self.flush_seconds = float(flush_seconds)
        # per kind, in order: DataFrames, and runs of column dicts merged into one (built into a frame at flush:
        # one DataFrame per kind per flush instead of one per kind per micro-batch)
        self._buffer: dict[str, list[pl.DataFrame | dict[str, list]]] = {k: [] for k in KINDS}
        self._adds = 0
        self._last_flush = time.monotonic()
        self._lock = threading.RLock()  # the timer thread and the caller share the buffer
        self._timer: threading.Timer | None = None
        self.written: list[Path] = []

    def add(self, records: dict[str, dict[str, list] | pl.DataFrame]) -> None:
        """Buffer one micro-batch's records (kind -> columns), checked here: a kind or a column set other than its
        schema's, or columns of unequal lengths, raise now, not at the flush."""
        parts = [(kind, _checked(kind, cols)) for kind, cols in records.items()]
        with self._lock:
            for kind, part in parts:
                buf = self._buffer[kind]
                if isinstance(part, dict) and buf and isinstance(buf[-1], dict):
                    for c, values in part.items():
                        buf[-1][c].extend(values)
                else:
                    buf.append(part)
            self._adds += 1
            wait = self.flush_seconds - (time.monotonic() - self._last_flush)
            if self._adds % self.flush_every == 0 or wait <= 0:
                self.flush()
            elif self._timer is None:
                self._timer = threading.Timer(wait, self._timed_flush)
                self._timer.daemon = True
                self._timer.start()

    def _timed_flush(self) -> None:
        with self._lock:
            self._timer = None
            self.flush()

    __call__ = add

    def flush(self) -> list[Path]:
        """Write what is buffered; returns the files written."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._last_flush = time.monotonic()
            frames = {}
            for kind, parts in self._buffer.items():
                parts = [to_frame(kind, f) if isinstance(f, dict) else f for f in parts]
                parts = [f for f in parts if f.height]
                self._buffer[kind] = []
                if parts:
                    frames[kind] = pl.concat(parts, how="vertical")
            out = write_frames(self.run_dir, frames, rank=self.rank)
            self.written.extend(out)
            return out


# ---- reading, and run directories written with retired names (tokendyn.vocab.RETIRED) -----------------------------
def upgrade_columns(kind: str, lf: pl.LazyFrame, columns: Sequence[str]) -> pl.LazyFrame:
    """A record frame read from a file whose columns are ``columns``, with retired column names replaced by today's
    (`tokendyn.vocab.RETIRED`)."""
    rules = RETIRED.get(kind, {"columns": {}})
    renames = {old: new for old, new in rules["columns"].items() if old in columns and new not in columns}
    return lf.rename(renames) if renames else lf


def upgrade_values(kind: str, lf: pl.LazyFrame, lopti_order: str = "low_first") -> pl.LazyFrame:
    """Retired values replaced by today's (`tokendyn.vocab.RETIRED`; the old update stages stage1 / stage2, the first
    / second Lopti stage, become low / high by ``lopti_order``, the run's). Today's values are left as they are."""
    rules = RETIRED.get(kind, {"values": {}})
    for column, mapping in rules["values"].items():
        full = {**mapping, **{old: stage_name(n, lopti_order) for old, n in RETIRED_STAGE_COUNT.items()}}
        lf = lf.with_columns(pl.col(column).replace(full))
    return lf


def run_lopti_order(run_dir: str | os.PathLike) -> str:
    """The run's Lopti stage order from run.json's config (``low_first`` when absent)."""
    try:
        meta = json.loads((Path(run_dir) / "run.json").read_text())
    except (OSError, ValueError):
        return "low_first"
    order = (meta.get("config") or {}).get("lopti_order") if isinstance(meta, dict) else None
    return order if order in LOPTI_ORDERS else "low_first"


def _retired(kind: str, columns: Sequence[str]) -> bool:
    return bool(set(RETIRED.get(kind, {"columns": {}})["columns"]) & set(columns))


def scan_records(run_dir: str | os.PathLike, kind: str) -> pl.LazyFrame:
    """Every shard of ``kind`` (all ranks, all flushes) as one LazyFrame with the kind's schema; an empty frame if
    none. A column the schema gained after a shard was written reads as nulls, and a shard written with retired
    names (`upgrade_columns`, `upgrade_values`) is read in today's: run directories of older versions load."""
    if kind not in SCHEMAS:
        raise ValueError(f"unknown record kind {kind!r}; known: {', '.join(KINDS)}")
    schema = SCHEMAS[kind]
    files = shard_files(run_dir, kind)
    if not files:
        return pl.LazyFrame(schema=schema)
    current, old = [], []
    for f in files:  # glob=False: a run directory may contain [ ] * ? in its name
        renamed = RETIRED.get(kind, {}).get("columns")
        columns = pl.scan_parquet(f, glob=False).collect_schema().names() if renamed else []
        (old if _retired(kind, columns) else current).append((f, columns))
    parts = []
    if current:
        parts.append(
            pl.scan_parquet([str(f) for f, _ in current], schema=schema, glob=False, missing_columns="insert")
        )
    for f, columns in old:
        lf = upgrade_columns(kind, pl.scan_parquet(str(f), glob=False), columns)
        named = set(lf.collect_schema().names())
        parts.append(
            lf.select(
                [
                    pl.col(c).cast(t) if c in named else pl.lit(None, dtype=t).alias(c)
                    for c, t in schema.items()
                ]
            )
        )
    lf = parts[0] if len(parts) == 1 else pl.concat(parts, how="vertical")
    return upgrade_values(kind, lf, run_lopti_order(run_dir)) if RETIRED.get(kind, {}).get("values") else lf
