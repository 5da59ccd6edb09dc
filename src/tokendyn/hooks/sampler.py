"""The sampler's side of a probed micro-batch: per token, the engine's log-prob log mu, the trainer's log pi_old,
log rho = log pi_old - log mu, and the importance weight the loss applied (the `sampler` record kind).

Read, not re-derived: TRL keeps vLLM's processed log-probs as ``sampling_per_token_logps`` and the weight its loss
multiplies in as ``importance_sampling_ratio`` ((B, 1) in the sequence modes, (B, C) in the token modes; truncated
or masked as ``vllm_importance_sampling_mode`` says). A token's ``seq_masked`` is true when the weight on its
sequence is 0 at every valid token (a sequence mode's mask, or a token mode that masked them all); in a token mode
a single masked token has ``is_weight`` 0 and ``seq_masked`` false. `token_frame` writes the rows from the three
tensors whichever framework holds them (verl's: `tokendyn.integrations.verl.sampler`).

The noise floor (the `floor` kind, `split_logps`): the trainer's log-probs of the same tokens recomputed in two halves
of the micro-batch at the same parameters, against the forward the loss used, in the same columns.

With the correction off and the rollout's steps aligned (one optimizer step per generation, no iterations) TRL keeps
no ``old_per_token_logps``: its loss takes the current log-probs, detached, as log pi_old. The probe then passes its
own per-token log-probs of the micro-batch (`needs_logp_old`, ``logp_old=``): the same forward the loss used.
"""

from __future__ import annotations

import polars as pl
import torch

SAMPLER_KEY = "sampling_per_token_logps"
WEIGHT_KEY = "importance_sampling_ratio"


def needs_logp_old(inputs: dict) -> bool:
    """The batch has the sampler's log-probs but TRL kept no log pi_old (correction off, steps aligned)."""
    return inputs.get(SAMPLER_KEY) is not None and inputs.get("old_per_token_logps") is None


def sampler_frame(
    inputs: dict, step: int, stage: str, micro: int, rank: int, logp_old: torch.Tensor | None = None
) -> pl.DataFrame | None:
    """The `sampler` rows of one micro-batch (every valid completion token), None when the batch carries no
    sampler log-probs (TRL's own ``generate``) or no log pi_old (TRL's, else ``logp_old`` [B, C])."""
    logp_mu = inputs.get(SAMPLER_KEY)
    if logp_old is None:
        logp_old = inputs.get("old_per_token_logps")
    if logp_mu is None or logp_old is None:
        return None
    mask = inputs["completion_mask"].bool()
    if "tool_mask" in inputs:
        mask = mask & inputs["tool_mask"].bool()
    return token_frame(logp_old, logp_mu, mask, inputs.get(WEIGHT_KEY), step, stage, micro, rank)


def token_frame(
    logp_old: torch.Tensor,
    logp_mu: torch.Tensor,
    mask: torch.Tensor,
    weight: torch.Tensor | None,
    step: int,
    stage: str,
    micro: int,
    rank: int,
) -> pl.DataFrame:
    """The `sampler` rows of the tokens where ``mask`` [B, C] is true: log pi_old, log mu [B, C], and the weight
    the loss multiplied in ([B, C], or [B, 1] for a sequence's; None: 1), whichever framework read them."""
    mask = mask.bool()
    weight = torch.ones_like(logp_old) if weight is None else weight.expand_as(logp_old)
    weight = weight.double()
    seq_masked = ((weight == 0) | ~mask).all(dim=1, keepdim=True).expand_as(mask)
    rows, pos = mask.nonzero(as_tuple=True)
    old, mu = logp_old.double()[mask], logp_mu.double()[mask]
    n = int(rows.numel())
    return pl.DataFrame(
        {
            "step": [int(step)] * n,
            "stage": [stage] * n,
            "rank": [int(rank)] * n,
            "micro": [int(micro)] * n,
            "row": rows.int().tolist(),
            "pos": pos.int().tolist(),
            "logp_old": old.tolist(),
            "logp_sampler": mu.tolist(),
            "log_rho": (old - mu).tolist(),
            "is_weight": weight[mask].tolist(),
            "seq_masked": seq_masked[mask].tolist(),
        }
    )


def split_logps(trainer, inputs: dict) -> torch.Tensor | None:
    """log pi [B, C] of the micro-batch's completion tokens recomputed in two halves of its rows, each cut after its
    own longest completion (fewer rows, a shorter sequence: other kernel shapes; the positions and every token's
    context unchanged), through TRL's own ``_get_per_token_logps_and_entropies``, no grad; 0 past each half's cut.
    None for a single row."""
    from trl import GRPOTrainer

    prompt, completion = inputs["prompt_ids"], inputs["completion_ids"]
    mask = inputs["completion_mask"]
    rows = prompt.size(0)
    if rows < 2:
        return None
    out = torch.zeros(completion.shape, dtype=torch.float32, device=completion.device)
    h = (rows + 1) // 2
    with torch.no_grad():
        for part in (slice(0, h), slice(h, rows)):
            cut = max(1, int(mask[part].sum(1).max()))
            ids = torch.cat([prompt[part], completion[part, :cut]], dim=1)
            attn = torch.cat([inputs["prompt_mask"][part], mask[part, :cut]], dim=1)
            # TRL's method, not tokendyn's override (which consumes a pending KL stage)
            logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
                trainer, trainer.model, ids, attn, cut
            )
            out[part, :cut] = logps.detach().float()
    return out


def floor_frame(inputs: dict, logp_loss: torch.Tensor, logp_split: torch.Tensor, *key) -> pl.DataFrame | None:
    """The `floor` rows: ``logp_loss`` (the loss's forward) as log pi_old, ``logp_split`` in the sampler's column."""
    mask = {k: inputs[k] for k in ("completion_mask", "tool_mask") if k in inputs}
    return sampler_frame({**mask, SAMPLER_KEY: logp_split}, *key, logp_old=logp_loss)
