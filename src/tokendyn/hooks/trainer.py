"""The probe inside TRL's GRPO loop: thin glue between `TokendynGRPOTrainer` and `GradientProbe`.

The trainer calls three methods: `begin(inputs, stage)` at the top of its loss (after the Lopti
stage masking, with exactly the tensors the loss uses), `end()` after the micro-step's backward,
and `close()` at the end of training. A probed optimizer step records every micro-batch of it;
Lopti's stages are recorded apart (stage "low" / "high"); plain GRPO is stage "train". No extra
forward or backward pass is made for these statistics: they are read from the training backward.
"""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from ..probe.probe import GradientProbe
from .records import RecordWriter


def stage_name(stage: int, order: str) -> str:
    """0 -> "train"; Lopti stage 1/2 -> "low"/"high" (reversed for ``high_first``)."""
    if stage == 0:
        return "train"
    first, second = ("low", "high") if order == "low_first" else ("high", "low")
    return first if stage == 1 else second


class TrainerProbe(TrainerCallback):
    """Owns the probe and its record writer for one trainer (also a callback: closes at train end)."""

    def __init__(self, trainer, run_dir: str | Path):
        args = trainer.args
        self.trainer = trainer
        self.every = int(args.probe_every)
        self.order = getattr(args, "lopti_order", "low_first")
        self.writer = RecordWriter(run_dir, rank=trainer.accelerator.process_index, flush_every=8)
        self.probe = GradientProbe(
            trainer.accelerator.unwrap_model(trainer.model),
            points=args.probe_layers,
            bins=args.probe_bins,
            sample_tokens=args.probe_sample_tokens,
            direct_tokens=args.probe_direct_tokens,
            direct_every=args.probe_direct_every,
            temperature=args.temperature,
            seed=args.seed,
            sink=self.writer.add,
            rank=trainer.accelerator.process_index,
        ).attach()
        self._open = False

    def due(self) -> bool:
        return self.every > 0 and self.trainer.state.global_step % self.every == 0

    def begin(self, inputs: dict, stage: int) -> None:
        if not self.due() or not self.trainer.model.training:
            return
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        self.probe.begin_step(
            self.trainer.state.global_step,
            stage_name(stage, self.order),
            completion_mask=mask,
            advantages=inputs["advantages"],
            old_logps=inputs.get("old_per_token_logps"),
            completion_ids=inputs["completion_ids"],
            temperature=self.trainer.temperature,
        )
        self._open = True

    def end(self) -> None:
        if self._open:
            self._open = False
            self.probe.end_step()

    def close(self) -> None:
        self.probe.detach()
        self.writer.flush()

    def on_train_end(self, args, state, control, **kwargs):
        self.close()
