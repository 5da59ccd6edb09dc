"""tokendyn in verl's actor worker: `install()` wraps `TrainingWorker.train_mini_batch` (verl 0.9's actor update,
`verl/workers/engine_workers.py`: ``ActorRolloutRefWorker.update_actor`` calls it once per RL step in every worker
process) so that a run whose actor loss is tokendyn's gets, from its config alone,

- the probe on the worker's engine when ``policy_loss.probe_dir`` is set (`probe.EngineProbe`, attached at the
  first update and kept; records flushed after every update), its per-bin scalars in the update's metrics, and the
  rebalancing analyses every ``probe_analyses_every``-th update (verl's own loss as the objective);
- Lopti's two full updates per batch when ``policy_loss.lopti_eta`` (or ``lopti_quantile``) is set (`lopti.lopti_update`, in the order
  ``policy_loss.lopti_order``; its KL and entropy terms restricted to the active group, `loss.lopti_ppo_loss`); the two
  stages' metrics are returned together (the mean of both, as verl reduces
  them), and tokendyn's own keys once per stage: ``actor/tokendyn/{low|high}/...``.

- each token's entropy handed to the tokendyn loss when its base mode reads it (ASPO: `loss.entropy_ppo_loss`).

Any other loss mode passes through untouched. The wrapper keeps the method's verl dispatch attributes
(`functools.wraps` copies the `register` decorator's), so the Ray worker group still finds it. `install` runs in
every worker through the plugin entry point (`register`); it is idempotent.
"""

from __future__ import annotations

import atexit
from functools import partial, wraps

import torch.distributed

from tokendyn.integrations.verl.batches import save_batch
from tokendyn.integrations.verl.lopti import lopti_update
from tokendyn.integrations.verl.loss import (
    TokendynPolicyLossConfig,
    entropy_ppo_loss,
    lopti_ppo_loss,
    needs_entropy,
)
from tokendyn.integrations.verl.probe import METRIC_PREFIX, EngineProbe

_MARK = "_tokendyn_wrapped"


def actor_config(worker):
    """The actor config of a `TrainingWorker` (its loss function is ``partial(ppo_loss, config=...)``), or None."""
    return getattr(getattr(worker, "loss_fn", None), "keywords", {}).get("config")


def worker_probe(worker, opts: TokendynPolicyLossConfig) -> EngineProbe | None:
    """The probe of this worker's engine, attached the first time (None when ``probe_dir`` is unset)."""
    if opts.probe_dir is None:
        return None
    probe = getattr(worker, "_tokendyn_probe", None)
    if probe is None:
        probe = EngineProbe(
            worker.engine,
            opts.probe_dir,
            opts.probe_config(),
            method=opts.method_name(),
            run_config=opts.run_config(),
            analyses_every=opts.probe_analyses_every,
        ).attach()
        worker._tokendyn_probe = probe
        atexit.register(probe.detach)
    return probe


def save_update_batch(worker, data, opts: TokendynPolicyLossConfig) -> None:
    """The batch of this update saved under ``probe_dir/batches`` (`batches.save_batch`) while fewer than
    ``probe_save_batches`` updates have been; counts the worker's updates."""
    update = getattr(worker, "_tokendyn_updates", 0)
    worker._tokendyn_updates = update + 1
    if update < opts.probe_save_batches:
        group = worker.engine.get_data_parallel_group()
        save_batch(
            data, opts.probe_dir, update, torch.distributed.get_rank(group) if group is not None else 0
        )


def merge_stage_metrics(outputs: dict) -> dict:
    """One metrics dict from the two Lopti stages' (key -> list over mini-batches): verl's keys concatenated over
    the stages; tokendyn's (``actor/tokendyn/...``) kept apart per stage as ``actor/tokendyn/{stage}/...``."""
    merged: dict[str, list] = {}
    for stage, out in outputs.items():
        for key, value in out.items():
            if key.startswith(METRIC_PREFIX):
                key = f"{METRIC_PREFIX}{stage}/{key[len(METRIC_PREFIX) :]}"
            merged.setdefault(key, []).extend(value if isinstance(value, list) else [value])
    return merged


def tokendyn_train_mini_batch(worker, data, original):
    """`TrainingWorker.train_mini_batch` with tokendyn's probe and Lopti as the actor config asks (see the module
    docstring); ``original`` is verl's own method."""
    config = actor_config(worker)
    opts = getattr(config, "policy_loss", None)
    if not isinstance(opts, TokendynPolicyLossConfig):
        return original(worker, data)
    probe = worker_probe(worker, opts)
    save_update_batch(worker, data, opts)
    plain_loss = worker.loss_fn
    try:
        if not opts.lopti:
            if not needs_entropy(opts):
                return original(worker, data)
            worker.loss_fn = partial(entropy_ppo_loss, config=config)  # ASPO reads H_t
            return original(worker, data)
        # Lopti's stages train with KL and entropy restricted to the active group (and H_t handed over for ASPO)
        worker.loss_fn = partial(entropy_ppo_loss, config=config, inner=lopti_ppo_loss)
        outputs = lopti_update(
            lambda d: original(worker, d),
            data,
            config,
            order=opts.lopti_order,
            probe=probe,
            group=worker.engine.get_data_parallel_group(),
            restricted=True,
        )
    finally:
        worker.loss_fn = plain_loss
        if probe is not None:
            probe.writer.flush()
    if any(out is None for out in outputs.values()):  # a rank that collects no outputs
        return None
    from verl.utils import tensordict_utils as tu

    metrics = merge_stage_metrics({stage: tu.get(out, "metrics") for stage, out in outputs.items()})
    return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics}).cpu()


def install() -> bool:
    """Wrap `TrainingWorker.train_mini_batch` once; False when verl's worker module cannot be imported here (it
    needs verl's trainer dependencies, e.g. fastapi: then no verl worker can run in this process either)."""
    try:
        from verl.workers.engine_workers import TrainingWorker
    except ImportError:
        return False
    original = TrainingWorker.train_mini_batch
    if getattr(original, _MARK, False):
        return True

    @wraps(original)
    def train_mini_batch(self, data):
        return tokendyn_train_mini_batch(self, data, original)

    setattr(train_mini_batch, _MARK, True)
    TrainingWorker.train_mini_batch = train_mini_batch
    return True
