"""Record frames of the trainer's own update (`tokendyn.effects.rebalance`): the shares of each Lopti stage at the
parameters it starts from, and the probability change of the real update."""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl
import torch
from torch import nn

from tokendyn.effects.change import (
    change_frame,
    real_change,
)
from tokendyn.effects.shares import as_edges, gradient_shares
from tokendyn.probe.tokenloss import Objective, ProbeBatch, analysis_forward, bin_index


@analysis_forward
def stage_shares_frame(
    model: nn.Module,
    batch: ProbeBatch,
    token_mask: torch.Tensor,
    *,
    step: int,
    stage: str,
    edges: torch.Tensor | Sequence[float] | None = None,
    objective: Objective | None = None,
    method: str = "stream",
) -> pl.DataFrame:
    """The `shares` record of one Lopti stage at the model's current parameters: g_b = grad sum_{t in b and stage}
    l_t, s_b = <g_b, g_stage> / ||g_stage||^2 (bins outside the stage have g_b = 0). Called at the start of each
    stage (stage 2: after the real stage-1 optimizer steps), it decomposes the stage loss's gradient on this batch at
    the parameters the stage starts from: the direction of the stage's first step on that batch (the later steps of
    the stage, on other micro-batches, with AdamW's scaling, are not decomposed)."""
    edges_t = as_edges(edges)
    res = gradient_shares(
        model, batch, edges_t, objective=objective, method=method, per_token=False, token_mask=token_mask
    )
    return res.bins.to_frame(step, stage)


@analysis_forward
def real_change_frame(
    pi_before: torch.Tensor | nn.Module,
    model_after: nn.Module,
    batch: ProbeBatch,
    *,
    step: int,
    stage: str = "train",
    edges: torch.Tensor | Sequence[float] | None = None,
    pi_old: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
) -> pl.DataFrame:
    """The `prob_change` record (update "real") of a real training update: pi_before measured before the optimizer
    step (`tokendyn.effects.change.completion_probs`) or the model before; bins over pi_old (default:
    exp(batch.old_logp), else pi_before). ``delta``: the real change already measured (`real_change`)."""
    edges_t = as_edges(edges)
    if delta is None:
        delta = real_change(pi_before, model_after, batch)
    if pi_old is None:
        if batch.old_logp is not None:
            pi_old = torch.exp(batch.old_logp.to(torch.float64))
        elif torch.is_tensor(pi_before):
            pi_old = pi_before
        else:
            raise ValueError("rebalance: give pi_old (or a batch with old_logp) to bin the real change")
    bins = bin_index(pi_old.to(torch.float64), batch.completion_mask, edges_t)
    return change_frame(delta, batch, bins, edges_t, step=step, stage=stage, update="real")
