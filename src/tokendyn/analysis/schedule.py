"""Which optimizer steps the probe records: ``probe_every`` counts rollouts.

A probed rollout is probed in every optimizer step of its update: every micro-batch of every step, and with Lopti
(or its random-halves control) both stages, so the live records (``binstats``, ``hist``, ``bound``, ``checks``,
``tokens``, ``sampler``, ``floor``) hold stage "low" and "high" of the same rollout. The rebalancing analyses run
once per probed rollout, on its batch before any update (Lopti's stage-2 shares at the start of stage 2).

``run.json`` states the schedule under ``probe_schedule`` (`schedule_entry`). A run written before it has no such
entry: its ``config.probe_every`` counted optimizer steps (a step was probed when ``step % probe_every == 0``, so
a rollout was probed in its first step only: a Lopti run's first stage). `read_schedule` reads either without
confusing the two, and `is_probed` answers for a step under either.
"""

from __future__ import annotations

SCHEDULE_KEY = "probe_schedule"  # run.json's entry
ROLLOUTS, OPTIMIZER_STEPS = "rollouts", "optimizer_steps"  # what ``every`` counts


def steps_per_rollout(steps_per_generation: int, passes: int, accumulation: int, stages: int = 1) -> int:
    """Optimizer steps TRL takes on one rollout batch: n = max(1, floor(G * mu / k)) * s, with G =
    ``steps_per_generation`` (micro-batches of a rollout batch), mu = ``passes`` over it per stage, k =
    ``accumulation`` (micro-batches per optimizer step) and s = ``stages`` (2 with Lopti, else 1)."""
    return max(1, int(steps_per_generation) * int(passes) // int(accumulation)) * int(stages)


def rollout_of(global_step: int, per_rollout: int) -> int:
    """r = floor(step / n): the rollout batch that optimizer step ``global_step`` updates on (n = ``per_rollout``)."""
    return int(global_step) // int(per_rollout)


def probed_rollout(global_step: int, every: int, per_rollout: int) -> bool:
    """Whether optimizer step ``global_step`` is probed: every > 0 and floor(step / n) mod every == 0 (``every``
    counts rollouts, n = ``per_rollout`` optimizer steps a rollout), so all n steps of a probed rollout are."""
    return every > 0 and rollout_of(global_step, per_rollout) % int(every) == 0


def schedule_entry(every: int, per_rollout: int) -> dict:
    """run.json's ``probe_schedule``: what ``every`` counts and the optimizer steps of one rollout."""
    return {"every": int(every), "counts": ROLLOUTS, "optimizer_steps_per_rollout": int(per_rollout)}


def read_schedule(meta: dict) -> dict:
    """The probe schedule of a run from its run.json (``meta``): its ``probe_schedule`` entry; for a run written
    before that entry, ``config.probe_every`` counted optimizer steps (``counts`` "optimizer_steps",
    ``optimizer_steps_per_rollout`` null: not needed to read it, and not recorded)."""
    if SCHEDULE_KEY in meta:
        return dict(meta[SCHEDULE_KEY])
    every = int((meta.get("config") or {}).get("probe_every") or 0)
    return {"every": every, "counts": OPTIMIZER_STEPS, "optimizer_steps_per_rollout": None}


def is_probed(global_step: int, schedule: dict) -> bool:
    """Whether the run with ``schedule`` (`read_schedule`) probed optimizer step ``global_step``."""
    every = int(schedule["every"])
    if schedule["counts"] == OPTIMIZER_STEPS:
        return every > 0 and int(global_step) % every == 0
    if schedule["counts"] != ROLLOUTS:
        raise ValueError(
            f"probe_schedule.counts: must be one of {ROLLOUTS}, {OPTIMIZER_STEPS}; got {schedule['counts']!r}"
        )
    return probed_rollout(global_step, every, int(schedule["optimizer_steps_per_rollout"]))
