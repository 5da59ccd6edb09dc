"""The spike trigger in a live run (`tokendyn.effects.spike.SpikeMonitor` on the probed rollouts of a trainer): what
`TrainerProbe` calls once per analysed rollout, and the one extra rollout it probes after a spike.

A probed rollout's values (||g|| from its `shares` frame; max |log rho| and max w from its analysis sample) are
checked against their running medians over the earlier probed rollouts (`tokendyn.effects.spike_trigger`); when one
fires, the rollout's top tokens by exact update share become its `spikes` record, and the rollout after it is probed
as well, whether or not ``probe_every`` makes it due (`extra`), so the records show whether the spike persisted."""

from __future__ import annotations

import polars as pl
from torch import nn

from tokendyn.effects import spike_trigger
from tokendyn.effects.spike import SpikeMonitor
from tokendyn.probe.tokenloss import Objective, ProbeBatch
from tokendyn.vocab import TRAIN


class LiveSpikes:
    """The trigger over a run's probed rollouts (k = ``probe_spike_k``) and the rollout to probe after a spike."""

    def __init__(self, k: float) -> None:
        self.monitor = SpikeMonitor(
            k, min_history=spike_trigger.DEFAULT_MIN_HISTORY, quantities=spike_trigger.DEFAULT_QUANTITIES
        )
        self.next_rollout: int | None = None  # probed as well: the one after a spike

    def observe(self, model: nn.Module, batch: ProbeBatch, *, step: int, rollout: int,
                frames: dict[str, pl.DataFrame], objective: Objective | None, edges, tokenizer) -> pl.DataFrame | None:  # fmt: skip
        """The rollout's `spikes` frame when the trigger fires on it (and the next rollout marked), else None."""
        found = self.monitor.observe(model, batch, step=step, frames=frames, stage=TRAIN, objective=objective,
                                     edges=edges, tokenizer=tokenizer)  # fmt: skip
        if found is not None:
            self.next_rollout = rollout + 1
        return found

    def extra(self, rollout: int) -> bool:
        """Whether ``rollout`` is probed because the one before it spiked."""
        return self.next_rollout == rollout
