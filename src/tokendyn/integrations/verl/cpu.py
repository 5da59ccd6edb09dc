"""verl 0.9's own FSDP2 actor engine on the CPU, without Ray and without an accelerator: to try tokendyn's verl path
on a laptop, for `examples/verl_actor.py`, the bench and the tests. On a GPU, verl needs none of this. Under Ray
(verl's own trainer, `main_ppo`), `CPUPlatform` is verl's platform "cpu", chosen with ``VERL_PLATFORM=cpu``
(`backend`).

The engine is built the way `verl.workers.engine_workers.TrainingWorker.__init__` builds it
(`EngineRegistry.new(model_type="language_model", backend="fsdp2", ...)`, then `initialize()`), in one process or
under ``torchrun --nproc_per_node N`` (gloo). What it takes on CPU:

- verl registers no CPU platform and falls back to CUDA, so `cpu_platform()` installs a small `PlatformBase`
  subclass (device "cpu", backend gloo; the memory counters verl logs read 0) with `verl.plugin.platform.set_platform`;
- the FSDP engine is registered for the cuda and npu devices only, so ``VERL_ENGINE_DEVICE=cuda`` makes
  `EngineRegistry` hand out that class anyway (it then runs on the platform's device, the CPU);
- a gloo process group (`setup_distributed`);
- ``attn_implementation="sdpa"`` (verl's default is flash-attention 2), float32 everywhere (model dtype, the FSDP2
  mixed-precision param/reduce dtypes; with a float32 param dtype the engine skips autocast);
- TRL 1.16 has no ``AutoModelForCausalLMWithValueHead``, which verl's `apply_monkey_patch` imports whenever TRL is
  importable: `tokendyn.integrations.verl.disable_trl_value_head_patch()` is applied first.

Batches are in verl's NO_PADDING layout (`make_batch`: left-padded prompts + right-padded responses converted by
verl's own `left_right_2_no_padding`), the step is `engine.train_batch` inside `engine.train_mode()` as in
`TrainingWorker.train_batch` (`train_step`), the actor worker's update is `TrainingWorker.train_mini_batch`
(`build_worker`, `update_actor`), and `infer_log_probs` is `engine.infer_batch` inside `eval_mode()`.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from verl.plugin.platform import PlatformBase, get_platform, set_platform

from tokendyn.integrations.verl.internals import ENGINE_DEVICE, ENGINE_DEVICE_ENV, platform_is_set
from tokendyn.integrations.verl.loss import disable_trl_value_head_patch

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from tensordict import TensorDict
    from verl.workers.config import FSDPActorConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    # one value per response token: a (batch, >= longest response) tensor, right-padded, or one list per response
    PerToken = torch.Tensor | Sequence[Sequence[float]]

PAD_TOKEN_ID = 0
EOS_TOKEN_ID = 1
BOS_TOKEN_ID = 2


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


def actor_config(
    *,
    micro_batch_size: int = 1,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    entropy_coeff: float = 0.0,
    use_kl_loss: bool = False,
    kl_loss_coef: float = 0.001,
    kl_loss_type: str = "low_var_kl",
    policy_loss: Any = None,
) -> FSDPActorConfig:
    """verl's `FSDPActorConfig` with what `functools.partial(verl.workers.utils.losses.ppo_loss, config=...)`
    reads: `loss_agg_mode`, the clip ratios, `entropy_coeff`, `use_kl_loss` (`kl_loss_coef`, `kl_loss_type`),
    `policy_loss` (a
    `PolicyLossConfig` or subclass, default loss mode "vanilla") and the `global_batch_info` dict `ppo_loss`
    fills per micro-batch. The low / high clip ratios default to `clip_ratio`."""
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    return FSDPActorConfig(
        strategy="fsdp2",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=micro_batch_size,
        loss_agg_mode=loss_agg_mode,
        clip_ratio=clip_ratio,
        clip_ratio_low=clip_ratio if clip_ratio_low is None else clip_ratio_low,
        clip_ratio_high=clip_ratio if clip_ratio_high is None else clip_ratio_high,
        entropy_coeff=entropy_coeff,
        use_kl_loss=use_kl_loss,
        kl_loss_coef=kl_loss_coef,
        kl_loss_type=kl_loss_type,
        policy_loss=PolicyLossConfig() if policy_loss is None else policy_loss,
    )


def _engine_configs(
    model_path,
    *,
    use_remove_padding,
    micro_batch_size,
    lr,
    optimizer,
    weight_decay,
    clip_grad,
    gradient_checkpointing,
):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    model_config = HFModelConfig(
        path=str(model_path),
        override_config={"attn_implementation": "sdpa"},
        enable_gradient_checkpointing=gradient_checkpointing,
        use_remove_padding=use_remove_padding,
    )
    engine_config = FSDPEngineConfig(
        strategy="fsdp2",
        model_dtype="fp32",
        mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        use_torch_compile=False,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro_batch_size,
        infer_micro_batch_size_per_gpu=micro_batch_size,
        use_remove_padding=use_remove_padding,
    )
    optimizer_config = FSDPOptimizerConfig(
        optimizer=optimizer,
        lr=lr,
        weight_decay=weight_decay,
        clip_grad=clip_grad,
        lr_scheduler_type="constant",
    )
    return model_config, engine_config, optimizer_config, CheckpointConfig()


def build_engine(
    model_path: str | os.PathLike,
    *,
    use_remove_padding: bool,
    micro_batch_size: int,
    lr: float,
    optimizer: str = "SGD",
    weight_decay: float = 0.0,
    clip_grad: float = 1e9,
    gradient_checkpointing: bool = False,
) -> FSDPEngineWithLMHead:
    """verl's FSDP2 actor engine (`FSDPEngineWithLMHead`) around the model saved at `model_path`, initialised
    (model, optimizer, constant LR schedule): float32 weights and FSDP2 mixed precision, `torch.optim.<optimizer>`
    at `lr`, gradients clipped at `clip_grad` (verl always clips; the default is large enough to be inactive),
    micro-batches of `micro_batch_size` sequences for training and inference (no dynamic batch size), no torch
    compile. Calls `setup_distributed()` first."""
    setup_distributed()
    disable_trl_value_head_patch()
    from verl.workers.engine import EngineRegistry

    model_config, engine_config, optimizer_config, checkpoint_config = _engine_configs(
        model_path, use_remove_padding=use_remove_padding, micro_batch_size=micro_batch_size, lr=lr,
        optimizer=optimizer, weight_decay=weight_decay, clip_grad=clip_grad,
        gradient_checkpointing=gradient_checkpointing,
    )  # fmt: skip
    engine = EngineRegistry.new(
        model_type="language_model",
        backend=engine_config.strategy,
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=optimizer_config,
        checkpoint_config=checkpoint_config,
    )
    engine.initialize()
    return engine


def build_worker(model_path: str | os.PathLike, loss_fn: Callable, **engine_options):
    """verl's `TrainingWorker` (the actor's training worker, `verl.workers.engine_workers`) around the same engine
    as `build_engine`, built in this process without Ray, its engine reset and its loss function set, as
    `ActorRolloutRefWorker` does. verl's `Worker` reads ``RANK`` / ``WORLD_SIZE`` / ``MASTER_*`` when it is built:
    the values of this process's group are set for that moment only, where absent, then removed again (left
    behind, they would tell Accelerate / TRL in the same process that it runs under a distributed launch).
    ``engine_options``: `build_engine`'s keywords."""
    rank, world = setup_distributed()
    disable_trl_value_head_patch()
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    defaults = dict(optimizer="SGD", weight_decay=0.0, clip_grad=1e9, gradient_checkpointing=False)
    model_config, engine_config, optimizer_config, checkpoint_config = _engine_configs(
        model_path, **{**defaults, **engine_options}
    )
    launch = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
    }
    launch["MASTER_PORT"] = "29555"
    added = [key for key in launch if key not in os.environ]
    os.environ.update({key: launch[key] for key in added})
    try:
        worker = TrainingWorker(
            TrainingWorkerConfig(
                model_type="language_model",
                model_config=model_config,
                engine_config=engine_config,
                optimizer_config=optimizer_config,
                checkpoint_config=checkpoint_config,
            )
        )
    finally:
        for key in added:
            os.environ.pop(key, None)
    worker.reset()
    worker.set_loss_fn(loss_fn)
    return worker


