"""Record files on disk: every kind's schema, the file layout and atomic writes (polars only; no torch).

Shared by the producers (`tokendyn.probe`, `tokendyn.hooks`) and the readers (`tokendyn.analysis`, `tokendyn.figures`).

Layout: RUN_DIR/records/{kind}-rank{RRR}-{NNNNNN}.parquet, one file per kind per flush, one shard per process
rank; NNNNNN counts this rank's flushes of that kind (a new writer continues after the files already there, so
nothing written earlier is overwritten). Each file is written to a hidden temp file in the same folder, then
renamed with os.replace (atomic on POSIX): readers never see a partial file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import polars as pl

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
# the distribution of delta pi over a set of tokens (tokendyn.probe.change.delta_summary), then the correct ratios
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
    # ---- rebalancing analyses (tokendyn.probe.shares / change / influence); bin -1 = all tokens
    # per (bin, parameter group): ||g_b||, <g_b, g>, ||g||, s_b = <g_b, g>/||g||^2; layer "all" = every parameter;
    # jvp_share = sum of the per-token JVP shares of the bin (layer "all" only); loss = L of the batch; share null
    # where g = 0. stage "train": the whole loss; a Lopti run's stages "low" / "high": the stage's loss at the stage
    # start (step = the global step then: stage 2 later than the rollout's other records)
    "shares": {
        **_REBALANCE_KEY,
        "bin": pl.Int32,
        "bin_lo": pl.Float64,
        "bin_hi": pl.Float64,
        "layer": pl.Utf8,
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
    # update_stage: all | stage1 | stage2 | total (Lopti); source_bin: the bin the update used (-1 all tokens)
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
        **_DELTA,
    },
    # M[source, target]: mean |delta pi| (and the distribution of delta pi, correct ratios) over target-bin tokens after an update with only
    # the source bin's tokens; update_stage all | stage1 | stage2 (Lopti)
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
        **_DELTA,
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


def write_atomic(df: pl.DataFrame, path: Path) -> None:
    """Write parquet to a temp file next to `path`, fsync, then os.replace: all or nothing."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        df.write_parquet(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_frames(
    run_dir: str | os.PathLike, frames: dict[str, pl.DataFrame], rank: int | None = None
) -> list[Path]:
    """Write each non-empty frame as RUN_DIR/records/{kind}-rank{rank:03d}-{seq:06d}.parquet (seq: this rank's next
    free number for that kind), atomically. Returns the files written."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else int(rank)
    checked = {kind: to_frame(kind, df) for kind, df in frames.items()}
    out = []
    d = records_dir(run_dir)
    for kind, df in checked.items():
        if df.height == 0:
            continue
        d.mkdir(parents=True, exist_ok=True)
        seqs = [
            int(m["seq"])
            for f in shard_files(run_dir, kind)
            if (m := _NAME.match(f.name)) and int(m["rank"]) == rank
        ]
        path = d / f"{kind}-rank{rank:03d}-{max(seqs, default=-1) + 1:06d}.parquet"
        write_atomic(df, path)
        out.append(path)
    return out
