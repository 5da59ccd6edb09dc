"""On-device accumulation of per-(point, bin) statistics, a log-spaced histogram, and a bounded token sample.

Everything is accumulated in float64 (float32 on devices without float64) whatever the training dtype; updates
use scatter ops only (no host synchronisation). Non-finite values are counted apart, never accumulated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

QUANTITIES = ("norm", "norm_per_w", "ratio")


def accumulation_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


@dataclass(frozen=True)
class LogHistogram:
    """Log-spaced cells: cell 0 = [0, 10^lo), cells 1..n = 10^(lo + (k-1)/per_decade) .. 10^(lo + k/per_decade),
    cell n+1 = [10^hi, inf), with n = (hi - lo) * per_decade."""

    lo: int = -10
    hi: int = 6
    per_decade: int = 4

    @property
    def n_cells(self) -> int:
        return (self.hi - self.lo) * self.per_decade + 2

    def cell(self, x: torch.Tensor) -> torch.Tensor:
        """Cell index of each non-negative value."""
        logx = torch.log10(x.clamp(min=1e-300))
        k = torch.floor((logx - self.lo) * self.per_decade).long() + 1
        k = k.clamp(0, self.n_cells - 1)
        return torch.where(x < 10.0**self.lo, torch.zeros_like(k), k)

    def bounds(self, k: int) -> tuple[float, float]:
        if k == 0:
            return 0.0, 10.0**self.lo
        if k == self.n_cells - 1:
            return 10.0**self.hi, math.inf
        return 10.0 ** (self.lo + (k - 1) / self.per_decade), 10.0 ** (self.lo + k / self.per_decade)


class BinStats:
    """count, sum, sum of squares, min, max and a histogram per (point, bin), for each quantity.

    Tensors are [n_points, n_bins] (histogram [n_points, n_bins, n_cells]); `update` may be called repeatedly.
    """

    def __init__(
        self,
        n_points: int,
        n_bins: int,
        device: torch.device | str = "cpu",
        quantities: tuple[str, ...] = QUANTITIES,
        hist: LogHistogram | None = None,
    ) -> None:
        self.n_points, self.n_bins = n_points, n_bins
        self.device = torch.device(device)
        self.dtype = accumulation_dtype(self.device)
        self.hist = hist or LogHistogram()
        size = n_points * n_bins
        self.data: dict[str, dict[str, torch.Tensor]] = {}

        def z() -> torch.Tensor:
            return torch.zeros(size + 1, dtype=self.dtype, device=self.device)

        for q in quantities:
            self.data[q] = {
                "count": z(),
                "sum": z(),
                "sumsq": z(),
                "min": torch.full((size + 1,), math.inf, dtype=self.dtype, device=self.device),
                "max": torch.full((size + 1,), -math.inf, dtype=self.dtype, device=self.device),
                "nonfinite": z(),
                "hist": torch.zeros(size * self.hist.n_cells + 1, dtype=self.dtype, device=self.device),
            }

    def update(self, quantity: str, values: torch.Tensor, bins: torch.Tensor, valid: torch.Tensor) -> None:
        """Add values [P, N] of tokens with bin index [N] where valid ([N] or [P, N]) is true."""
        d = self.data[quantity]
        v = values.to(self.dtype)
        if valid.dim() == 1:
            valid = valid.unsqueeze(0).expand_as(v)
        finite = torch.isfinite(v)
        ok = valid & finite
        size = self.n_points * self.n_bins
        point = torch.arange(self.n_points, device=v.device).unsqueeze(1)
        flat = point * self.n_bins + bins.to(v.device).unsqueeze(0)
        idx = torch.where(ok, flat, torch.full_like(flat, size)).reshape(-1)
        v0 = torch.where(ok, v, torch.zeros_like(v)).reshape(-1)
        d["count"].index_add_(0, idx, ok.reshape(-1).to(self.dtype))
        d["sum"].index_add_(0, idx, v0)
        d["sumsq"].index_add_(0, idx, v0 * v0)
        d["min"].scatter_reduce_(
            0, idx, torch.where(ok.reshape(-1), v0, torch.full_like(v0, math.inf)), "amin"
        )
        d["max"].scatter_reduce_(
            0, idx, torch.where(ok.reshape(-1), v0, torch.full_like(v0, -math.inf)), "amax"
        )
        bad = valid & ~finite
        idx_bad = torch.where(bad, flat, torch.full_like(flat, size)).reshape(-1)
        d["nonfinite"].index_add_(0, idx_bad, bad.reshape(-1).to(self.dtype))
        cells = self.hist.cell(v0.abs())
        hidx = torch.where(
            ok.reshape(-1), idx * self.hist.n_cells + cells, torch.full_like(idx, size * self.hist.n_cells)
        )
        d["hist"].index_add_(0, hidx, ok.reshape(-1).to(self.dtype))

    def summary(self, quantity: str) -> dict[str, torch.Tensor]:
        """CPU tensors [P, B] (count, sum, sumsq, min, max, nonfinite; min/max are NaN where count = 0) and the
        histogram [P, B, cells]."""
        d = self.data[quantity]
        shape = (self.n_points, self.n_bins)
        out = {
            k: d[k][:-1].reshape(shape).cpu() for k in ("count", "sum", "sumsq", "min", "max", "nonfinite")
        }
        empty = out["count"] == 0
        out["min"] = torch.where(empty, torch.full_like(out["min"], math.nan), out["min"])
        out["max"] = torch.where(empty, torch.full_like(out["max"], math.nan), out["max"])
        out["hist"] = d["hist"][:-1].reshape(*shape, self.hist.n_cells).cpu()
        return out


def bottom_k_sample(
    valid: torch.Tensor, k: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A uniform sample without replacement of up to k valid positions of a [B, C] mask, without host sync.

    Bottom-k reservoir: every position gets a uniform key (invalid ones get 2), the k smallest keys are kept
    (mergeable across micro-batches: keep the k smallest again). Returns (flat indices [k], selected-is-valid [k]),
    in random order.
    """
    n = valid.numel()
    k = max(0, min(int(k), n))
    keys = torch.rand(n, generator=generator, dtype=torch.float64).to(valid.device)
    keys = torch.where(valid.reshape(-1), keys, torch.full_like(keys, 2.0))
    sel_keys, idx = torch.topk(keys, k, largest=False, sorted=True)
    return idx, sel_keys < 2.0
