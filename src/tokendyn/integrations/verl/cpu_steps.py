"""The batches and steps of verl's FSDP2 actor engine on the CPU: `make_batch` (verl's NO_PADDING layout),
`train_step` (`TrainingWorker.train_batch`), `update_actor` (`TrainingWorker.train_mini_batch`), `infer_log_probs`
(`TrainingWorker.infer_batch`) and `full_parameters`. Re-exported by `tokendyn.integrations.verl.cpu`, which builds
the engine and the worker."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from tensordict import TensorDict
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    # one value per response token: a (batch, >= longest response) tensor, right-padded, or one list per response
    PerToken = torch.Tensor | Sequence[Sequence[float]]

PAD_TOKEN_ID = 0
EOS_TOKEN_ID = 1
BOS_TOKEN_ID = 2


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
