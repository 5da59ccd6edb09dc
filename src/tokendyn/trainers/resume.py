"""Resuming a run from a ``checkpoint-N`` folder: the same run, continued, with nothing on disk counted twice.

A checkpoint is TRL's/transformers': weights, optimizer, scheduler, RNG states and ``trainer_state.json``
(``global_step`` = N). It is written only on rollout boundaries (``save_steps`` counts rollouts, so no half-used
rollout batch has to be rebuilt). Resuming from it:

* the run directory is cut back to step N before any training: metrics rows with step > N and record rows with
  step >= N are dropped (a record's step is the global step *before* its optimizer step, so the records of
  steps 0..N-1 are the ones the checkpoint has seen; see `tokendyn.records`), and so are dumped rollouts
  ``rollouts/step-S.parquet`` with S >= N;
* TRL's micro-step counter ``_step`` (which drives the generation period, the Lopti stage schedule and the probe's
  rollout-start test) is set to N * gradient_accumulation_steps, where an uninterrupted run has it;
* after every optimizer step the probe's last micro-batch is recorded, and before each checkpoint is written the
  buffered records are flushed, so a checkpoint never runs ahead of the records on disk; the probe's own state (its
  token-sample generator and pass counters) is saved in the checkpoint and restored with it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from transformers import TrainerCallback

from ..common import UsageError

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
TRUE_WORDS = ("true", "yes", "1", "last")
FALSE_WORDS = ("", "false", "no", "0", "none")


class ResumeError(UsageError):
    """A ``--resume_from_checkpoint`` that cannot be honoured (names the path and what is expected)."""


def checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The ``checkpoint-N`` folders of a run directory, in step order."""
    d = Path(output_dir)
    if not d.is_dir():
        return []
    found = [(int(m[1]), p) for p in d.iterdir() if p.is_dir() and (m := CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found)]


