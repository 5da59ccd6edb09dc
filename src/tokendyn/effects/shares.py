"""Gradient of a probability bin, its norms, and the exact shares of the update (docs/definitions.md).

With l_t the per-token loss terms of `tokendyn.probe.tokenloss` (L = sum_t l_t) and bins over pi_old:

    g_b = grad_theta L_b,   L_b = sum_{t in b} l_t     (the loss with A_t, and the KL term, zeroed outside bin b;
                                                        the normalizer still counts every token)
    g   = sum_b g_b = grad_theta L
    s_b = <g_b, g> / ||g||^2          (projection share; sum_b s_b = 1)
    s_t = <grad_theta l_t, g> / ||g||^2   (per-token share; sum_{t in b} s_t = s_b, sum_t s_t = 1)

The shares are streamed (`gradient_shares`, method "stream", the default): one forward, one backward for g, then one
backward per bin for g_b, whose per-group ||g_b||^2 and <g_b, g> are accumulated in float64 before the next bin's
backward; at most two parameter-sized gradients (g and one g_b) exist at a time, whatever K. `bin_gradients` keeps
every g_b (K parameter-sized buffers, and one more for their sum g; method "loop": K backward passes, "batched": one
batched backward, ``torch.autograd.grad(..., is_grads_batched=True)``, with a vmap over K), an explicit opt-in for who
needs the gradients themselves. s_t for every token at once from one forward-mode JVP along g
(``torch.func.jvp`` over ``torch.func.functional_call``): d/de l_t(theta + e g) at e = 0 is <grad l_t, g>. The JVP needs eager attention or
the SDPA math kernel (selected here) and an unfused LM head (a plain Hugging Face forward is unfused).

Norms and inner products are accumulated in float64; the model is run in eval mode (no dropout) and left as it
was: no ``.grad`` is written, no parameter changes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from tokendyn.config import SHARE_METHODS
from tokendyn.effects.shares_backward import bin_gradients, streamed_shares
from tokendyn.effects.shares_jvp import (
    FSDP_NO_TOKEN_SHARES,
    _no_input_require_grads,
    jvp_attention,
    same_forward,
    token_shares,
    token_shares_many,
)
from tokendyn.effects.shares_sums import (
    ALL,
    BinGradients,
    BinShares,
    BinSplit,
    GroupSums,
    as_edges,
    bin_shares,
    dot64,
    parameter_group,
)
from tokendyn.probe.parallel import fsdp_modules
from tokendyn.probe.tokenloss import (
    Objective,
    ProbeBatch,
    analysis_forward,
)

# the shares' parts, re-exported: the per-bin sums (`tokendyn.effects.shares_sums`), the backward passes
# (`tokendyn.effects.shares_backward`) and the per-token JVP (`tokendyn.effects.shares_jvp`)
__all__ = [
    "ALL",
    "BinGradients",
    "BinShares",
    "BinSplit",
    "GroupSums",
    "as_edges",
    "bin_shares",
    "dot64",
    "parameter_group",
    "bin_gradients",
    "streamed_shares",
    "FSDP_NO_TOKEN_SHARES",
    "_no_input_require_grads",
    "jvp_attention",
    "same_forward",
    "token_shares",
    "token_shares_many",
]
METHODS = SHARE_METHODS


@dataclass
class ShareResult:
    """The bins, the shares, and the per-token shares s_t ((B, C), None if not asked). ``grads`` is a
    `BinGradients` (every g_b) for the methods "loop" and "batched", a `BinSplit` (no gradients) for "stream"."""

    grads: BinSplit
    bins: BinShares
    tokens: torch.Tensor | None


@analysis_forward
def gradient_shares(
    model: nn.Module,
    batch: ProbeBatch,
    edges: torch.Tensor | tuple[float, ...] | list[float] | None = None,
    *,
    objective: Objective | None = None,
    method: str = "stream",
    per_token: bool = True,
    token_mask: torch.Tensor | None = None,
) -> ShareResult:
    """The per-bin shares (`streamed_shares`, or ``method`` "loop"/"batched": `bin_gradients` + `bin_shares`,
    every g_b held), and with ``per_token`` the JVP shares s_t along g (their per-bin sums go into
    ``BinShares.jvp_share``). Memory ("stream"): two parameter-sized gradients during the backward passes, then g
    and the JVP's tangents. ``token_mask``: the loss restricted to these tokens (a Lopti stage); counts, shares
    and s_t are then over those tokens only (s_t = 0 outside). A batch whose gradient is zero (every advantage 0
    and no KL gradient, e.g. a sample of zero-variance groups at the first step) has no shares: the `shares` rows
    carry null, and no per-token shares are computed. On an FSDP2-sharded model (every rank calling this on the
    same batch) the per-bin shares are summed over the ranks' shards and the per-token shares are skipped with a
    warning (`FSDP_NO_TOKEN_SHARES`)."""
    if method not in METHODS:
        raise ValueError(f"shares: method must be one of {METHODS}, got {method!r}")
    if per_token and fsdp_modules(model):
        warnings.warn(FSDP_NO_TOKEN_SHARES, stacklevel=2)
        per_token = False
    if method == "stream":
        grads, shares, total = streamed_shares(
            model, batch, edges, objective=objective, token_mask=token_mask, keep_total=per_token
        )
    else:
        grads = bin_gradients(model, batch, edges, objective=objective, method=method, token_mask=token_mask)
        shares, total = bin_shares(grads), None
    direction = None
    if per_token and float(shares.total_norm[0]) > 0:  # g = 0 (no advantage, no KL gradient): s_t undefined
        direction = total if total is not None else grads.total()
    del total
    return with_token_shares(model, batch, grads, shares, direction, objective)


def with_token_shares(
    model: nn.Module,
    batch: ProbeBatch,
    split: BinSplit,
    shares: BinShares,
    direction: dict[str, torch.Tensor] | None,
    objective: Objective | None,
) -> ShareResult:
    """The `ShareResult` of ``split`` and ``shares``, with the per-token JVP shares s_t along ``direction`` (g; None:
    none), zero outside the loss's tokens, and their per-bin sums in ``shares.jvp_share``."""
    tokens = None
    if direction is not None:
        tokens = token_shares(model, batch, direction, objective=objective)
        if split.token_mask is not None:
            tokens = torch.where(split.token_mask, tokens, torch.zeros_like(tokens))
        shares.jvp_share = torch.stack([tokens[split.in_loss(b)].sum() for b in range(split.n_bins)]).to(
            torch.float64
        )
    return ShareResult(split, shares, tokens)
