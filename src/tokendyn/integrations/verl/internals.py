"""Every verl internal (not a documented extension point) that tokendyn's CPU backend (`backend`, `hf_rollout`,
`cpu`) leans on, and every verl function the glue wraps, named once, here, for verl 0.9.x. `check()` looks at each and raises naming the one that moved;
``tests/test_verl_main_ppo.py`` runs it, so an upgrade of verl that changes any of them fails there first, loudly.

The public extension points the backend uses are not listed: `PlatformRegistry.register` (verl's platform plugin
interface), `RolloutReplicaRegistry.register` (``docs/extend_guide.rst``), `BaseRollout` / `RolloutReplica` /
`TokenOutput`, verl's plugin entry points. What it takes beyond them:

1. `ROLLOUT_ADAPTERS`: ``verl.workers.rollout.base._ROLLOUT_REGISTRY``, the private dict (rollout name, mode) ->
   "module.Class" from which the actor worker builds its in-process rollout adapter (`get_rollout_class`); verl
   offers no function to add to it.
2. `PROCESS_GROUP_MODULE` / `PROCESS_GROUP_FUNCTION`: ``verl.workers.engine_workers`` imports
   ``initialize_global_process_group_ray`` by name and calls it without a backend, which then is
   ``"cpu:gloo,{device}:{backend}"``: on the CPU platform that is ``"cpu:gloo,cpu:gloo"``, which torch rejects
   (duplicate device type). `use_gloo_process_group()` rebinds that module's name to a wrapper passing
   ``backend="cpu:gloo"`` when none is given (the call looks the name up at call time, so this works whenever it
   runs before the worker is built).
3. `ENGINE_DEVICE_ENV`: verl's `EngineRegistry` looks the FSDP engine up by the device in
   ``VERL_ENGINE_DEVICE`` (falling back to the platform's device name); the engine is registered for "cuda" and
   "npu" only, so the CPU backend sets it to "cuda" (the engine then runs on the platform's device, the CPU).
4. `ENGINE_CONFIG_CLASS`: ``FSDPEngineConfig.mixed_precision`` None means bf16 parameters under autocast
   (``transformer_impl._build_fsdp_module``); `fp32_by_default()` wraps its ``__post_init__`` so that None becomes
   float32 param / reduce / buffer dtypes (an explicit setting is kept): the rollout server and the actor then
   compute the same log-probs.
5. `PLATFORM_SINGLETON`: ``platform_manager._current_platform``, read (never through `get_platform()`, which
   would auto-detect first) to see whether a platform is set already.

The functions the glue wraps (`WRAPPED`: module, attribute, method or None, the leading parameters the wrapper
passes on):

6. ``verl.utils.config.validate_config`` and ``verl.trainer.ppo.rollout_corr_helper.apply_bypass_mode``: the
   ``bypass_mode`` guard (`correction.install`);
7. ``verl.workers.engine_workers.TrainingWorker.train_mini_batch``: the probe and Lopti's two updates
   (`worker.install`).
"""

from __future__ import annotations

import importlib
import inspect
import os
from functools import wraps

ROLLOUT_ADAPTERS = ("verl.workers.rollout.base", "_ROLLOUT_REGISTRY")
PROCESS_GROUP_MODULE = "verl.workers.engine_workers"
PROCESS_GROUP_FUNCTION = "initialize_global_process_group_ray"
ENGINE_DEVICE_ENV = "VERL_ENGINE_DEVICE"
ENGINE_DEVICE = "cuda"  # the device the FSDP engine is registered for
ENGINE_CONFIG_CLASS = ("verl.workers.config.engine", "FSDPEngineConfig")
PLATFORM_SINGLETON = ("verl.plugin.platform.platform_manager", "_current_platform")
GLOO_BACKEND = "cpu:gloo"
FP32_MIXED_PRECISION = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
_MARK = "_tokendyn_cpu"
WRAPPED = (
    ("verl.utils.config", "validate_config", None, ("config",)),
    ("verl.trainer.ppo.rollout_corr_helper", "apply_bypass_mode", None,
     ("batch", "rollout_corr_config", "policy_loss_config")),
    ("verl.workers.engine_workers", "TrainingWorker", "train_mini_batch", ("self", "data")),
)  # fmt: skip


class VerlInternalsChanged(RuntimeError):
    """A verl internal the CPU backend leans on is gone or has changed shape: the backend needs updating."""


def _attr(module: str, name: str):
    mod = importlib.import_module(module)
    if not hasattr(mod, name):
        raise VerlInternalsChanged(f"{module}.{name} is gone: tokendyn's verl glue needs updating")
    return getattr(mod, name)


