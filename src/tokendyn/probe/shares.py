"""Gradient of a probability bin, its norms, and the exact shares of the update (DESIGN.md, "Gradient of a bin").

With l_t the per-token loss terms of `tokendyn.probe.tokenloss` (L = sum_t l_t) and bins over pi_old:

    g_b = grad_theta L_b,   L_b = sum_{t in b} l_t     (the loss with A_t, and the KL term, zeroed outside bin b;
                                                        the normalizer still counts every token)
    g   = sum_b g_b = grad_theta L
    s_b = <g_b, g> / ||g||^2          (projection share; sum_b s_b = 1)
    s_t = <grad_theta l_t, g> / ||g||^2   (per-token share; sum_{t in b} s_t = s_b, sum_t s_t = 1)

g_b comes from K backward passes over one forward (default) or one batched backward
(``torch.autograd.grad(..., is_grads_batched=True)``); s_t for every token at once from one forward-mode JVP along g (``torch.func.jvp`` over
``torch.func.functional_call``): d/de l_t(theta + e g) at e = 0 is <grad l_t, g>. The JVP needs eager attention or
the SDPA math kernel (selected here) and an unfused LM head (a plain Hugging Face forward is unfused).

Norms and inner products are accumulated in float64; the model is run in eval mode (no dropout) and left as it
was: no ``.grad`` is written, no parameter changes.
"""

from __future__ import annotations

import contextlib
import re
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from tokendyn.config import SHARE_METHODS
from tokendyn.probe.bins import DEFAULT_EDGES, bin_bounds
from tokendyn.probe.tokenloss import (
    Objective,
    ProbeBatch,
    bin_index,
    eval_mode,
    token_loss,
    trainable_parameters,
)
from tokendyn.records import to_frame
from tokendyn.vocab import (
    ALL_PARAMETERS,
    EMBEDDINGS,
    FINAL_NORM_GROUP,
    LM_HEAD,
    OTHER,
    TRAIN,
    group_order,
    layer_group,
)

ALL = ALL_PARAMETERS
METHODS = SHARE_METHODS
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
_FINAL_NORM = re.compile(r"(?:^|\.)(?:norm|ln_f|final_layer_norm|final_layernorm)\.[^.]+$")
_EMBED = re.compile(r"embed_tokens|wte|wpe|embed_positions|embed_in")
_HEAD = re.compile(r"(?:^|\.)(?:lm_head|embed_out)\.")


def parameter_group(name: str) -> str:
    """The group of a parameter name: ``layers.{i}`` (decoder layer i: ``model.layers.{i}.*``, GPT-2
    ``transformer.h.{i}.*``), ``embeddings``, ``final_norm``, ``lm_head`` or ``other``. A tied LM head is the
    embedding matrix and counts as ``embeddings``."""
    m = _LAYER.search(name)
    if m:
        return layer_group(int(m.group(1)))
    if _EMBED.search(name):
        return EMBEDDINGS
    if _HEAD.search(name):
        return LM_HEAD
    if _FINAL_NORM.search(name):
        return FINAL_NORM_GROUP
    return OTHER


def parameter_groups(model: nn.Module) -> dict[str, str]:
    """name -> group (`parameter_group`) for every trainable parameter, in the model's order."""
    return {n: parameter_group(n) for n in trainable_parameters(model)}


def as_edges(edges: torch.Tensor | tuple[float, ...] | list[float] | None) -> torch.Tensor:
    """Bin edges as a float64 tensor (default the paper's [0, .25, .5, .75, 1]); checked like
    `tokendyn.probe.bins.validate_edges`."""
    from tokendyn.probe.bins import validate_edges

    values = DEFAULT_EDGES if edges is None else edges
    if torch.is_tensor(values):
        values = values.tolist()
    return torch.tensor(validate_edges(values), dtype=torch.float64)


@dataclass
class BinGradients:
    """The per-bin gradients g_b (name -> tensor, one dict per bin), the bins they came from, and the loss."""

    names: list[str]
    groups: list[str]
    edges: torch.Tensor  # (K + 1,) float64
    bins: torch.Tensor  # (B, C) long, -1 on padding
    pi_old: torch.Tensor  # (B, C) float64
    per_bin: list[dict[str, torch.Tensor]]
    loss: float
    # (B, C) bool: the tokens in the loss (None: every completion token)
    token_mask: torch.Tensor | None = None

    @property
    def n_bins(self) -> int:
        return len(self.per_bin)

    def in_loss(self, k: int) -> torch.Tensor:
        """The tokens of bin k that are in the loss."""
        m = self.bins == k
        return m if self.token_mask is None else m & self.token_mask

    def counts(self) -> list[int]:
        return [int(self.in_loss(k).sum()) for k in range(self.n_bins)]

    def total(self) -> dict[str, torch.Tensor]:
        """g = sum_b g_b."""
        return {n: torch.stack([gb[n] for gb in self.per_bin]).sum(0) for n in self.names}


