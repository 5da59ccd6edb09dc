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
from typing import TYPE_CHECKING, Any

from tokendyn.integrations.verl.cpu_device import (  # noqa: F401  (re-exported: the engine's platform and group)
    CPU_DEVICE_MODULE,
    CPUPlatform,
    cpu_platform,
    setup_distributed,
)
from tokendyn.integrations.verl.cpu_steps import (  # noqa: F401  (re-exported: the engine's batches and steps)
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    full_parameters,
    infer_log_probs,
    make_batch,
    train_step,
    update_actor,
)
from tokendyn.integrations.verl.loss import disable_trl_value_head_patch

if TYPE_CHECKING:
    from collections.abc import Callable

    from verl.workers.config import FSDPActorConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead


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
