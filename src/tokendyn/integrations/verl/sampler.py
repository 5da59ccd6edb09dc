"""verl's sampler beside its trainer, per response token of a probed micro-batch: the `sampler` records.

Read from the batch verl's actor trains on, not re-derived: ``rollout_log_probs`` (log mu, the rollout engine's
own log-probs at the sampling temperature; in the batch when ``actor_rollout_ref.rollout.calculate_log_probs`` is
true), ``old_log_probs`` (log pi_old, the trainer's recomputation) and ``rollout_is_weights`` (the weight verl's
policy loss multiplies into each token's term: ``algorithm.rollout_correction.rollout_is`` token or sequence, truncated
or masked as ``rollout_is_threshold`` says; computed once per batch by verl's trainer,
`verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_weights`; 1 where the batch has none). The tokens
are those of verl's ``response_mask``, which verl's rejection sampling (``rollout_rs``) has already narrowed. Columns:
``docs/records.md`` ("sampler"); ``micro`` counts the micro-batches of one ``train_batch``, ``row`` is the sequence's
row in its micro-batch and ``pos`` the response index.
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


def sampler_frame(
    data, mask: torch.Tensor, step: int, stage: str, micro: int, rank: int
) -> pl.DataFrame | None:
    """The `sampler` rows of the micro-batch ``data`` (verl's TensorDict) over the response tokens of ``mask``
    [B, W]; None when the batch carries no rollout log-probs."""
    keys = data.keys()
    if SAMPLER_FIELD not in keys:
        return None
    width = mask.shape[1]
    old = _padded(data, "old_log_probs")[:, :width]
    mu = _padded(data, SAMPLER_FIELD)[:, :width]
    weight = _padded(data, WEIGHT_FIELD)[:, :width] if WEIGHT_FIELD in keys else None
    return token_frame(old.cpu(), mu.cpu(), mask.cpu(), None if weight is None else weight.cpu(),
                       step, stage, micro, rank)  # fmt: skip
