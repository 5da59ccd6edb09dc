"""Gradient of a probability bin, its norms, and the exact shares of the update (DESIGN.md, "Gradient of a bin").

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

import contextlib
import re
import warnings
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from tokendyn.config import SHARE_METHODS
from tokendyn.probe.bins import DEFAULT_EDGES, bin_bounds
from tokendyn.probe.parallel import check_wholly_sharded, fsdp_modules, gradients, reshard, sum_over_ranks
from tokendyn.probe.tokenloss import (
    Objective,
    ProbeBatch,
    analysis_forward,
    bin_index,
    completion_logp,
    completion_logp_entropy,
    eval_mode,
    loss_terms,
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
# the per-token JVP goes through `torch.func.functional_call`, whose substituted parameters FSDP2's hooks replace
FSDP_NO_TOKEN_SHARES = (
    "shares: per-token shares (the token_shares record, the shares' jvp_share) are not computed on FSDP2-sharded "
    "parameters: their forward-mode JVP substitutes the parameters, which FSDP2's gathering replaces; the per-bin "
    "shares, norms and every other analysis are exact"
)
METHODS = SHARE_METHODS
_SUM_CHUNK = 1 << 22  # elements per float64 partial sum (32 MiB of float64 per operand)
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


def as_edges(edges: torch.Tensor | tuple[float, ...] | list[float] | None) -> torch.Tensor:
    """Bin edges as a float64 tensor (default the paper's [0, .25, .5, .75, 1]); checked like
    `tokendyn.probe.bins.validate_edges`."""
    from tokendyn.probe.bins import validate_edges

    values = DEFAULT_EDGES if edges is None else edges
    if torch.is_tensor(values):
        values = values.tolist()
    return torch.tensor(validate_edges(values), dtype=torch.float64)


@dataclass
class BinSplit:
    """The bins of one batch's tokens and what the per-bin gradients of it were computed from (no gradients)."""

    names: list[str]
    groups: list[str]
    edges: torch.Tensor  # (K + 1,) float64
    bins: torch.Tensor  # (B, C) long, -1 on padding
    pi_old: torch.Tensor  # (B, C) float64
    loss: float
    # (B, C) bool: the tokens in the loss (None: every completion token)
    token_mask: torch.Tensor | None = None

    @property
    def n_bins(self) -> int:
        return self.edges.numel() - 1

    def in_loss(self, k: int) -> torch.Tensor:
        """The tokens of bin k that are in the loss."""
        m = self.bins == k
        return m if self.token_mask is None else m & self.token_mask

    def counts(self) -> list[int]:
        return [int(self.in_loss(k).sum()) for k in range(self.n_bins)]


@dataclass
class BinGradients(BinSplit):
    """`BinSplit` with every per-bin gradient g_b held (name -> tensor, one dict per bin): K parameter-sized
    buffers (`bin_gradients`)."""

    per_bin: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def total(self) -> dict[str, torch.Tensor]:
        """g = sum_b g_b."""
        return {n: torch.stack([gb[n] for gb in self.per_bin]).sum(0) for n in self.names}


def dot64(a: torch.Tensor, b: torch.Tensor) -> float:
    """<a, b> = sum_i a_i b_i accumulated in float64, over slices of `_SUM_CHUNK` elements (no float64 copy of a
    whole parameter)."""
    x, y = a.detach().reshape(-1), b.detach().reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for lo in range(0, x.numel(), _SUM_CHUNK):
        xs = x[lo : lo + _SUM_CHUNK].to(torch.float64)
        ys = xs if a is b else y[lo : lo + _SUM_CHUNK].to(torch.float64)
        total += torch.dot(xs, ys)
    return float(total)


class GroupSums:
    """Per (bin, parameter group) sums of one batch, accumulated one gradient at a time (float64):
    sq[b, j] = ||g_b||^2 and dot[b, j] = <g_b, g> on group j, tot[j] = ||g||^2; column 0 is every parameter."""

    def __init__(self, names: list[str], groups: list[str], k: int) -> None:
        self.names = names
        self.groups = [ALL, *sorted(set(groups), key=group_order)]
        col = {grp: j for j, grp in enumerate(self.groups)}
        self.cols = [(0, col[grp]) for grp in groups]
        self.sq = torch.zeros(k, len(self.groups), dtype=torch.float64)
        self.dot = torch.zeros(k, len(self.groups), dtype=torch.float64)
        self.tot = torch.zeros(len(self.groups), dtype=torch.float64)

    def add_total(self, g: list[torch.Tensor | None]) -> None:
        for cols, t in zip(self.cols, g, strict=True):
            if t is not None:
                v = dot64(t, t)
                for j in cols:
                    self.tot[j] += v

    def add_bin(self, b: int, gb: list[torch.Tensor | None], g: list[torch.Tensor | None]) -> None:
        for cols, tb, t in zip(self.cols, gb, g, strict=True):
            if tb is None:
                continue
            s, d = dot64(tb, tb), (0.0 if t is None else dot64(tb, t))
            for j in cols:
                self.sq[b, j] += s
                self.dot[b, j] += d

    def reduce(self, model: nn.Module) -> GroupSums:
        """Sums over the ranks' shards when the model is FSDP2-sharded (a collective there), else as they are."""
        check_wholly_sharded(model)
        for t in (self.sq, self.dot, self.tot):
            sum_over_ranks(t, model)
        return self

    def shares(self, split: BinSplit) -> BinShares:
        return BinShares(
            split.edges, split.counts(), self.groups, self.sq.sqrt(), self.dot, self.tot.sqrt(), split.loss
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
    """||g_b||, <g_b, g> and ||g|| over all parameters and per group (float64), g = sum_b g_b, from gradients held
    at once (`bin_gradients`)."""
    sums = GroupSums(grads.names, grads.groups, grads.n_bins)
    total = grads.total()
    g = [total[n] for n in grads.names]
    sums.add_total(g)
    for b, gb in enumerate(grads.per_bin):
        sums.add_bin(b, [gb[n] for n in grads.names], g)
    return sums.shares(grads)


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


@analysis_forward
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
    norm2 = sum(dot64(v, v) for v in tangents)
    if norm2 == 0.0:
        raise ValueError("shares: the direction is zero (no advantage on any token?); shares are undefined")

    def terms(*ps: torch.Tensor) -> torch.Tensor:
        return token_loss(model, batch, objective, dict(zip(names, ps, strict=True))).terms

    # forward-mode AD keeps no activations for a backward: nothing to checkpoint (and checkpointing refuses jvp)
    with eval_mode(model, checkpoint=False), jvp_attention(model), _no_input_require_grads(model):
        _, dterms = torch.func.jvp(terms, primals, tangents)
    return dterms.detach().to(torch.float64) / norm2


def token_shares_many(
    model: nn.Module,
    items: list[tuple[ProbeBatch, dict[str, torch.Tensor], Objective | None]],
    tangents: dict[str, torch.Tensor] | None = None,
    *,
    strict: bool = False,
) -> list[torch.Tensor]:
    """`token_shares` of several (batch, direction v_i, objective) at once: s_i,t = <grad l_t(batch_i, objective_i),
    v_i> / ||v_i||^2. Batches that differ at most in their advantages and rewards (one forward for all: the same
    tokens, masks and temperature) share one forward-mode pass with the directions batched (``torch.func.vmap`` over
    the tangents: the primal forward made once, 1.25 s less of 9.2 s per direction on SmolLM2-135M); otherwise,
    and under FSDP2, one `token_shares` each, as where vmap refuses an op (unless ``strict``: raised). ``tangents``:
    name -> (len(items), *shape) tensor holding the directions stacked (no second copy of them is made), else
    stacked here."""
    same = all(same_forward(items[0][0], b) for b, _, _ in items[1:])
    if len(items) < 2 or not same or fsdp_modules(model):
        return [token_shares(model, b, d, objective=o) for b, d, o in items]
    params = trainable_parameters(model)
    names = list(items[0][1])
    if any(list(d) != names for _, d, _ in items) or any(n not in params for n in names):
        raise ValueError("shares: the directions must name the same trainable parameters")
    primals = tuple(params[n].detach() for n in names)
    if tangents is None:
        tangents = {n: torch.stack([d[n].detach() for _, d, _ in items]) for n in names}
    stacked = tuple(tangents[n].to(dtype=params[n].dtype, device=params[n].device) for n in names)
    norms = [sum(dot64(d[n], d[n]) for n in names) for _, d, _ in items]
    if any(x == 0.0 for x in norms):
        raise ValueError("shares: a direction is zero (no advantage on any token?); shares are undefined")
    objectives = [o or Objective() for _, _, o in items]
    entropy = any(o.needs_entropy for o in objectives)
    batch = items[0][0]

    def terms(*ps: torch.Tensor) -> torch.Tensor:
        named = dict(zip(names, ps, strict=True))
        if entropy:
            logp, h = completion_logp_entropy(model, batch, named)
        else:
            logp, h = completion_logp(model, batch, named), None
        return torch.stack(
            [loss_terms(logp, b, o, h) for (b, _, _), o in zip(items, objectives, strict=True)]
        )

    try:
        with eval_mode(model, checkpoint=False), jvp_attention(model), _no_input_require_grads(model):
            # (randomness "same": a rule drawing random numbers, Clip-Cov, draws them once for every direction, as
            # one forward would; its draws come from its own seeded generator)
            dterms = torch.func.vmap(lambda *t: torch.func.jvp(terms, primals, t)[1], randomness="same")(
                *stacked
            )
    except RuntimeError:  # (an op vmap has no batching rule for: one JVP each, the same numbers)
        if strict:
            raise
        return [token_shares(model, b, d, objective=o) for b, d, o in items]
    return [dterms[i, i].detach().to(torch.float64) / norms[i] for i in range(len(items))]


def same_forward(a: ProbeBatch, b: ProbeBatch) -> bool:
    """Whether the two batches' model forward is the same (tokens, masks, temperature)."""
    same = a.temperature == b.temperature
    for name in ("input_ids", "attention_mask", "completion_mask"):
        x, y = getattr(a, name), getattr(b, name)
        same = same and (x is y or (x.shape == y.shape and torch.equal(x, y.to(x.device))))
    return same


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