def _wants_entropy(loss_fn) -> bool:
    """Whether the engine must compute entropies for this loss, as verl's trainer `_update_actor` decides it (the
    actor's ``calculate_entropy`` or an entropy bonus); the engine computes them only when asked."""
    config = getattr(loss_fn, "keywords", {}).get("config")
    return bool(config is not None and (config.calculate_entropy or config.entropy_coeff))


def update_actor(worker, data: TensorDict, *, mini_batch_size: int | None = None, epochs: int = 1) -> dict:
    """`worker.train_mini_batch` as `ActorRolloutRefWorker.update_actor` calls it: the batch split into
    mini-batches of `mini_batch_size` sequences (default the whole batch), `epochs` passes, no shuffling, the
    entropies computed when the actor has an entropy bonus (as the trainer's `_update_actor` asks). Returns the
    metrics (key -> list over mini-batches)."""
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(
        data,
        mini_batch_size=mini_batch_size or data.shape[0],
        epochs=epochs,
        seed=0,
        dataloader_kwargs={"shuffle": False},
        calculate_entropy=_wants_entropy(worker.loss_fn),
    )
    output = worker.train_mini_batch(data)
    return dict(output["metrics"]) if output is not None else {}


def make_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    old_log_probs: PerToken | None = None,
    advantages: PerToken | None = None,
    ref_log_probs: PerToken | None = None,
    temperature: float = 1.0,
    global_batch_size: int | None = None,
    pad_token_id: int = PAD_TOKEN_ID,
) -> TensorDict:
    """A verl training batch in the NO_PADDING layout `engine.train_batch` takes, from token-id lists.

    Built as verl's trainer builds it: prompts left-padded to the longest prompt, responses right-padded to the
    longest response, ``input_ids`` / ``attention_mask`` / ``position_ids`` over both (position ids count the real
    tokens from 0), ``response_mask``, ``prompts``, ``responses``, ``old_log_probs``, ``advantages`` (and ``ref_log_prob`` when
    ``ref_log_probs`` is given) (bs,
    longest response; given as a right-padded tensor at least that wide, whose extra columns are dropped, or as
    one list per response; zeros where not given, padding zeroed), then verl's `left_right_2_no_padding`
    (nested ``input_ids`` / ``position_ids``, ``loss_mask`` = ``response_mask``, ``indices``, ``max_seq_len``,
    ``max_response_len``). Non-tensor fields: ``temperature`` and
    ``global_batch_size`` (sequences in the global batch, all data-parallel ranks together: default this batch's
    size times the world size). The engine's own fields (``use_remove_padding``, ``use_dynamic_bsz``,
    ``micro_batch_size_per_gpu``, ...) are `train_step`'s to add, as `TrainingWorker.train_batch` does."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    if len(prompts) != len(responses) or not prompts:
        raise ValueError("make_batch: need as many prompts as responses, at least one")
    if any(len(p) == 0 for p in prompts) or any(len(r) == 0 for r in responses):
        raise ValueError("make_batch: every prompt and every response needs at least one token")
    bs = len(prompts)
    p_len, r_len = max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.full((bs, p_len), pad_token_id, dtype=torch.long)
    response_ids = torch.full((bs, r_len), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(bs, p_len, dtype=torch.long)
    response_mask = torch.zeros(bs, r_len, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[i, p_len - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        prompt_mask[i, p_len - len(p) :] = 1
        response_ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        response_mask[i, : len(r)] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)

    def _per_token(values: PerToken | None, name: str) -> torch.Tensor:
        out = torch.zeros(bs, r_len, dtype=torch.float32)
        if values is None:
            return out
        if isinstance(values, torch.Tensor):
            if values.dim() != 2 or values.shape[0] != bs or values.shape[1] < r_len:
                raise ValueError(f"make_batch: {name} must be ({bs}, >= {r_len}), got {tuple(values.shape)}")
            return values[:, :r_len].to(torch.float32) * response_mask
        if len(values) != bs or any(len(v) != len(r) for v, r in zip(values, responses, strict=True)):
            raise ValueError(f"make_batch: {name} needs one value per response token")
        for i, v in enumerate(values):
            out[i, : len(v)] = torch.as_tensor(v, dtype=torch.float32)
        return out

    if global_batch_size is None:
        global_batch_size = bs * (dist.get_world_size() if dist.is_initialized() else 1)
    data = tu.get_tensordict(
        {
            "prompts": prompt_ids,
            "responses": response_ids,
            "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask,
            "old_log_probs": _per_token(old_log_probs, "old_log_probs"),
            "advantages": _per_token(advantages, "advantages"),
            **({} if ref_log_probs is None else {"ref_log_prob": _per_token(ref_log_probs, "ref_log_probs")}),
        },
        non_tensor_dict={"temperature": temperature, "global_batch_size": global_batch_size},
    )
    return left_right_2_no_padding(data)


def _engine_defaults(engine: FSDPEngineWithLMHead, data: TensorDict, *, train: bool) -> None:
    """The engine fields `TrainingWorker.train_batch` / `infer_batch` add to a batch that lacks them."""
    from verl.utils import tensordict_utils as tu

    cfg = engine.engine_config
    max_tokens = cfg.max_token_len_per_gpu if train else cfg.infer_max_token_len_per_gpu
    micro = cfg.micro_batch_size_per_gpu if train else cfg.infer_micro_batch_size_per_gpu
    defaults = {
        "use_remove_padding": engine.model_config.get("use_remove_padding", False),
        "use_dynamic_bsz": cfg.use_dynamic_bsz,
        "max_token_len_per_gpu": max_tokens,
        "micro_batch_size_per_gpu": micro,
        "use_fused_kernels": cfg.use_fused_kernels,
    }
    for key, value in defaults.items():
        if key not in data.keys():
            tu.assign_non_tensor(data, **{key: value})


def train_step(
    engine: FSDPEngineWithLMHead, data: TensorDict, loss_fn: Callable, *, zero_grad_on_exit: bool = True
) -> dict[str, Any]:
    """One optimizer step on this rank's `data`, as `TrainingWorker.train_batch` runs it: the engine's fields
    added where missing, then `engine.train_batch(data, loss_function=loss_fn)` inside `engine.train_mode()` (zero
    grad, forward / backward per micro-batch, clip, step). The train mode zeroes the gradients on exit unless
    `zero_grad_on_exit` is False (then they stay on the parameters, as sharded DTensors). Every rank must call it.

    Entropies are computed when the loss's config has an entropy bonus (``calculate_entropy``, as verl's trainer
    sets it). Returns the metrics: ``loss`` (this rank's micro-batch losses summed, then averaged over the data-parallel
    ranks, as `TrainingWorker` reports it: the global batch's loss), ``grad_norm`` (the global norm before
    clipping) and the loss function's own metrics, reduced over this rank's micro-batches (a verl `Metric` by its
    own aggregation, a list of numbers by its mean)."""
    _engine_defaults(engine, data, train=True)
    if "calculate_entropy" not in data.keys():
        from verl.utils import tensordict_utils as tu

        tu.assign_non_tensor(data, calculate_entropy=_wants_entropy(loss_fn))
    with engine.train_mode(zero_grad_on_exit=zero_grad_on_exit):
        output = engine.train_batch(data, loss_function=loss_fn)
    loss = torch.tensor(float(sum(output["loss"])), dtype=torch.float64)
    group = engine.get_data_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=group)
        loss /= dist.get_world_size(group)
    metrics = {key: _reduce_metric(value) for key, value in output["metrics"].items() if key != "grad_norm"}
    metrics["loss"] = loss.item()
    metrics["grad_norm"] = float(output["metrics"]["grad_norm"])
    return metrics


def _reduce_metric(value: Any) -> Any:
    from verl.utils.metric import Metric

    if isinstance(value, Metric):
        return float(value.aggregate())
    if isinstance(value, list) and value and all(isinstance(v, int | float) for v in value):
        return sum(value) / len(value)
    return value


def infer_log_probs(engine: FSDPEngineWithLMHead, data: TensorDict) -> torch.Tensor:
    """The engine's log-probs of the response tokens, (bs, longest response) with zeros past each response:
    `engine.infer_batch` without a loss inside `engine.eval_mode()` (the engine's inference fields added to
    `data` in place, as `TrainingWorker.infer_batch` adds them), the nested per-token output sliced to the
    responses by verl's `no_padding_2_padding`. Every rank must call it, each with its own batch."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    _engine_defaults(engine, data, train=False)
    tu.assign_non_tensor(data, compute_loss=False)
    with engine.eval_mode():
        output = engine.infer_batch(data, loss_function=None)
    log_probs = no_padding_2_padding(output["model_output"]["log_probs"], data)
    return log_probs * data["response_mask"].to(log_probs.dtype)


def full_parameters(engine: FSDPEngineWithLMHead) -> dict[str, torch.Tensor]:
    """The engine's parameters as full (gathered) CPU tensors by Hugging Face name; every rank must call it."""
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in engine.module.named_parameters()
    }
