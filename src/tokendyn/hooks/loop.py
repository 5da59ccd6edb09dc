"""`instrument`: the probe for any training loop, writing records to RUN_DIR/records/; with ``recorder=True`` also
the rebalancing analyses of a batch (`Recorder.analyze`) and the training log (`Recorder.log`), so that a custom
loop's run directory feeds every figure of `tokendyn figures`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import polars as pl
from torch import nn

from tokendyn.common import write_json
from tokendyn.config import ProbeConfig
from tokendyn.config import resolve as resolve_config
from tokendyn.effects.precision import CHECK_EVERY, MeasuredPrecision
from tokendyn.effects.rebalance import RebalanceOptions, analyze_batch
from tokendyn.hooks.options import rebalance_options
from tokendyn.probe.probe import GradientProbe
from tokendyn.records import RecordWriter, write_frames, write_parquet
from tokendyn.vocab import TRAIN


class Recorder:
    """What ``instrument(..., recorder=True)`` yields: the probe (every GradientProbe call, e.g. ``begin_step``,
    ``end_step``, is passed through) plus

    - ``analyze(batch, step=...)``: the rebalancing analyses of one `ProbeBatch` (per-bin gradient norms and update
      shares s_b = <g_b, g>/||g||^2, per-token shares, the counterfactual probability change and the influence
      matrix; `tokendyn.effects.rebalance.analyze_batch`, as the probe's `ProbeConfig` switches them on), written as
      records. Call it before the training forward (it leaves the model bitwise as it was).
    - ``log(step, reward=..., accuracy=..., **more)``: one row of RUN_DIR/metrics.parquet, the training log the
      training-curve figure reads (``accuracy`` is stored as ``rewards/accuracy/mean``; a key like
      ``heldout/accuracy_3ppl`` adds a held-out panel).
    """

    def __init__(
        self,
        probe: GradientProbe,
        model: nn.Module,
        run_dir: str | os.PathLike,
        options: RebalanceOptions,
        method: str,
        check_every: int = CHECK_EVERY,
    ):
        self.probe, self.model, self.run_dir = probe, model, Path(run_dir)
        self.options, self.method = options, method
        self.rows: list[dict] = []
        # the run's measured step precision (its checks' schedule; step_precision "measured")
        self.precision = MeasuredPrecision(every=check_every)

    def __getattr__(self, name: str):
        return getattr(self.probe, name)

    def analyze(
        self,
        batch,
        *,
        step: int,
        stage: str = TRAIN,
        stage_masks=None,
        lopti_order="low_first",
        objective=None,
    ) -> dict:
        """The analyses' record frames of ``batch`` at ``step`` (also written to RUN_DIR/records/); ``stage_masks``:
        the two Lopti stage masks in the order ``lopti_order``, or None. Call it before the training forward or
        after its backward: the counterfactual updates are made in place and undone bitwise
        (`tokendyn.effects.change.InPlaceUpdate`), which a live training graph that saved the weights refuses."""
        edges = (
            self.probe.bins.edges if self.probe.bins.kind != "quantiles" else None
        )  # (quantiles: the default)
        self.probe.enabled = False  # the analyses' own forwards and backwards are not training passes
        try:
            frames = analyze_batch(
                self.model,
                batch,
                step=step,
                stage=stage,
                edges=edges,
                options=self.options,
                objective=objective,
                stage_masks=stage_masks,
                lopti_order=lopti_order,
                precision_state=self.precision,
            )
        finally:
            self.probe.enabled = True
        write_frames(self.run_dir, frames, rank=self.probe.rank)
        return frames

    def log(self, step: int, **metrics: float) -> None:
        """Append one row (step, method and the given numbers) to RUN_DIR/metrics.parquet (rewritten atomically)."""
        row: dict = {"step": int(step), "method": self.method}
        for key, value in metrics.items():
            row["rewards/accuracy/mean" if key == "accuracy" else key] = float(value)
        self.rows.append(row)
        if self.probe.rank == 0:
            frame = pl.DataFrame(self.rows, infer_schema_length=None)
            write_parquet(frame, self.run_dir / "metrics.parquet")


def _write_run_json(run_dir, method: str, temperature: float, config: ProbeConfig) -> None:
    """A run.json for a custom loop (kept if one exists): the method's name labels the run in the figures."""
    path = Path(run_dir) / "run.json"
    if not path.is_file():
        info = {"config": {"temperature": temperature}, "probe": config.to_dict(), "source": "instrument"}
        write_json(path, {"method": method, **info})


@contextmanager
def instrument(
    model: nn.Module,
    run_dir: str | os.PathLike,
    config: ProbeConfig | None = None,
    *,
    temperature: float = 1.0,
    flush_every: int = 64,
    seed: int = 0,
    auto: bool = True,
    rank: int | None = None,
    data_parallel_size: int | None = None,
    recorder: bool = False,
    method: str = "custom loop",
    **options,
) -> Iterator[GradientProbe | Recorder]:
    """Probe `model` inside the block; every finished micro-batch goes to RUN_DIR/records/ (one file per kind per
    `flush_every` micro-batches, and at least every ``config.flush_seconds``: a kill loses at most that many seconds
    of records; one shard per rank; 1 writes at every micro-batch, a few ms each). ``config``: the probe's `ProbeConfig` (``**options`` override its fields, e.g.
    ``points="layers.*.out"``). Hooks are removed on exit, also on exceptions; records of finished steps are flushed
    either way. `rank` defaults to `tokendyn.records.process_rank()`. Under DDP or FSDP2 pass the wrapped (or
    sharded) model: its gradients are averaged over the processes and the records are divided accordingly
    (`GradientProbe`'s `data_parallel_size`), so the merged shards equal one process.

        with instrument(model, run_dir, ProbeConfig(bins="intervals:4")) as probe:
            for batch in loader:
                logps = token_logps(model, batch)  # [B, C] log pi_t of the completion tokens, at temperature T
                probe.begin_step(completion_mask=..., advantages=..., old_logp=..., completion_ids=...,
                                 logps=logps, temperature=T)
                loss = grpo_loss(logps, ...); loss.backward(); opt.step(); opt.zero_grad()
                probe.end_step()   # optional: the next forward or the end of the block ends the step too

    ``recorder=True`` yields a `Recorder`, which adds ``analyze`` (the analyses ``config`` switches on) and ``log``
    to the probe and writes a run.json naming ``method``. examples/custom_loop.py is a complete loop.
    """
    cfg = resolve_config(config, options)
    probe = GradientProbe(
        model,
        cfg,
        temperature=temperature,
        seed=seed,
        auto=auto,
        rank=rank,
        data_parallel_size=data_parallel_size,
    )
    writer = RecordWriter(run_dir, rank=probe.rank, flush_every=flush_every, flush_seconds=cfg.flush_seconds)
    probe.sink = writer.add
    yielded: GradientProbe | Recorder = probe
    if recorder:
        yielded = Recorder(
            probe, model, run_dir, rebalance_options(cfg, seed), method, cfg.precision_check_every
        )
        if probe.rank == 0:
            _write_run_json(run_dir, method, temperature, cfg)
    try:
        with probe:
            yield yielded
    finally:
        writer.flush()
