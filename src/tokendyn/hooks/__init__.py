"""Attaching probes to training: `instrument` (any loop), `TrainerProbe` (TRL's GRPO loop, `tokendyn.hooks.trainer`)
and the offline probe of a rollouts file (`tokendyn.hooks.offline`). Records are written by
`tokendyn.records.RecordWriter`."""

from tokendyn.hooks.loop import Recorder, instrument

__all__ = ["Recorder", "instrument"]
