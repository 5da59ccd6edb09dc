"""The distribution of delta pi over a set of tokens, the correct ratios, and the `prob_change` record of one delta
pi (`tokendyn.effects.change`)."""

from __future__ import annotations

import torch

from tokendyn.effects.resolution import (
    Resolution,
    resolution_columns,
)
from tokendyn.probe.bins import bin_bounds
from tokendyn.probe.tokenloss import (
    ProbeBatch,
)
from tokendyn.records import to_frame
from tokendyn.vocab import TRAIN

QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)


def correct_ratios(
    delta: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> dict[str, float | int]:
    """Correct ratios on the tokens of ``mask``, ties apart (docs/definitions.md):

        n_pos = #(A > 0), tie_pos = #(A > 0, dpi = 0),  correct_pos = #(A > 0, dpi > 0) / (n_pos - tie_pos)
        n_neg = #(A < 0), tie_neg = #(A < 0, dpi = 0),  correct_neg = #(A < 0, dpi < 0) / (n_neg - tie_neg)
        correct_pooled = (both numerators) / (both denominators)

    A tie (no change at the measurement's float64 resolution) is neither correct nor wrong. NaN for 0/0; tokens
    with A = 0 are in neither sign."""
    m = mask.bool()
    a, d = advantages.to(delta.device)[m], delta[m]
    pos, neg = a > 0, a < 0
    n_pos, n_neg = int(pos.sum()), int(neg.sum())
    tie_pos, tie_neg = int((pos & (d == 0)).sum()), int((neg & (d == 0)).sum())
    up, down = int((pos & (d > 0)).sum()), int((neg & (d < 0)).sum())

    def ratio(num: int, den: int) -> float:
        return num / den if den else float("nan")

    return {
        "n_pos": n_pos,
        "n_neg": n_neg,
        "tie_pos": tie_pos,
        "tie_neg": tie_neg,
        "correct_pos": ratio(up, n_pos - tie_pos),
        "correct_neg": ratio(down, n_neg - tie_neg),
        "correct_pooled": ratio(up + down, n_pos + n_neg - tie_pos - tie_neg),
    }


def delta_summary(
    delta: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> dict[str, float | int]:
    """Distribution of delta pi over the tokens of ``mask``: count, mean, std, mean_abs, min, q01 .. q99, max, and
    the correct ratios (`correct_ratios`). NaN where there is no token."""
    x = delta[mask.bool()].to(torch.float64)
    n = int(x.numel())
    nan = float("nan")
    out: dict[str, float | int] = {"count": n}
    out["mean"] = float(x.mean()) if n else nan
    out["std"] = float(x.std(unbiased=False)) if n else nan
    out["mean_abs"] = float(x.abs().mean()) if n else nan
    out["min"] = float(x.min()) if n else nan
    qs = torch.quantile(x, torch.tensor(QUANTILES, dtype=torch.float64)) if n else None
    for i, q in enumerate(QUANTILES):
        out[f"q{round(q * 100):02d}"] = float(qs[i]) if n else nan
    out["max"] = float(x.max()) if n else nan
    out.update(correct_ratios(delta, advantages, mask))
    return out


def null_summary() -> dict[str, None]:
    """`delta_summary`'s keys, every value null: the record of a step that was no update
    (`tokendyn.effects.resolution`), whose delta pi is no measurement."""
    keys = ("count", "mean", "std", "mean_abs", "min", *(f"q{round(q * 100):02d}" for q in QUANTILES), "max")
    keys += ("n_pos", "n_neg", "tie_pos", "tie_neg", "correct_pos", "correct_neg", "correct_pooled")
    return dict.fromkeys(keys)


def change_frame(
    delta: torch.Tensor,
    batch: ProbeBatch,
    bins: torch.Tensor,
    edges: torch.Tensor,
    *,
    step: int,
    stage: str = "train",
    update: str = "counterfactual",
    update_stage: str = TRAIN,
    source_bin: int = -1,
    lr: float | None = None,
    param_step: float | None = None,
    resolution: Resolution | None = None,
    limit: bool = False,
):
    """The `prob_change` record of one delta pi: one row per bin of pi_old (``bins``: (B, C), -1 on padding) and
    one for all tokens (bin -1). ``update``: "counterfactual", "sweep" (the counterfactual step at another step size,
    `tokendyn.effects.rebalance.RebalanceOptions.lr_sweep`) or "real"; ``update_stage``: "train", "low", "high",
    "lopti" (`tokendyn.vocab`); ``source_bin``: the bin the update was restricted to (-1: all tokens); ``param_step``: the update's
    ||delta theta|| / ||theta||; ``resolution``: how finely a counterfactual step was resolved (`Resolution`; null
    for a real update); a step that was no update has null statistics (`null_summary`). ``limit``: ``delta`` is the
    lr -> 0 limit of the step, d pi / d lr at lr = 0 (`tokendyn.effects.limit`; its rows have lr 0 and update
    "sweep")."""

    rows = []
    k = edges.numel() - 1
    for b in [-1, *range(k)]:
        mask = batch.completion_mask if b < 0 else (bins == b)
        lo, hi = bin_bounds(edges, b)
        row = {
            "step": step,
            "stage": stage,
            "update": update,
            "update_stage": update_stage,
            "source_bin": source_bin,
            "bin": b,
            "bin_lo": lo,
            "bin_hi": hi,
            "lr": lr,
            "param_step": param_step,
            **resolution_columns(resolution),
            "limit": limit,
        }
        none = resolution is not None and resolution.no_update
        row.update(null_summary() if none else delta_summary(delta, batch.advantages, mask))
        rows.append(row)
    return to_frame("prob_change", {c: [r[c] for r in rows] for c in rows[0]})
