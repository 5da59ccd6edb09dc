"""verl's own trainer (``python -m verl.trainer.main_ppo``) on a CPU, with Ray, through verl's extension points:
the platform "cpu" (`cpu.CPUPlatform`, ``PlatformRegistry.register``) and the rollout "hf" (a Hugging Face
``generate`` server, `hf_rollout`, ``RolloutReplicaRegistry.register``). For a laptop, CI, or a first try of the
plugin before a GPU run; on GPUs verl's own platforms and rollouts (vLLM, SGLang) are the ones to use.

`register_backend()` runs in every verl process (the plugin entry point imports the package, whose `register()`
calls it). It registers both names, which change nothing until chosen. The one setting that turns the CPU backend on
is verl's own ``VERL_PLATFORM=cpu`` (set it in the environment of the ``main_ppo`` command; Ray's workers inherit
it): verl then creates the "cpu" platform, and `register_backend` applies what the platform needs besides
(`internals`: the FSDP engine looked up for "cuda", a gloo-only process group, float32 FSDP mixed precision unless
set). The rest is the command's: ``actor_rollout_ref.rollout.name=hf``, logical GPUs for the actor ranks
(``+ray_kwargs.ray_init.num_gpus=N``), enough logical CPUs for verl's actors and fewer transfer-queue storage units
(``docs/verl.md``, ``examples/verl_main_ppo.sh``).
"""

from __future__ import annotations

import os
import warnings

from tokendyn.integrations.verl import internals

PLATFORM_ENV = "VERL_PLATFORM"
PLATFORM_NAME = "cpu"
ADAPTER_PATH = "tokendyn.integrations.verl.hf_rollout.HFServerAdapter"


def _load_replica():
    from tokendyn.integrations.verl.hf_rollout import HFReplica

    return HFReplica


def cpu_selected() -> bool:
    """Whether this process runs verl on the CPU platform (``VERL_PLATFORM=cpu``)."""
    return os.environ.get(PLATFORM_ENV, "").strip().lower() == PLATFORM_NAME


def register_backend() -> bool:
    """Register the platform "cpu" and the rollout "hf" with verl, and, when ``VERL_PLATFORM=cpu``, apply what
    the CPU platform needs (see the module docstring); idempotent. False when verl's rollout modules cannot be
    imported here (they need verl's trainer dependencies: then no verl trainer can run in this process either), or
    when a verl internal it needs has moved (`internals.VerlInternalsChanged`: a warning, or the error itself with
    ``VERL_PLATFORM=cpu``)."""
    from verl.plugin.platform.platform_manager import PlatformRegistry

    try:
        from verl.workers.rollout.replica import RolloutReplicaRegistry
    except ImportError:
        return False

    from tokendyn.integrations.verl.cpu import CPUPlatform
    from tokendyn.integrations.verl.hf_rollout import ROLLOUT_NAME

    if PlatformRegistry.get(PLATFORM_NAME) is not CPUPlatform:
        PlatformRegistry.register(platform=PLATFORM_NAME)(CPUPlatform)
    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
    try:
        internals.register_rollout_adapter(ROLLOUT_NAME, ADAPTER_PATH)
        if cpu_selected():
            internals.use_fsdp_engine_on_any_device()
            internals.use_gloo_process_group()
            internals.fp32_by_default()
    except internals.VerlInternalsChanged as exc:
        if cpu_selected():
            raise
        # a GPU run does not need the CPU backend: say so, and leave the loss and the probe working
        warnings.warn(f"tokendyn: the verl CPU backend is unavailable: {exc}", stacklevel=2)
        return False
    return True
