"""verl's platform interface for the host CPU (`CPUPlatform`, installed by `cpu_platform()`) and the gloo process
group (`setup_distributed`): what `tokendyn.integrations.verl.cpu` builds verl's engine on, without Ray and without an
accelerator. Re-exported by `cpu`."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from verl.plugin.platform import PlatformBase, get_platform, set_platform

from tokendyn.integrations.verl.internals import ENGINE_DEVICE, ENGINE_DEVICE_ENV, platform_is_set

if TYPE_CHECKING:
    from collections.abc import Iterator


def _cpu_device_module() -> ModuleType:
    """`torch.cpu` plus the memory counters verl's `TrainingWorker` logs after every step (0 on the CPU)."""
    module = ModuleType("tokendyn_cpu_device")
    module.__dict__.update({k: v for k, v in vars(torch.cpu).items() if not k.startswith("__")})
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved"):
        module.__dict__.setdefault(name, lambda *args, **kwargs: 0)
    module.__dict__.setdefault("reset_peak_memory_stats", lambda *args, **kwargs: None)
    module.__dict__.setdefault("mem_get_info", lambda *args, **kwargs: (0, 0))
    module.__dict__.setdefault("get_device_name", lambda *args, **kwargs: "cpu")  # the MFU counter's lookup
    # what verl's trainer and memory helpers call besides (`verl.utils.memory_utils`, the checkpoint manager)
    for name in ("empty_cache", "ipc_collect", "set_per_process_memory_fraction"):
        module.__dict__.setdefault(name, lambda *args, **kwargs: None)
    module.__dict__.setdefault("get_rng_state", lambda *args, **kwargs: torch.get_rng_state())
    module.__dict__.setdefault("set_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state))
    return module


CPU_DEVICE_MODULE = _cpu_device_module()


class CPUPlatform(PlatformBase):
    """verl's platform interface for the host CPU: device "cpu", module `torch.cpu`, collectives on gloo, no
    profiler and no IPC. Registered as verl's platform "cpu" (`backend.register_backend`) and chosen by name only
    (``VERL_PLATFORM=cpu``): auto-detection never picks it. Its Ray resource is named "GPU", so verl's worker groups
    ask Ray for logical GPUs, one per actor rank (``ray_kwargs.ray_init.num_gpus``); torch stays on the CPU."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # never auto-detected: chosen by name (VERL_PLATFORM=cpu) or `cpu_platform()`

    def current_device(self) -> str:  # type: ignore[override]  # verl passes it to `.to(...)`: "cpu", not 0
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "GPU"  # logical GPUs (ray_init.num_gpus) stand for the actor ranks; nothing runs on a GPU

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> None:
        return None


def cpu_platform() -> CPUPlatform:
    """Make verl run on the CPU (idempotent): `CPUPlatform` as verl's platform singleton, and
    ``VERL_ENGINE_DEVICE=cuda`` so that `EngineRegistry` finds the FSDP engine. Returns the platform.

    Best called before verl's engine modules are imported (`transformer_impl` reads the device name at import,
    for its sequence-parallel mesh only); the singleton is looked at without `get_platform()`, which would
    auto-detect a CUDA platform first."""
    current = get_platform() if platform_is_set() else None
    if not isinstance(current, CPUPlatform):
        current = CPUPlatform()
        set_platform(current)
    os.environ[ENGINE_DEVICE_ENV] = ENGINE_DEVICE
    return current


def setup_distributed() -> tuple[int, int]:
    """`cpu_platform()`, then a gloo default process group if none exists: from torchrun's environment when
    ``RANK`` / ``WORLD_SIZE`` are set, else a single process (rank 0 of 1) over a fresh file store, so no port is
    taken. Idempotent; returns (rank, world size)."""
    cpu_platform()
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend="gloo")
        else:
            fd, store = tempfile.mkstemp(prefix="verl_engine_pg_")
            os.close(fd)
            os.unlink(store)  # the file store wants a path that does not exist yet
            dist.init_process_group(backend="gloo", init_method=f"file://{store}", rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()
