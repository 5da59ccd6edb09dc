"""Probability bins: interval, quantile or custom edges over [0, 1], and the bin index of each token.

Convention (the paper's Fig. 1): bin b is the half-open interval [e_b, e_{b+1}); the last bin is closed,
[e_{n-1}, e_n], so a token with pi = 1 exactly falls into the last bin. Every table carries the edges it used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

DEFAULT_EDGES: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)

ReduceFn = Callable[[torch.Tensor], torch.Tensor]


def interval_edges(n: int) -> tuple[float, ...]:
    """Edges of n equal intervals of [0, 1]: e_k = k / n, k = 0..n."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"bins: the number of intervals must be an integer >= 1, got {n!r}")
    return tuple(k / n for k in range(n + 1))


def bin_bounds(edges: Sequence[float] | torch.Tensor, b: int) -> tuple[float, float]:
    """(lo, hi) of bin b of ``edges``; b = -1 (all tokens) spans the whole range."""
    return (float(edges[0]), float(edges[-1])) if b < 0 else (float(edges[b]), float(edges[b + 1]))


def validate_edges(edges: Sequence[float]) -> tuple[float, ...]:
    """Check custom edges: at least two, strictly increasing, first 0 and last 1 (they must cover [0, 1])."""
    try:
        out = tuple(float(e) for e in edges)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bins: edges must be numbers in [0, 1], got {edges!r}") from exc
    if len(out) < 2:
        raise ValueError(f"bins: need at least two edges, got {list(out)}")
    if out[0] != 0.0 or out[-1] != 1.0:
        raise ValueError(f"bins: edges must start at 0 and end at 1 (they cover [0, 1]), got {list(out)}")
    if any(b <= a for a, b in zip(out, out[1:], strict=False)):
        raise ValueError(f"bins: edges must be strictly increasing, got {list(out)}")
    return out


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
        if spec is None:
            return cls()
        if isinstance(spec, BinSpec):
            return spec
        if isinstance(spec, bool):
            raise ValueError(f"bins: expected intervals:N, quantiles:N or a list of edges, got {spec!r}")
        if isinstance(spec, int):
            return cls(kind="intervals", n=spec, edges=interval_edges(spec))
        if isinstance(spec, str):
            text = spec.strip()
            head, _, tail = text.partition(":")
            head = head.strip().lower()
            if head in ("intervals", "quantiles") and tail:
                try:
                    n = int(tail)
                except ValueError as exc:
                    raise ValueError(f"bins: '{spec}': the count after ':' must be an integer >= 1") from exc
                if n < 1:
                    raise ValueError(f"bins: '{spec}': the count after ':' must be an integer >= 1")
                if head == "intervals":
                    return cls(kind="intervals", n=n, edges=interval_edges(n))
                return cls(kind="quantiles", n=n, edges=None)
            body = tail if head == "edges" else text
            try:
                values = [float(x) for x in body.split(",") if x.strip()]
            except ValueError as exc:
                raise ValueError(
                    f"bins: cannot parse {spec!r}; use intervals:N, quantiles:N or comma-separated edges"
                ) from exc
            edges = validate_edges(values)
            return cls(kind="edges", n=len(edges) - 1, edges=edges)
        edges = validate_edges(spec)
        return cls(kind="edges", n=len(edges) - 1, edges=edges)

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
