"""Live probe metrics: at every probed step, the numbers a user watches go through the Trainer's own ``report_to``
(TensorBoard, W&B, ...), in the same log row as TRL's reward and loss.

Read from the records themselves, so that nothing is computed twice: the probe's step records as they are handed to
the record writer (``binstats``, ``checks``), and the rebalancing analyses' files as they land in RUN_DIR/records
(``shares``, ``prob_change``). Keys (b: the π_old bin; definitions in docs/definitions.md):

- ``probe/token_share/bin{b}``: the share of the step's scored completion tokens in bin b (final probe point);
- ``probe/grad_norm_rel/bin{b}``: ‖g_b‖ / ‖g‖ over every parameter; ``probe/update_share/bin{b}``: s_b = ⟨g_b, g⟩/‖g‖²
  (a Lopti run's stage decompositions as ``probe/update_share/{low|high}/bin{b}``);
- ``probe/correct_pos/bin{b}``, ``probe/correct_neg/bin{b}``: correct ratios after the counterfactual all-token
  update, and the tie counts ``tie_pos``, ``tie_neg`` as ``probe/{column}/bin{b}``;
- ``probe/sampler/{mean_log_rho|abs_p99|envelope|mean_weight|frac_seq_masked}/{bin{b}|all}``: the sampler's
  mismatch per π_old bin (`tokendyn.analysis.mismatch`) from each ``sampler`` records file as it lands (vLLM runs);
  ``probe/floor/{abs_mean|abs_p99}/{bin{b}|all}``: the same for the trainer against itself (``floor`` records);
- ``probe/sampler/tail_above/{t}/{bin{b}|all}``, ``.../tail_below/{t}/...``: the share of tokens with rho > t, rho < t
  (the fixed band 1.1 and 1 / 1.1, the correction's recorded clip_max and clip_min); ``probe/sampler/{abs_mean|mean_log_rho}/{pos|neg|zero}/{bin{b}|all}``:
  the mismatch by the sign of the advantage (the sampler rows the ``tokens`` sample holds); and
  ``probe/update_share/{pos|neg|zero}/{bin{b}|all}``: the update share by sign where the ``token_shares`` sample
  holds the whole bin (`tokendyn.hooks.live_mismatch`), each step's rows joined whatever files they land in (the
  latest step's metrics win); a family that fails logs one warning and is skipped for that log, never failing
  training;
- ``probe/bound_violations``: logits-bound + head-bound violations (must be 0); ``probe/identity_max_rel_err``: the
  LM-head identity's largest relative error.

A probed optimizer step made of several micro-batches (gradient accumulation) hands one set of records per
micro-batch: the step metrics are those of all of them together (token counts and violations summed, the largest
error), the latest probed step's. Rank 0's records only (the other ranks' shards are merged on disk, not live).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import polars as pl
from transformers import TrainerCallback

from tokendyn.analysis.mismatch import mismatch_table
from tokendyn.hooks.live_mismatch import (
    JOINED,
    StepRows,
    config_of,
    sign_metrics,
    tail_metrics,
    update_sign_metrics,
)
from tokendyn.records import shard_files
from tokendyn.vocab import FULL_UPDATES

log = logging.getLogger(__name__)
ANALYSIS_KINDS = ("shares", "prob_change", "sampler", "floor")
JOIN_ONLY = ("tokens", "token_shares")  # kinds read for the sign split only: their `JOINED` columns alone
SAMPLER_METRICS = ("mean_log_rho", "abs_p99", "envelope", "mean_weight", "frac_seq_masked")
FLOOR_METRICS = ("abs_mean", "abs_p99")  # the trainer against itself: what a sampler's mismatch must exceed
# the columns `step_metrics` reads, per kind of the probe's step records
STEP_COLUMNS = {
    "binstats": ("quantity", "point", "bin", "count"),
    "checks": ("logits_violations", "head_violations", "identity_max_rel_err"),
}


def _frame(cols) -> pl.DataFrame:
    return cols if isinstance(cols, pl.DataFrame) else pl.DataFrame(cols)


def _finite(x) -> bool:
    return x is not None and isinstance(x, int | float) and math.isfinite(x)


def _columns(records: dict, kind: str) -> dict[str, list]:
    """One kind of a probe step's records as column lists (records are column dicts, or DataFrames)."""
    cols = records.get(kind)
    if cols is None:
        return {}
    return cols if isinstance(cols, dict) else cols.to_dict(as_series=False)