def bin_gradients(
    model: nn.Module,
    batch: ProbeBatch,
    edges: torch.Tensor | tuple[float, ...] | list[float] | None = None,
    *,
    objective: Objective | None = None,
    method: str = "loop",
    token_mask: torch.Tensor | None = None,
) -> BinGradients:
    """g_b = grad_theta sum_{t in b} l_t for every bin b of pi_old (module docstring), from one forward and either
    K backward passes (``method="loop"``, the default) or one batched backward (``"batched"``: vmap over the K
    bins, more memory; slower than the loop on CPU at 64 x 250 tokens, bench/share_cost.py).
    pi_old = exp(batch.old_logp), or the current pi when the batch is on-policy. ``token_mask`` (B, C): the loss
    restricted to these tokens, L = sum_{t in mask} l_t (a Lopti stage), so g_b = grad sum_{t in b and mask} l_t and
    g = sum_b g_b is the stage's gradient."""
    if method not in METHODS:
        raise ValueError(f"shares: method must be one of {METHODS}, got {method!r}")
    edges_t = as_edges(edges)
    k = edges_t.numel() - 1
    params = trainable_parameters(model)
    names, tensors = list(params), list(params.values())
    with eval_mode(model):
        tl = token_loss(model, batch, objective)
        logp_old = tl.logp.detach() if batch.old_logp is None else batch.old_logp
        pi = torch.exp(logp_old.to(torch.float64))
        bins = bin_index(pi, batch.completion_mask, edges_t)
        keep = (
            torch.ones_like(bins, dtype=torch.bool)
            if token_mask is None
            else token_mask.bool().to(bins.device)
        )
        masks = torch.stack([((bins == b) & keep).to(tl.terms.dtype) for b in range(k)])
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
    loss = tl.loss if token_mask is None else (tl.terms * masks.sum(0)).sum()
    return BinGradients(
        names,
        [parameter_group(n) for n in names],
        edges_t,
        bins,
        pi,
        per_bin,
        float(loss.detach()),
        None if token_mask is None else keep,
    )


@dataclass
class BinShares:
    """Norms and shares per (bin, parameter group). Index 0 of `groups` is "all" (every parameter).

    grad_norm[b, j] = ||g_b|| on group j; dot[b, j] = <g_b, g> on group j; total_norm[j] = ||g|| on group j;
    share[b, j] = dot[b, j] / total_norm[j]^2 (sums to 1 over b in every group); jvp_share[b] = sum_{t in b} s_t
    from the per-token route (None if not computed)."""

    edges: torch.Tensor
    counts: list[int]
    groups: list[str]
    grad_norm: torch.Tensor  # (K, G) float64
    dot: torch.Tensor  # (K, G) float64
    total_norm: torch.Tensor  # (G,) float64
    loss: float
    jvp_share: torch.Tensor | None = None  # (K,) float64

    @property
    def share(self) -> torch.Tensor:
        return self.dot / self.total_norm.pow(2).unsqueeze(0)

    def to_frame(self, step: int, stage: str = TRAIN):
        """The `shares` record (see `tokendyn.records.SCHEMAS`); bin -1 is all tokens."""
        k, g = self.dot.shape
        cols: dict[str, list] = {
            c: []
            for c in (
                "step",
                "stage",
                "bin",
                "bin_lo",
                "bin_hi",
                "group",
                "count",
                "grad_norm",
                "dot",
                "total_norm",
                "share",
                "jvp_share",
                "loss",
            )
        }
        share = self.share
        for b in [-1, *range(k)]:
            for j, group in enumerate(self.groups):
                total = float(self.total_norm[j])
                cols["step"].append(step)
                cols["stage"].append(stage)
                cols["bin"].append(b)
                lo, hi = bin_bounds(self.edges, b)
                cols["bin_lo"].append(lo)
                cols["bin_hi"].append(hi)
                cols["group"].append(group)
                cols["count"].append(sum(self.counts) if b < 0 else self.counts[b])
                cols["grad_norm"].append(total if b < 0 else float(self.grad_norm[b, j]))
                cols["dot"].append(total**2 if b < 0 else float(self.dot[b, j]))
                cols["total_norm"].append(total)
                # with g = 0 (no advantage, no KL gradient) the shares are undefined: null
                cols["share"].append(None if total == 0 else 1.0 if b < 0 else float(share[b, j]))
                jvp = None
                if self.jvp_share is not None and j == 0:
                    jvp = float(self.jvp_share.sum()) if b < 0 else float(self.jvp_share[b])
                cols["jvp_share"].append(jvp)
                cols["loss"].append(self.loss)
        return to_frame("shares", cols)


