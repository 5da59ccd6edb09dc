"""Per (bin, parameter group) sums of the shares (`tokendyn.effects.shares`): the parameter groups, float64 inner
products, the bins of a batch, and the norms and shares of the per-bin gradients."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from tokendyn.probe.bins import DEFAULT_EDGES, bin_bounds
from tokendyn.probe.parallel import check_wholly_sharded, sum_over_ranks
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