def final_point_sums(records: dict) -> dict[int, tuple[int, float]]:
    """(scored tokens, sum of ||delta||^2) per pi_old bin, in bin order, at the deepest probe point (the final norm
    when probed) of a probe step's records; the sums are 0 where the records carry no sumsq. Plain lists: this runs
    after every micro-batch, where building a DataFrame alone costs milliseconds."""
    b = _columns(records, "binstats")
    rows = [
        i
        for i, (q, k) in enumerate(zip(b.get("quantity", []), b.get("bin", []), strict=True))
        if q == "norm" and k >= 0
    ]
    if not rows:
        return {}
    depth = b.get("point_index") or b["point"]  # a selection without point_index: the names' order
    points = {b["point"][i]: depth[i] for i in rows}
    last = "final_norm.out" if "final_norm.out" in points else max(points, key=points.__getitem__)
    sq = b.get("sumsq") or [0.0] * len(b["point"])
    out: dict[int, tuple[int, float]] = {}
    for i in rows:
        if b["point"][i] == last:
            count, sumsq = out.get(b["bin"][i], (0, 0.0))
            out[b["bin"][i]] = (count + int(b["count"][i]), sumsq + float(sq[i] or 0.0))
    return dict(sorted(out.items()))


def check_sums(records: dict) -> tuple[float | None, float | None]:
    """(logits + head bound violations, the largest LM-head identity error) of a probe step's records; None where
    the records have no checks (or no finite error)."""
    c = _columns(records, "checks")
    if not c or not c["logits_violations"]:
        return None, None
    violations = float(sum(c["logits_violations"]) + sum(c["head_violations"]))
    errors = [e for e in c["identity_max_rel_err"] if e is not None and e == e]
    return violations, (float(max(errors)) if errors else None)


def step_metrics(records: dict) -> dict[str, float]:
    """The live metrics of one probe step's records (kind -> columns): token shares per bin, bound violations and
    the identity error."""
    out: dict[str, float] = {}
    counts = {k: c for k, (c, _) in final_point_sums(records).items()}
    total = sum(counts.values())
    if total:
        out.update({f"probe/token_share/bin{k}": c / total for k, c in counts.items()})
    violations, err = check_sums(records)
    if violations is not None:
        out["probe/bound_violations"] = violations
    if err is not None:
        out["probe/identity_max_rel_err"] = err
    return out


def analysis_metrics(kind: str, df: pl.DataFrame) -> dict[str, float]:
    """The live metrics of one analyses file: update shares and relative norms (``shares``), correct ratios and tie
    counts after the counterfactual all-token update (``prob_change``), the sampler's mismatch per bin
    (``sampler``)."""
    out: dict[str, float] = {}
    if kind == "shares":
        rows = df.filter((pl.col("group") == "all") & (pl.col("bin") >= 0))
        for stage, b, share, norm, total in rows.select(
            "stage", "bin", "share", "grad_norm", "total_norm"
        ).rows():
            tag = "" if stage == "train" else f"{stage}/"
            if _finite(share):
                out[f"probe/update_share/{tag}bin{b}"] = float(share)
            if _finite(norm) and _finite(total) and total > 0:
                out[f"probe/grad_norm_rel/{tag}bin{b}"] = float(norm) / float(total)
    elif kind == "prob_change":
        rows = df.filter(
            (pl.col("update") == "counterfactual")
            & (pl.col("source_bin") == -1)
            & pl.col("update_stage").is_in(FULL_UPDATES)
            & (pl.col("bin") >= 0)
        )
        ties = [c for c in ("tie_pos", "tie_neg") if c in df.columns]
        for row in rows.iter_rows(named=True):
            for col in ("correct_pos", "correct_neg", *ties):
                if _finite(row[col]):
                    out[f"probe/{col}/bin{row['bin']}"] = float(row[col])
    elif kind in ("sampler", "floor"):
        table = mismatch_table(df)
        rows = table.filter(pl.col("side") == "pi_old") if table.height else table
        for row in rows.iter_rows(named=True):
            tag = "all" if row["bin"] < 0 else f"bin{row['bin']}"
            for col in SAMPLER_METRICS if kind == "sampler" else FLOOR_METRICS:
                if _finite(row[col]):
                    out[f"probe/{kind}/{col}/{tag}"] = float(row[col])
    return out