def bin_shares(grads: BinGradients) -> BinShares:
    """||g_b||, <g_b, g> and ||g|| over all parameters and per group (float64), g = sum_b g_b."""
    groups = [ALL, *sorted(set(grads.groups), key=group_order)]
    col = {grp: j for j, grp in enumerate(groups)}
    k = grads.n_bins
    sq = torch.zeros(k, len(groups), dtype=torch.float64)
    dot = torch.zeros(k, len(groups), dtype=torch.float64)
    tot = torch.zeros(len(groups), dtype=torch.float64)
    total = grads.total()
    for name, grp in zip(grads.names, grads.groups, strict=True):
        g = total[name].detach().to(torch.float64).flatten()
        stacked = torch.stack([gb[name].detach().to(torch.float64).flatten() for gb in grads.per_bin])
        s, d, t = stacked.pow(2).sum(1).cpu(), (stacked @ g).cpu(), g.pow(2).sum().cpu()
        for j in (0, col[grp]):
            sq[:, j] += s
            dot[:, j] += d
            tot[j] += t
    return BinShares(grads.edges, grads.counts(), groups, sq.sqrt(), dot, tot.sqrt(), grads.loss)


def jvp_attention(model: nn.Module) -> AbstractContextManager:
    """The attention kernels forward-mode AD can go through: eager as is, SDPA restricted to its math kernel."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or "eager"
    if impl == "eager":
        return nullcontext()
    if impl == "sdpa":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.MATH)
    raise ValueError(
        f"shares: per-token shares need forward-mode AD, which attn_implementation={impl!r} does not support; "
        "load the model with attn_implementation='eager' or 'sdpa'"
    )


def token_shares(
    model: nn.Module,
    batch: ProbeBatch,
    direction: dict[str, torch.Tensor],
    *,
    objective: Objective | None = None,
) -> torch.Tensor:
    """s_t = <grad_theta l_t, v> / ||v||^2 for every completion token, (B, C) float64, zero on padding, from one
    forward-mode JVP of the per-token terms along v (``direction``: name -> tensor, e.g. g = `BinGradients.total`).
    With v = g: sum_t s_t = 1 and sum_{t in b} s_t = s_b."""
    params = trainable_parameters(model)
    missing = [n for n in direction if n not in params]
    if missing:
        raise ValueError(f"shares: direction has tensors for unknown or frozen parameters: {missing[:3]}")
    names = list(direction)
    primals = tuple(params[n].detach() for n in names)
    tangents = tuple(direction[n].detach().to(dtype=params[n].dtype, device=params[n].device) for n in names)
    norm2 = sum(float(v.to(torch.float64).pow(2).sum()) for v in tangents)
    if norm2 == 0.0:
        raise ValueError("shares: the direction is zero (no advantage on any token?); shares are undefined")

    def terms(*ps: torch.Tensor) -> torch.Tensor:
        return token_loss(model, batch, objective, dict(zip(names, ps, strict=True))).terms

    with eval_mode(model), jvp_attention(model), _no_input_require_grads(model):
        _, dterms = torch.func.jvp(terms, primals, tangents)
    return dterms.detach().to(torch.float64) / norm2


@contextlib.contextmanager
def _no_input_require_grads(model: nn.Module):
    """Gradient checkpointing makes HF models call ``requires_grad_`` on the embeddings' output in a forward
    hook (``enable_input_require_grads``; the trainers may register it more than once), which functorch
    transforms refuse: set those hooks aside for the JVP and put them back after."""
    stashed = []
    for module in model.modules():
        hooks = module._forward_hooks
        for key, fn in list(hooks.items()):
            if getattr(fn, "__name__", "") == "make_inputs_require_grads":
                stashed.append((hooks, key, fn))
                del hooks[key]
    try:
        yield
    finally:
        for hooks, key, fn in stashed:
            hooks[key] = fn


@dataclass
class ShareResult:
    """Per-bin gradients and shares, and the per-token shares s_t ((B, C), None if not asked)."""

    grads: BinGradients
    bins: BinShares
    tokens: torch.Tensor | None


def gradient_shares(
    model: nn.Module,
    batch: ProbeBatch,
    edges: torch.Tensor | tuple[float, ...] | list[float] | None = None,
    *,
    objective: Objective | None = None,
    method: str = "loop",
    per_token: bool = True,
    token_mask: torch.Tensor | None = None,
) -> ShareResult:
    """`bin_gradients` + `bin_shares`, and with ``per_token`` the JVP shares s_t along g (their per-bin sums go
    into ``BinShares.jvp_share``). ``token_mask``: the loss restricted to these tokens (a Lopti stage); counts,
    shares and s_t are then over those tokens only (s_t = 0 outside). A batch whose gradient is zero (every advantage
    0 and no KL gradient, e.g. a sample of zero-variance groups at the first step) has no shares: the `shares` rows
    carry null, and no per-token shares are computed."""
    grads = bin_gradients(model, batch, edges, objective=objective, method=method, token_mask=token_mask)
    shares = bin_shares(grads)
    tokens = None
    if per_token and float(shares.total_norm[0]) > 0:  # g = 0 (no advantage, no KL gradient): s_t undefined
        tokens = token_shares(model, batch, grads.total(), objective=objective)
        if grads.token_mask is not None:
            tokens = torch.where(grads.token_mask, tokens, torch.zeros_like(tokens))
        shares.jvp_share = torch.stack([tokens[grads.in_loss(b)].sum() for b in range(grads.n_bins)]).to(
            torch.float64
        )
    return ShareResult(grads, shares, tokens)