def wrapped_function(module: str, name: str, method: str | None, params: tuple[str, ...]):
    """The verl function the glue wraps (unwrapped: its signature), checked to take ``params`` first."""
    target = _attr(module, name)
    where = f"{module}.{name}" + (f".{method}" if method else "")
    if method is not None:
        if not hasattr(target, method):
            raise VerlInternalsChanged(f"{where} is gone: tokendyn's verl glue needs updating")
        target = getattr(target, method)
    got = tuple(inspect.signature(inspect.unwrap(target)).parameters)[: len(params)]
    if got != params:
        raise VerlInternalsChanged(
            f"{where} now takes ({', '.join(got)}), the glue passes ({', '.join(params)}): it needs updating"
        )
    return target


def rollout_adapters() -> dict:
    """verl's private (name, mode) -> "module.Class" table of in-process rollout adapters."""
    table = _attr(*ROLLOUT_ADAPTERS)
    if not isinstance(table, dict) or ("vllm", "async") not in table:
        raise VerlInternalsChanged(
            f"{'.'.join(ROLLOUT_ADAPTERS)} is no longer a (name, mode) -> class-path dict"
        )
    return table


def register_rollout_adapter(name: str, class_path: str, mode: str = "async") -> None:
    """Make verl's actor worker build `class_path` as its rollout adapter for ``rollout.name=name``."""
    rollout_adapters()[(name, mode)] = class_path


def use_gloo_process_group() -> None:
    """The actor worker's process group on gloo only (``backend="cpu:gloo"``); idempotent."""
    module = importlib.import_module(PROCESS_GROUP_MODULE)
    original = _attr(PROCESS_GROUP_MODULE, PROCESS_GROUP_FUNCTION)
    if getattr(original, _MARK, False):
        return
    if "backend" not in inspect.signature(original).parameters:
        raise VerlInternalsChanged(
            f"{PROCESS_GROUP_MODULE}.{PROCESS_GROUP_FUNCTION} no longer takes a backend"
        )

    @wraps(original)
    def initialize_on_gloo(*args, backend=None, **kwargs):
        return original(*args, backend=backend or GLOO_BACKEND, **kwargs)

    setattr(initialize_on_gloo, _MARK, True)
    setattr(module, PROCESS_GROUP_FUNCTION, initialize_on_gloo)


def use_fsdp_engine_on_any_device() -> None:
    """``VERL_ENGINE_DEVICE=cuda`` (unless set): `EngineRegistry` then hands out the FSDP engine."""
    os.environ.setdefault(ENGINE_DEVICE_ENV, ENGINE_DEVICE)


def fp32_by_default() -> None:
    """``FSDPEngineConfig.mixed_precision`` None -> float32 param / reduce / buffer dtypes; idempotent."""
    cls = _attr(*ENGINE_CONFIG_CLASS)
    original = cls.__post_init__
    if getattr(original, _MARK, False):
        return
    if "mixed_precision" not in getattr(cls, "__dataclass_fields__", {}):
        raise VerlInternalsChanged(f"{'.'.join(ENGINE_CONFIG_CLASS)} has no mixed_precision field")

    @wraps(original)
    def __post_init__(self):  # noqa: N807 - the dataclass hook it wraps
        if self.mixed_precision is None:
            object.__setattr__(
                self, "mixed_precision", dict(FP32_MIXED_PRECISION)
            )  # verl's configs are frozen
        original(self)

    setattr(__post_init__, _MARK, True)
    cls.__post_init__ = __post_init__


def platform_is_set() -> bool:
    """Whether verl's platform singleton is set already (read without auto-detecting one)."""
    return _attr(*PLATFORM_SINGLETON) is not None


def check() -> list[str]:
    """Look at every internal above (importing the verl modules that hold them); raises `VerlInternalsChanged`
    naming the first that moved. Returns their dotted names."""
    rollout_adapters()
    function = _attr(PROCESS_GROUP_MODULE, PROCESS_GROUP_FUNCTION)
    if "backend" not in inspect.signature(function).parameters:
        raise VerlInternalsChanged(
            f"{PROCESS_GROUP_MODULE}.{PROCESS_GROUP_FUNCTION} no longer takes a backend"
        )
    engine_registry = importlib.import_module("verl.workers.engine.base")
    source = inspect.getsource(engine_registry)
    if ENGINE_DEVICE_ENV not in source:
        raise VerlInternalsChanged(f"verl's EngineRegistry no longer reads {ENGINE_DEVICE_ENV}")
    if "mixed_precision" not in getattr(_attr(*ENGINE_CONFIG_CLASS), "__dataclass_fields__", {}):
        raise VerlInternalsChanged(f"{'.'.join(ENGINE_CONFIG_CLASS)} has no mixed_precision field")
    _attr(*PLATFORM_SINGLETON)
    for spec in WRAPPED:
        wrapped_function(*spec)
    return [
        ".".join(ROLLOUT_ADAPTERS),
        f"{PROCESS_GROUP_MODULE}.{PROCESS_GROUP_FUNCTION}",
        ENGINE_DEVICE_ENV,
        ".".join(ENGINE_CONFIG_CLASS) + ".mixed_precision",
        ".".join(PLATFORM_SINGLETON),
        *(".".join(part for part in spec[:3] if part) for spec in WRAPPED),
    ]