class LiveProbeMetrics(TrainerCallback):
    """Adds the probe's live metrics to the next log row of the trainer (first among the callbacks, so that the
    report_to integrations and metrics.parquet see them). Attach with `attach_live_metrics`."""

    def __init__(self, run_dir: str | Path, config: dict | None = None):
        self.run_dir = Path(run_dir)
        self.config = config  # the correction's thresholds (`live_mismatch.config_of`); None: none recorded
        self._rows = {kind: StepRows(kind) for kind in JOINED}  # the rows the sign splits join, by step
        self.pending: dict[str, float] = {}
        self.seen: set[Path] = set()
        self._step: int | None = None  # the probed step whose micro-batches `_parts` holds
        self._parts: dict[str, list[pl.DataFrame]] = {}
        self._step_keys: set[str] = set()  # the keys of `pending` that `step_metrics` set for that step

    def collect(self, records: dict) -> None:
        """Add one micro-batch's step records (kind -> columns): merged with the earlier micro-batches of the same
        probed step (a new step starts afresh), and the step's metrics (`step_metrics` of the merged records)
        replace those pending."""
        frames = {k: _frame(records[k]) for k in STEP_COLUMNS if k in records}
        frames = {k: f for k, f in frames.items() if f.height}
        if not frames:
            return
        steps = [int(f["step"].max()) for f in frames.values() if "step" in f.columns]
        step = max(steps) if steps else self._step
        if step != self._step:
            self._step, self._parts = step, {}
        for kind, f in frames.items():
            self._parts.setdefault(kind, []).append(f.select(c for c in STEP_COLUMNS[kind] if c in f.columns))
        merged = {k: pl.concat(parts, how="diagonal_relaxed") for k, parts in self._parts.items()}
        metrics = step_metrics(merged)
        for key in self._step_keys - set(metrics):
            self.pending.pop(key, None)
        self._step_keys = set(metrics)
        self.pending.update(metrics)

    def on_train_begin(self, args, state, control, **kwargs):
        kinds = (*ANALYSIS_KINDS, *JOIN_ONLY)
        self.seen = {f for kind in kinds for f in shard_files(self.run_dir, kind)}  # earlier (resumed)

    def _family(self, name: str, failed: set[str], fn, *args) -> None:
        """Add ``fn(*args)``'s metrics to those pending; an error logs one warning line naming the family and skips
        it for the rest of this log (``failed``): the live metrics never fail training."""
        if name in failed:
            return
        try:
            self.pending.update(fn(*args))
        except Exception as err:  # noqa: BLE001 - a metric family must not stop training
            failed.add(name)
            msg = " ".join(f"{type(err).__name__}: {err}".split())
            log.warning("tokendyn live metrics: %s skipped at this log (%s)", name, msg)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or not state.is_world_process_zero:
            return
        failed: set[str] = set()
        touched: dict[str, set[int]] = {"sign": set(), "update": set()}  # steps with fresh rows, per split
        for kind in ("tokens", *ANALYSIS_KINDS, "token_shares"):
            for f in [f for f in shard_files(self.run_dir, kind) if f not in self.seen]:
                self.seen.add(f)
                if kind in JOIN_ONLY:
                    names = pl.read_parquet_schema(f)
                    df = pl.read_parquet(f, columns=[c for c in JOINED[kind] if c in names])
                else:
                    df = pl.read_parquet(f)
                if kind in JOINED:
                    split = "sign" if kind in ("sampler", "tokens") else "update"
                    touched[split] |= self._rows[kind].add(df)
                if kind in ANALYSIS_KINDS:
                    self.pending.update(analysis_metrics(kind, df))
                if kind == "sampler":
                    self._family("tail_metrics", failed, tail_metrics, df, self.config)
        rows = {kind: buffer.step for kind, buffer in self._rows.items()}
        for step in sorted(touched["sign"]):  # the latest step's metrics win
            sampler, tokens = rows["sampler"](step), rows["tokens"](step)
            if sampler is not None and tokens is not None:
                self._family("sign_metrics", failed, sign_metrics, sampler, tokens)
        for step in sorted(touched["update"]):
            if (token_shares := rows["token_shares"](step)) is not None:
                self._family(
                    "update_sign_metrics", failed, update_sign_metrics, token_shares, rows["shares"](step)
                )
        logs.update(self.pending)
        self.pending = {}


def attach_live_metrics(trainer) -> LiveProbeMetrics | None:
    """Log the probe's live metrics through ``trainer``'s ``report_to`` (a `TokendynGRPOTrainer` with the probe on;
    None otherwise). `tokendyn train` does this whenever ``--report_to`` names an integration."""
    owner = getattr(trainer, "probe", None)
    probe = getattr(owner, "probe", None)
    if probe is None:
        return None
    live = LiveProbeMetrics(trainer.args.output_dir, config_of(trainer.args))
    sink = probe.sink

    def both(records: dict) -> None:
        live.collect(records)
        if sink is not None:
            sink(records)

    probe.sink = both
    trainer.callback_handler.callbacks.insert(0, live)  # before the integrations read the row
    return live
