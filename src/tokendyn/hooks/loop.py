"""`instrument`: the probe for any training loop, writing records to RUN_DIR/records/."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn

from tokendyn.hooks.records import RecordWriter
from tokendyn.probe import BinSpec, GradientProbe


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
) -> Iterator[GradientProbe]:
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
    try:
        with probe:
            yield probe
    finally:
        writer.flush()
