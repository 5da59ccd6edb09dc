"""verl's sampler beside its trainer, per response token of a probed micro-batch: the `sampler` records.

Read from the batch verl's actor trains on, not re-derived: ``rollout_log_probs`` (log mu, the rollout engine's
own log-probs at the sampling temperature; in the batch when ``actor_rollout_ref.rollout.calculate_log_probs`` is
true), ``old_log_probs`` (log pi_old, the trainer's recomputation) and ``rollout_is_weights`` (the weight verl's
policy loss multiplies into each token's term: ``algorithm.rollout_correction.rollout_is`` token or sequence, truncated
or masked as ``rollout_is_threshold`` says; computed once per batch by verl's trainer,
`verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_weights`; 1 where the batch has none).

The tokens: every response token the sampler generated, not only those the loss trains on. verl's rejection sampling
(``algorithm.rollout_correction.rollout_rs``, `compute_rollout_rejection_mask`) weights nothing: it removes the
rejected tokens (every token of a rejected sequence in the ``seq_*`` modes) from the batch's ``response_mask``, which
the loss then reads. verl derives that mask from the response part of ``attention_mask`` (`compute_response_mask`)
before the rejection, and its actor slices each response by the same length (`no_padding_2_padding`: the nested
``responses``' offsets, else the attention mask), which the probe already reads as `ResponseLayout.valid`. So the rows
cover ``valid``, and a token outside the loss's ``response_mask`` has ``is_weight`` 0 (the loss applies nothing to
it); ``seq_masked`` is true where that holds at every token of the sequence (a rejected sequence). Under verl's
multi-turn rollout (``multi_turn`` in the batch) the response also holds tool outputs, which the agent loop's own
``response_mask`` leaves out and nothing else in the batch tells from a rejected token: the rows are then the loss's
``response_mask``, as before (rejected tokens have no row).

Columns: ``docs/records.md`` ("sampler"); ``micro`` counts the micro-batches of one ``train_batch``, ``row`` is the
sequence's row in its micro-batch and ``pos`` the response index (the keys of the probe's token rows).
"""

from __future__ import annotations

import polars as pl
import torch

from tokendyn.hooks.sampler import token_frame

SAMPLER_FIELD = "rollout_log_probs"
WEIGHT_FIELD = "rollout_is_weights"


def _padded(data, key: str) -> torch.Tensor:
    value = data[key]
    return value.to_padded_tensor(0.0) if value.is_nested else value


def _multi_turn(data) -> bool:
    """verl's ``multi_turn`` (the trainer's ``meta_info``, a non-tensor field of the batch); False without it."""
    from verl.utils import tensordict_utils as tu

    return bool(tu.get_non_tensor_data(data, "multi_turn", False))


def sampler_frame(
    data, valid: torch.Tensor, mask: torch.Tensor, step: int, stage: str, micro: int, rank: int
) -> pl.DataFrame | None:
    """The `sampler` rows of the micro-batch ``data`` (verl's TensorDict) over its generated response tokens
    ``valid`` [B, W], the loss applying nothing outside its ``mask`` [B, W] (verl's ``response_mask``, narrowed by
    rejection sampling); None when the batch carries no rollout log-probs."""
    keys = data.keys()
    if SAMPLER_FIELD not in keys:
        return None
    width = mask.shape[1]
    old = _padded(data, "old_log_probs")[:, :width].cpu()
    mu = _padded(data, SAMPLER_FIELD)[:, :width].cpu()
    weight = _padded(data, WEIGHT_FIELD)[:, :width].cpu() if WEIGHT_FIELD in keys else torch.ones_like(old)
    mask = mask.cpu().bool()
    tokens = mask if _multi_turn(data) else valid.cpu().bool()
    applied = torch.where(mask, weight, torch.zeros_like(weight))  # rejected: nothing applied
    return token_frame(old, mu, tokens, applied, step, stage, micro, rank)
