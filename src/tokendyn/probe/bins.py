"""Probability bins: interval, quantile or custom edges over [0, 1], and the bin index of each token.

Convention (the paper's Fig. 1): bin b is the half-open interval [e_b, e_{b+1}); the last bin is closed,
[e_{n-1}, e_n], so a token with pi = 1 exactly falls into the last bin. Every table carries the edges it used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tokendyn.config import DEFAULT_EDGES, interval_edges, parse_bins, validate_edges

__all__ = [
    "DEFAULT_EDGES",
    "BinSpec",
    "assign_bins",
    "bin_bounds",
    "interval_edges",
    "quantile_edges",
    "validate_edges",
]

ReduceFn = Callable[[torch.Tensor], torch.Tensor]


def bin_bounds(edges: Sequence[float] | torch.Tensor, b: int) -> tuple[float, float]:
    """(lo, hi) of bin b of ``edges``; b = -1 (all tokens) spans the whole range."""
    return (float(edges[0]), float(edges[-1])) if b < 0 else (float(edges[b]), float(edges[b + 1]))


def assign_bins(pi: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Bin index b of each probability: e_b <= pi < e_{b+1}, and pi = e_n = 1 goes to the last bin n-1.

    Implemented as the number of inner edges e_1..e_{n-1} that are <= pi.
    """
    inner = edges[1:-1].to(device=pi.device, dtype=torch.float64)
    return torch.bucketize(pi.to(torch.float64), inner, right=True)


def quantile_edges(
    pi: torch.Tensor,
    valid: torch.Tensor,
    n: int,
    resolution: int = 4096,
    reduce_fn: ReduceFn | None = None,
) -> torch.Tensor:
    """Edges at the k/n quantiles of pi over the valid tokens, read off a histogram of `resolution` cells of [0, 1].

    e_0 = 0, e_n = 1, and e_k = (i_k + 1) / resolution where i_k is the first cell whose cumulative share is >= k/n.
    The histogram is exact and additive, so `reduce_fn` (an all-reduce sum across processes) gives every rank the
    same edges. Repeated edges (heavy ties, e.g. most tokens at pi ~ 1) are merged, so fewer than n bins may result.
    """
    cells = (pi.detach().to(torch.float64).clamp(0.0, 1.0) * resolution).long().clamp(max=resolution - 1)
    counts = torch.zeros(resolution, dtype=torch.float64, device=pi.device)
    counts.index_add_(0, cells[valid], torch.ones_like(cells[valid], dtype=torch.float64))
    if reduce_fn is not None:
        counts = reduce_fn(counts)
    total = counts.sum()
    if float(total) == 0.0:
        return torch.tensor(interval_edges(n), dtype=torch.float64)
    cdf = counts.cumsum(0) / total
    targets = torch.arange(1, n, dtype=torch.float64, device=cdf.device) / n
    idx = torch.searchsorted(cdf, targets - 1e-12)
    inner = ((idx + 1).to(torch.float64) / resolution).cpu().tolist()
    edges = sorted({0.0, 1.0, *(e for e in inner if 0.0 < e < 1.0)})
    return torch.tensor(edges, dtype=torch.float64)


@dataclass(frozen=True)
class BinSpec:
    """How to bin tokens by pi_old.

    kind "intervals": n equal intervals; "quantiles": n bins at the batch's quantiles (per step, shared by ranks);
    "edges": the given edges. Parse from a spec with `BinSpec.parse`.
    """

    kind: str = "edges"
    n: int = 4
    edges: tuple[float, ...] | None = DEFAULT_EDGES
    resolution: int = 4096

    @classmethod
    def parse(cls, spec: BinSpec | str | int | Sequence[float] | None) -> BinSpec:
        """Accepts None (the paper's [0,.25,.5,.75,1]), a BinSpec, an int n (n intervals), a sequence of edges,
        or a string: "intervals:4", "quantiles:4", "edges:0,0.1,0.5,1" or "0,0.1,0.5,1"."""
        if isinstance(spec, BinSpec):
            return spec
        kind, n, edges = parse_bins(spec)
        return cls(kind=kind, n=n, edges=edges)

    def describe(self) -> str:
        if self.kind == "quantiles":
            return f"quantiles:{self.n}"
        return ",".join(f"{e:g}" for e in self.edges or ())

    def edges_for(
        self, pi: torch.Tensor, valid: torch.Tensor, reduce_fn: ReduceFn | None = None
    ) -> torch.Tensor:
        """The float64 edges to use for this batch (fixed ones, or the batch quantiles)."""
        if self.kind == "quantiles":
            return quantile_edges(pi, valid, self.n, self.resolution, reduce_fn)
        return torch.tensor(self.edges, dtype=torch.float64)
