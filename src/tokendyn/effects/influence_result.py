"""What the influence run (`tokendyn.effects.influence`) returns: delta pi per (update stage, source bin) with its
records (`InfluenceResult`), and the gradient of a union of source bins it keeps (`SourceSum`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokendyn.effects.change import (
    ChangeResult,
    Resolution,
    delta_summary,
    null_summary,
    resolution_columns,
)
from tokendyn.probe.bins import bin_bounds
from tokendyn.probe.tokenloss import ProbeBatch
from tokendyn.records import to_frame
from tokendyn.vocab import TRAIN


@dataclass(frozen=True)
class SourceSum:
    """The gradient at theta_0 of L_S = sum_{t in S} l_t for S a union of source bins (`influence_and_shares`'
    ``keep``): ``gradient`` name -> tensor (the steps' own, float64 under float64 steps), S as a (B, C) token mask,
    ``signal``: whether a token of S carried a policy-gradient signal (`tokendyn.effects.resolution`)."""

    gradient: dict[str, torch.Tensor]
    mask: torch.Tensor
    signal: bool


@dataclass
class InfluenceResult:
    """delta pi (B, C) per (update_stage, source bin); bins (B, C) over pi_old, -1 on padding; per (update_stage,
    source bin) how finely its step was resolved (`tokendyn.effects.change.Resolution`); pi at theta_0 (B, C) as
    the deltas were measured from it (in the update's precision). ``change``: the all-token sources' update (source
    -1 of every update stage, in order) as `tokendyn.effects.change.counterfactual_change` reports the same update
    from the same state (its stages' pi after, delta pi, loss, ||delta theta|| / ||theta_0||, resolution, and with
    two stages "lopti": after the last stage minus theta_0's pi), so that a caller asking for that update again
    (the lr sweep's point at the same lr) need not make it."""

    edges: torch.Tensor
    bins: torch.Tensor
    batch: ProbeBatch
    deltas: dict[tuple[str, int], torch.Tensor]
    source_counts: dict[tuple[str, int], int]
    lr: float | None
    resolution: dict[tuple[str, int], Resolution] | None = None
    pi0: torch.Tensor | None = None
    change: ChangeResult | None = None
    # `influence_and_shares`' ``keep``: the sum of those sources' gradients at theta_0 (name -> tensor, in the steps'
    # precision), its token mask (B, C) and whether a policy-gradient signal was in it
    kept: SourceSum | None = None

    def matrix(self, update_stage: str = TRAIN, quantity: str = "mean_abs") -> torch.Tensor:
        """M[source, target] as a (K + 1, K) tensor; row 0 is source = all tokens, row b + 1 source bin b; NaN
        where a source has no tokens or was no update (`no_update`). quantity: mean_abs, mean, correct_pos,
        correct_neg, correct_pooled."""
        k = self.edges.numel() - 1
        out = torch.full((k + 1, k), float("nan"), dtype=torch.float64)
        for (ustage, src), delta in self.deltas.items():
            if ustage != update_stage or self.no_update(ustage, src):
                continue
            for tgt in range(k):
                out[src + 1, tgt] = delta_summary(delta, self.batch.advantages, self.bins == tgt)[quantity]
        return out

    def no_update(self, update_stage: str, source: int) -> bool:
        """Whether that source's step carried no policy-gradient signal (`tokendyn.effects.resolution`)."""
        res = (self.resolution or {}).get((update_stage, source))
        return res is not None and res.no_update

    def to_frame(self, step: int, stage: str = "train"):
        """The `influence` record: one row per (update_stage, source bin, target bin); bin -1 is all tokens. A source
        that was no update has null statistics (`tokendyn.effects.change.null_summary`) and no_update true."""

        e = self.edges
        k = e.numel() - 1
        rows = []
        for (ustage, src), delta in self.deltas.items():
            s_lo, s_hi = bin_bounds(e, src)
            for tgt in [-1, *range(k)]:
                mask = self.batch.completion_mask if tgt < 0 else (self.bins == tgt)
                t_lo, t_hi = bin_bounds(e, tgt)
                row = {
                    "step": step,
                    "stage": stage,
                    "update_stage": ustage,
                    "source_bin": src,
                    "source_lo": s_lo,
                    "source_hi": s_hi,
                    "source_count": self.source_counts[(ustage, src)],
                    "target_bin": tgt,
                    "target_lo": t_lo,
                    "target_hi": t_hi,
                    "lr": self.lr,
                    **resolution_columns((self.resolution or {}).get((ustage, src))),
                }
                none = self.no_update(ustage, src)
                row.update(null_summary() if none else delta_summary(delta, self.batch.advantages, mask))
                rows.append(row)
        return to_frame("influence", {c: [r[c] for r in rows] for c in rows[0]})
