"""Lopti's two-stage actor update in verl, with the official fork's semantics (docs/paper.md §4):

    stage 1 (low first, the default):  advantages A * [pi_old < eta]    then a full actor update of the batch
    stage 2:                           advantages A * [pi_old >= eta]   then a second full actor update

Both stages use the same rollout (pi_old is not recomputed: stage 2's ratio is pi_theta(after stage 1) / pi_old), the
response mask is unchanged (a token-mean loss divides by every token of the batch), and the optimizer state carries
over. The groups are the tokendyn loss's (`loss.stage_advantages`): `lopti_update` switches the loss config's mutable
``lopti_stage`` between the two calls and puts it back to "all" afterwards, also on an exception.

KL and entropy terms: the official fork restricts them to the active group, with the denominator over every token;
verl's `ppo_loss` adds them over the whole response mask, outside the policy loss, so a Lopti update with
``use_kl_loss`` or a nonzero ``entropy_coeff`` trains with `loss.lopti_ppo_loss` (which restricts them; the actor
worker swaps it in) and is refused (one line) otherwise, rather than run with different semantics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tokendyn.integrations.verl.loss import LOSS_NAME, VerlConfigError
from tokendyn.remedies import lopti_threshold
from tokendyn.vocab import LOPTI_ORDERS, TRAIN, stage_name


def check_lopti(actor_config, order: str = "low_first", *, restricted: bool = False) -> None:
    """The actor config a Lopti update needs, each a one-line error naming the field. ``restricted``: the update's
    loss restricts KL and the entropy bonus to the active group (`loss.lopti_ppo_loss`); without it a KL or
    entropy term is refused (verl's own `ppo_loss` adds them over every token)."""
    if order not in LOPTI_ORDERS:
        raise VerlConfigError(f"lopti order: must be one of {', '.join(LOPTI_ORDERS)}, got {order!r}")
    opts = actor_config.policy_loss
    if getattr(opts, "loss_mode", None) != LOSS_NAME:
        raise VerlConfigError(
            f"actor.policy_loss.loss_mode: Lopti runs under '{LOSS_NAME}', got {getattr(opts, 'loss_mode', None)!r}"
        )
    if not opts.lopti:
        raise VerlConfigError(
            "actor.policy_loss.lopti_eta: Lopti needs a threshold in (0, 1) (or lopti_quantile), got None"
        )
    if restricted:
        return
    if actor_config.use_kl_loss:
        raise VerlConfigError(
            "actor.use_kl_loss: a Lopti update restricts KL to the active group, which verl's ppo_loss does not: "
            "train with partial(lopti_ppo_loss, config=...) (the actor worker does) and pass restricted=True"
        )
    if actor_config.entropy_coeff:
        raise VerlConfigError(
            f"actor.entropy_coeff: a Lopti update restricts the entropy bonus to the active group, which verl's "
            f"ppo_loss does not: train with partial(lopti_ppo_loss, config=...) and pass restricted=True, got "
            f"{actor_config.entropy_coeff!r}"
        )


def batch_threshold(data, quantile: float, group=None) -> float:
    """eta = the ``quantile`` of pi_old = exp(old_log_probs) over the response tokens of ``data`` (every rank of
    ``group`` pooled, so all ranks split alike; `remedies.lopti_threshold`, linear interpolation)."""
    old, mask = data["old_log_probs"], data["response_mask"]
    old = old.to_padded_tensor(0.0) if old.is_nested else old
    mask = (mask.to_padded_tensor(0) if mask.is_nested else mask).bool()
    valid = old[mask].detach().double().cpu()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, valid, group=group)
        valid = torch.cat(parts)
    eta = float(lopti_threshold(valid[None], torch.ones_like(valid[None], dtype=torch.bool), quantile))
    if not 0.0 < eta < 1.0:
        raise VerlConfigError(
            f"actor.policy_loss.lopti_quantile: the batch's {quantile:g}-quantile of pi_old is {eta!r}, outside (0, 1)"
        )
    return eta


def lopti_update(
    update: Callable[[Any], dict],
    data,
    actor_config,
    *,
    order: str = "low_first",
    probe=None,
    group=None,
    restricted: bool = False,
) -> dict:
    """Lopti's two actor updates of one batch: ``update(data)`` (e.g. ``worker.train_mini_batch`` or
    ``lambda d: engine.train_batch(d, loss_fn)``) is called twice, on a shallow copy of ``data`` each time (verl pops
    keys from it), first with ``actor_config.policy_loss.lopti_stage`` = the first group of ``order``, then the
    other. ``probe`` (an `EngineProbe`) records each stage under its name. With ``lopti_quantile`` the threshold of
    both stages is that quantile of pi_old over the batch's response tokens (`batch_threshold`; ``group``: the
    data-parallel group whose ranks' batches are pooled). Returns ``{"low": ..., "high": ...}``, each stage's
    output."""
    check_lopti(actor_config, order, restricted=restricted)
    opts = actor_config.policy_loss
    outputs = {}
    try:
        if opts.lopti_quantile is not None:
            opts.lopti_batch_eta = batch_threshold(data, opts.lopti_quantile, group)
        for stage in (stage_name(1, order), stage_name(2, order)):
            opts.lopti_stage = stage
            if probe is not None:
                probe.stage = stage
            outputs[stage] = update(data.copy())
    finally:
        opts.lopti_stage = "all"
        opts.lopti_batch_eta = None
        if probe is not None:
            probe.stage = TRAIN
    return outputs
