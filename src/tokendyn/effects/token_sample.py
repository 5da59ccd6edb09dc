"""The per-bin token sample of the per-token shares, and its `token_shares` record frame (schemas, files and the
writer are in `tokendyn.records`)."""

from __future__ import annotations

import polars as pl
import torch

from tokendyn.records import to_frame
from tokendyn.vocab import TRAIN


def sample_tokens(bins: torch.Tensor, per_bin: int, seed: int = 0) -> torch.Tensor:
    """Indices (n, 2) = (row, completion index) of at most ``per_bin`` tokens drawn uniformly without replacement
    from each bin (bins (B, C), -1 = padding, never drawn); sorted."""
    if not isinstance(per_bin, int) or per_bin < 0:
        raise ValueError(f"records: per_bin must be an integer >= 0, got {per_bin!r}")
    g = torch.Generator().manual_seed(int(seed))
    picked = []
    flat = bins.detach().cpu().flatten()
    for b in sorted(set(flat[flat >= 0].tolist())):
        idx = torch.nonzero(flat == b).flatten()
        picked.append(idx[torch.randperm(idx.numel(), generator=g)[:per_bin]])
    if not picked:
        return torch.zeros(0, 2, dtype=torch.long)
    flat_idx = torch.cat(picked).sort().values
    c = bins.size(1)
    return torch.stack([flat_idx // c, flat_idx % c], 1)


def token_shares_frame(
    shares: torch.Tensor,
    bins: torch.Tensor,
    edges: torch.Tensor,
    pi_old: torch.Tensor,
    advantages: torch.Tensor,
    completion_ids: torch.Tensor,
    *,
    step: int,
    stage: str = TRAIN,
    per_bin: int = 64,
    seed: int = 0,
    delta_pi: torch.Tensor | None = None,
) -> pl.DataFrame:
    """The `token_shares` record: a per-bin sample (`sample_tokens`) of the per-token shares s_t (all (B, C))."""
    idx = sample_tokens(bins, per_bin, seed)
    r, j = idx[:, 0], idx[:, 1]

    def take(x: torch.Tensor) -> list:
        return x.detach().cpu()[r, j].tolist()

    b = take(bins)
    cols = {
        "step": [step] * len(b),
        "stage": [stage] * len(b),
        "row": r.tolist(),
        "pos": j.tolist(),
        "token_id": take(completion_ids),
        "bin": b,
        "bin_lo": [float(edges[x]) for x in b],
        "bin_hi": [float(edges[x + 1]) for x in b],
        "pi_old": take(pi_old.to(torch.float64)),
        "advantage": take(advantages.to(torch.float64)),
        "share": take(shares.to(torch.float64)),
        "delta_pi": take(delta_pi.to(torch.float64)) if delta_pi is not None else [None] * len(b),
    }
    return to_frame("token_shares", cols)