def checkpoint_step(path: str | os.PathLike) -> int:
    """``global_step`` of a checkpoint folder (from its trainer_state.json)."""
    state = Path(path) / "trainer_state.json"
    try:
        step = json.loads(state.read_text())["global_step"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ResumeError(
            f"resume_from_checkpoint: {str(state)!r} is missing or unreadable (a checkpoint-N folder written by "
            "tokendyn train holds trainer_state.json, the weights, optimizer.pt and scheduler.pt)"
        ) from None
    if not isinstance(step, int) or step < 0:
        raise ResumeError(f"resume_from_checkpoint: {str(state)!r} has no valid global_step (got {step!r})")
    return step


def resolve_checkpoint(value, output_dir: str | os.PathLike) -> Path | None:
    """The checkpoint folder to resume from: None (do not resume), ``true`` (the last ``checkpoint-N`` in
    output_dir) or a path. Everything a resume needs is checked here, before any work."""
    if value is None or value is False:
        return None
    text = str(value).strip()
    if text.lower() in FALSE_WORDS:
        return None
    if value is True or text.lower() in TRUE_WORDS:
        found = checkpoints(output_dir)
        if not found:
            raise ResumeError(
                f"resume_from_checkpoint: true, but output_dir {str(output_dir)!r} holds no checkpoint-N folder "
                "(give a checkpoint path, or train without --resume_from_checkpoint)"
            )
        path = found[-1]
    else:
        path = Path(text)
        if not path.exists():
            raise ResumeError(
                f"resume_from_checkpoint: {text!r} does not exist (give a checkpoint-N folder or true)"
            )
        if not path.is_dir():
            raise ResumeError(
                f"resume_from_checkpoint: {text!r} is not a directory (give a checkpoint-N folder)"
            )
    checkpoint_step(path)
    missing = [f for f in ("optimizer.pt", "scheduler.pt") if not (path / f).is_file()]
    has_weights = any((path / f).is_file() for f in ("model.safetensors", "pytorch_model.bin")) or any(
        path.glob("model-*.safetensors")
    )
    if missing or not has_weights:
        what = missing + ([] if has_weights else ["model.safetensors"])
        raise ResumeError(
            f"resume_from_checkpoint: {str(path)!r} lacks {', '.join(what)} (it is not a complete training "
            "checkpoint; `final/` holds only the weights)"
        )
    return path


def check_save_steps(cfg) -> None:
    """``save_steps`` counts rollouts in `tokendyn train` (so a checkpoint never cuts a rollout batch in two): a
    whole number >= 1 (transformers' fractions of the run are not accepted)."""
    if str(getattr(cfg.save_strategy, "value", cfg.save_strategy)) != "steps":
        return
    steps = cfg.save_steps
    if not float(steps).is_integer() or int(steps) < 1:
        raise ResumeError(
            f"save_steps: must be a whole number of rollouts >= 1 (a checkpoint never cuts a rollout batch in two), "
            f"got {steps!r}"
        )


def untied_missing_keys(model, missing_keys) -> list[str]:
    """The keys of ``missing_keys`` (of ``model.state_dict()``, absent from a loaded checkpoint) that are really
    missing: less those whose tensor is tied to the tensor of a key the checkpoint held (the same storage, offset,
    shape and strides, e.g. an LM head tied to the input embeddings, which a checkpoint stores once): loading that
    key loaded them too."""
    missing = list(missing_keys)
    if not missing:
        return missing

    def place(t):
        if t is None or t.numel() == 0 or t.is_meta:
            return None
        return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype

    tensors = model.state_dict(keep_vars=True)
    skip = set(missing)
    loaded = {place(t) for k, t in tensors.items() if k not in skip} - {None}
    return [k for k in missing if (p := place(tensors.get(k))) is None or p not in loaded]


# ---- cutting the run directory back to the checkpoint ----------------------------------------------------------
def truncate_records(run_dir: str | os.PathLike, step: int) -> int:
    """Drop every record row with step >= ``step`` (each shard rewritten atomically, or removed when emptied) and
    every dumped rollouts file of such a step. Returns the rows dropped."""
    import polars as pl

    from tokendyn.records import KINDS, shard_files, write_parquet

    dropped = 0
    for kind in KINDS:
        for f in shard_files(run_dir, kind):
            top = pl.scan_parquet(f).select(pl.col("step").max()).collect().item()
            if top is None or top < step:
                continue  # the usual case: only the step column is read
            frame = pl.read_parquet(f)
            keep = frame.filter(pl.col("step") < step)
            if keep.height == frame.height:
                continue
            dropped += frame.height - keep.height
            if keep.height:
                write_parquet(keep, f)
            else:
                f.unlink()
    dumps = Path(run_dir) / "rollouts"
    if dumps.is_dir():
        for f in dumps.glob("step-*.parquet"):
            m = re.match(r"^step-(\d+)\.parquet$", f.name)
            if m and int(m[1]) >= step:
                f.unlink()
    return dropped


def kept_metrics(path: str | os.PathLike, step: int) -> list[dict]:
    """The rows of an earlier metrics.parquet logged at steps <= ``step`` (the ones the checkpoint has seen), less a
    finished session's summary row (``train_runtime``, ...): the resumed session logs its own at its end."""
    import polars as pl

    path = Path(path)
    if not path.is_file():
        return []
    frame = pl.read_parquet(path).filter(pl.col("step") <= step)
    if "train_runtime" in frame.columns:
        frame = frame.filter(pl.col("train_runtime").is_null())
    return [{k: v for k, v in row.items() if v is not None} for row in frame.iter_rows(named=True)]


PROBE_STATE = "tokendyn_probe-rank{rank:03d}.pt"


def probe_state(probe) -> dict:
    """What a `GradientProbe` carries from step to step: its token-sample generator, its pass counters and its
    sigma_max schedule."""
    return {
        "generator": probe.generator.get_state(),
        "sigma": probe.sigma_state(),
        "n_prepared": probe._n_prepared,
        "next_step": probe._next_step,
        "micro": dict(probe._micro),
    }


def load_probe_state(probe, state: dict) -> None:
    probe.generator.set_state(state["generator"])
    probe._n_prepared = int(state["n_prepared"])
    probe._next_step = int(state["next_step"])
    probe._micro.clear()
    probe._micro.update(state["micro"])
    if "sigma" in state:  # checkpoints written before the sigma schedule existed
        probe.load_sigma_state(state["sigma"])


class ResumeCallback(TrainerCallback):
    """Puts TRL's micro-step counter and the probe's state where the checkpoint left them; flushes the records
    before, and saves the probe's state into, every checkpoint."""

    def __init__(self, trainer, marker: Path | None = None, resume: Path | None = None):
        self.trainer = trainer
        self.marker = (
            marker  # the tokendyn tokenizer marker, copied into each checkpoint (see load_tokenizer)
        )
        self.resume = resume

    def _probe(self):
        holder = getattr(self.trainer, "probe", None)
        return None if holder is None else holder.probe

    def _state_file(self, folder: Path) -> Path:
        return folder / PROBE_STATE.format(rank=self.trainer.accelerator.process_index)

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.global_step:
            return
        # resumed: the counter an uninterrupted run has at this step
        self.trainer._step = state.global_step * args.gradient_accumulation_steps
        probe = self._probe()
        if probe is not None and self.resume is not None:
            f = self._state_file(self.resume)
            if not f.is_file():
                import warnings

                warnings.warn(
                    f"resume: {f} is missing: the probe's token samples restart from their seed", stacklevel=2
                )
                return
            import torch

            load_probe_state(probe, torch.load(f, weights_only=True))

    def on_step_end(self, args, state, control, **kwargs):
        holder = getattr(self.trainer, "probe", None)
        if holder is None:
            return
        if control.should_save:
            holder.writer.flush()

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if not folder.is_dir():
            return
        probe = self._probe()
        if probe is not None:
            import torch

            torch.save(probe_state(probe), self._state_file(folder))
        if self.marker is not None and state.is_world_process_zero:
            (folder / self.marker.name).write_text(self.marker.read_text())
