"""`instrument`: the probe for any training loop, writing records to RUN_DIR/records/; with ``analyses=True`` also
the rebalancing analyses of a batch (`Recorder.analyze`) and the training log (`Recorder.log`), so that a custom
loop's run directory feeds every figure of `tokendyn figures`."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import polars as pl
from torch import nn

from tokendyn.hooks.records import RecordWriter
from tokendyn.probe import BinSpec, GradientProbe


class Recorder:
    """What ``instrument(..., analyses=True)`` yields: the probe (every GradientProbe call, e.g. ``tokens``,
    ``end_step``, is passed through) plus

    - ``analyze(batch, step=...)``: the rebalancing analyses of one `ProbeBatch` (per-bin gradient norms and update
      shares s_b = <g_b, g>/||g||^2, per-token shares, the counterfactual probability change and the influence
      matrix; `tokendyn.probe.rebalance.analyze_batch`), written as records. Call it before the optimizer step
      (it leaves the model as it was).
    - ``log(step, reward=..., accuracy=..., **more)``: one row of RUN_DIR/metrics.parquet, the training log the
      training-curve figure reads (``accuracy`` is stored as ``rewards/accuracy/mean``; a key like
      ``heldout/accuracy_3ppl`` adds a held-out panel).
    """

    def __init__(
        self, probe: GradientProbe, model: nn.Module, run_dir: str | os.PathLike, options, method: str
    ):
        from pathlib import Path

        self.probe, self.model, self.run_dir = probe, model, Path(run_dir)
        self.options, self.method = options, method
        self.rows: list[dict] = []

    def __getattr__(self, name: str):
        return getattr(self.probe, name)

    def analyze(self, batch, *, step: int, stage: str = "train", stage_masks=None, objective=None) -> dict:
        """The analyses' record frames of ``batch`` at ``step`` (also written to RUN_DIR/records/)."""
        from tokendyn.probe.rebalance import analyze_batch
        from tokendyn.records import write_frames

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
            )
        finally:
            self.probe.enabled = True
        write_frames(self.run_dir, frames, rank=self.probe.rank)
        return frames

    def log(self, step: int, **metrics: float) -> None:
        """Append one row (step, method and the given numbers) to RUN_DIR/metrics.parquet (rewritten atomically)."""
        from tokendyn.records import write_atomic

        row: dict = {"step": int(step), "method": self.method}
        for key, value in metrics.items():
            row["rewards/accuracy/mean" if key == "accuracy" else key] = float(value)
        self.rows.append(row)
        if self.probe.rank == 0:
            frame = pl.DataFrame(self.rows, infer_schema_length=None)
            write_atomic(frame, self.run_dir / "metrics.parquet")


def _write_run_json(run_dir, method: str, temperature: float) -> None:
    """A run.json for a custom loop (kept if one exists): the method's name labels the run in the figures."""
    from pathlib import Path

    from tokendyn.common import write_json

    path = Path(run_dir) / "run.json"
    if not path.is_file():
        write_json(path, {"method": method, "config": {"temperature": temperature}, "source": "instrument"})


@contextmanager
def instrument(
    model: nn.Module,
    run_dir: str | os.PathLike,
    *,
    bins: BinSpec | str | int | Sequence[float] | None = None,
    layers: str | Sequence[str] | None = None,
    sample_tokens: int = 128,
    direct_tokens: int = 16,
    direct_every: int = 1,
    check_tokens: int | None = 256,
    temperature: float = 1.0,
    flush_every: int = 1,
    flush_seconds: float = 30.0,
    seed: int = 0,
    auto: bool = True,
    rank: int | None = None,
    data_parallel_size: int | None = None,
    analyses=False,
    method: str = "custom loop",
) -> Iterator[GradientProbe | Recorder]:
    """Probe `model` inside the block; every finished micro-batch goes to RUN_DIR/records/ (one file per kind per
    `flush_every` steps, and at least every `flush_seconds`: a kill loses at most that many seconds of records; one
    shard per rank). Hooks are removed on exit, also on exceptions; records of finished
    steps are flushed either way. `rank` defaults to the torch.distributed rank (or $RANK, or 0). Under DDP or
    FSDP2 pass the wrapped (or sharded) model: its gradients are averaged over the processes and the records are
    divided accordingly (`GradientProbe`'s `data_parallel_size`), so the merged shards equal one process.

        with instrument(model, run_dir, bins="intervals:4") as probe:
            for batch in loader:
                out = model(input_ids=batch.ids, attention_mask=batch.attn)
                logps = token_logps(out.logits[:, :-1] / T, batch.ids[:, 1:])[:, -C:]
                probe.tokens(completion_mask=..., advantages=..., pi_old=..., completion_ids=..., logps=logps,
                             temperature=T)
                loss = grpo_loss(logps, ...); loss.backward(); opt.step(); opt.zero_grad()
                probe.end_step()   # optional: the next forward or the end of the block ends the step too

    ``analyses``: True (or a `RebalanceOptions`) yields a `Recorder`, which adds ``analyze`` and ``log`` to the
    probe and writes a run.json naming ``method``. examples/custom_loop.py is a complete loop.
    """
    probe = GradientProbe(
        model,
        points=layers,
        bins=bins,
        sample_tokens=sample_tokens,
        direct_tokens=direct_tokens,
        direct_every=direct_every,
        check_tokens=check_tokens,
        temperature=temperature,
        seed=seed,
        auto=auto,
        rank=rank,
        data_parallel_size=data_parallel_size,
    )
    writer = RecordWriter(run_dir, rank=probe.rank, flush_every=flush_every, flush_seconds=flush_seconds)
    probe.sink = writer.add
    yielded: GradientProbe | Recorder = probe
    if analyses:
        from tokendyn.probe.rebalance import RebalanceOptions

        options = analyses if isinstance(analyses, RebalanceOptions) else RebalanceOptions(seed=seed)
        yielded = Recorder(probe, model, run_dir, options, method)
        if probe.rank == 0:
            _write_run_json(run_dir, method, temperature)
    try:
        with probe:
            yield yielded
    finally:
        writer.flush()
