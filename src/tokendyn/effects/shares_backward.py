"""The per-bin gradients g_b of the shares (`tokendyn.effects.shares`) by backward passes: every g_b held
(`bin_gradients`), or streamed into their float64 sums one bin at a time (`streamed_shares`)."""

from __future__ import annotations

import torch
from torch import nn

from tokendyn.effects.shares_sums import (
    BinGradients,
    BinShares,
    BinSplit,
    GroupSums,
    as_edges,
    parameter_group,
)
from tokendyn.probe.parallel import fsdp_modules, gradients, reshard
from tokendyn.probe.tokenloss import (
    Objective,
    ProbeBatch,
    analysis_forward,
    bin_index,
    eval_mode,
    token_loss,
    trainable_parameters,
)


def _bin_setup(model, batch, edges, objective, token_mask):
    """One forward in eval mode (the caller holds eval mode): the loss, the bins over pi_old and the (K, B, C)
    per-bin token masks m_b = [t in b and t in token_mask]."""
    edges_t = as_edges(edges)
    k = edges_t.numel() - 1
    reshard(model)  # FSDP2: the sharded parameters are the registered ones (`parallel.reshard`)
    params = trainable_parameters(model)
    tl = token_loss(model, batch, objective)
    logp_old = tl.logp.detach() if batch.old_logp is None else batch.old_logp
    pi = torch.exp(logp_old.to(torch.float64))
    bins = bin_index(pi, batch.completion_mask, edges_t)
    keep = (
        torch.ones_like(bins, dtype=torch.bool) if token_mask is None else token_mask.bool().to(bins.device)
    )
    masks = torch.stack([((bins == b) & keep).to(tl.terms.dtype) for b in range(k)])
    loss = tl.loss if token_mask is None else (tl.terms * masks.sum(0)).sum()
    names = list(params)
    split = BinSplit(
        names,
        [parameter_group(n) for n in names],
        edges_t,
        bins,
        pi,
        float(loss.detach()),
        None if token_mask is None else keep,
    )
    return params, tl, masks, split


@analysis_forward
def bin_gradients(
    model: nn.Module,
    batch: ProbeBatch,
    edges: torch.Tensor | tuple[float, ...] | list[float] | None = None,
    *,
    objective: Objective | None = None,
    method: str = "loop",
    token_mask: torch.Tensor | None = None,
) -> BinGradients:
    """g_b = grad_theta sum_{t in b} l_t for every bin b of pi_old (module docstring), all held at once: memory K
    parameter-sized gradients (`streamed_shares` computes the shares with two). From one forward and either K
    backward passes (``method="loop"``, the default) or one batched backward (``"batched"``: vmap over the K bins,
    K parameter-sized gradients more in the backward; slower than the loop on CPU at 64 x 250 tokens,
    bench/share_cost.py). pi_old = exp(batch.old_logp), or the current pi when the batch is on-policy.
    ``token_mask`` (B, C): the loss restricted to these tokens, L = sum_{t in mask} l_t (a Lopti stage), so
    g_b = grad sum_{t in b and mask} l_t and g = sum_b g_b is the stage's gradient."""
    if method not in ("batched", "loop"):
        raise ValueError(f"shares: method must be one of ('batched', 'loop'), got {method!r}")
    if fsdp_modules(model):
        raise ValueError("shares: under FSDP2 the per-bin gradients are streamed only (method 'stream')")
    with eval_mode(model):
        params, tl, masks, split = _bin_setup(model, batch, edges, objective, token_mask)
        names, tensors = list(params), list(params.values())
        k = masks.size(0)
        if method == "batched":
            grads = torch.autograd.grad(
                tl.terms, tensors, grad_outputs=masks, is_grads_batched=True, allow_unused=True
            )
            grads = [
                torch.zeros((k, *p.shape), dtype=p.dtype, device=p.device) if g is None else g
                for g, p in zip(grads, tensors, strict=True)
            ]
            per_bin = [{n: g[b] for n, g in zip(names, grads, strict=True)} for b in range(k)]
        else:
            per_bin = []
            for b in range(k):
                grads = torch.autograd.grad(
                    tl.terms, tensors, grad_outputs=masks[b], retain_graph=b < k - 1, allow_unused=True
                )
                per_bin.append(
                    {
                        n: torch.zeros_like(p) if g is None else g
                        for n, g, p in zip(names, grads, tensors, strict=True)
                    }
                )
    return BinGradients(**vars(split), per_bin=per_bin)


@analysis_forward
def streamed_shares(
    model: nn.Module,
    batch: ProbeBatch,
    edges: torch.Tensor | tuple[float, ...] | list[float] | None = None,
    *,
    objective: Objective | None = None,
    token_mask: torch.Tensor | None = None,
    keep_total: bool = False,
) -> tuple[BinSplit, BinShares, dict[str, torch.Tensor] | None]:
    """(bins, shares, g or None) with the g_b streamed: one forward, g = grad sum_b L_b by one backward, then
    g_b = grad L_b by one backward per bin, each reduced to its per-group ||g_b||^2 and <g_b, g> (float64,
    `GroupSums`) and freed before the next: at most two parameter-sized gradients at a time. The same numbers as
    `bin_shares(bin_gradients(...))` up to the rounding of g (a backward of the summed masks here, a sum of the
    g_b there). ``keep_total``: return g (name -> tensor, e.g. the JVP direction of `token_shares`), else None.
    ``token_mask``: as in `bin_gradients`."""
    with eval_mode(model):
        params, tl, masks, split = _bin_setup(model, batch, edges, objective, token_mask)
        tensors = list(params.values())
        sums = GroupSums(split.names, split.groups, masks.size(0))
        g = gradients(model, tl.terms, tensors, masks.sum(0), retain_graph=True)  # FSDP2: this rank's shards
        sums.add_total(g)
        for b in range(masks.size(0)):
            last = b == masks.size(0) - 1
            if not bool(masks[b].any()):  # no token of the bin in the loss: g_b = 0
                continue
            gb = gradients(model, tl.terms, tensors, masks[b], retain_graph=not last)
            sums.add_bin(b, gb, g)
            del gb
        del tl  # the graph, if the last bins had no tokens
    total = None
    if keep_total:
        total = {
            n: torch.zeros_like(p) if t is None else t for (n, p), t in zip(params.items(), g, strict=True)
        }
    return split, sums.reduce(model).shares(split), total
