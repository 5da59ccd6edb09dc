"""The paired comparison's record (`paired`): per (rule, mode, sequence, bin of pi_old), sums over the tokens, so
that rows add up over sequences and steps (`tokendyn.analysis.paired` bootstraps over (step, sequence))."""

from __future__ import annotations

import math

import torch

from tokendyn.effects.change import resolution_columns
from tokendyn.probe.bins import bin_bounds
from tokendyn.probe.tokenloss import ProbeBatch, bin_index
from tokendyn.records import to_frame


def paired_frame(
    results: dict,
    batch: ProbeBatch,
    pi_old: torch.Tensor,
    edges: torch.Tensor,
    *,
    step: int,
    reference: str = "base",
):
    """The `paired` record: one row per (rule, mode, sequence, bin of pi_old) with sums over that sequence's tokens
    of the bin: count, the signs of A, correct / tie counts of dpi, sum dpi, sum dpi(reference), sum of the paired
    difference and its square, the sum of the update shares, the entropy change and the KL to the reference rule's
    updated policy (null unless measured, `tokendyn.effects.axis`); the rule's lr, ||dtheta|| / ||theta||, norm
    ratio, inner updates k, and its sweep point (sweep "c" / "eta" and its value; null for a plain rule). A rule whose
    update was no update (no policy-gradient signal, `tokendyn.effects.resolution`) or diverged (a parameter or a
    probability not finite, `tokendyn.effects.compare.warn_diverged`) has its measured columns null, and so has every
    rule's paired difference when the reference rule's was."""
    mask = batch.completion_mask
    bins = bin_index(pi_old.to(mask.device), mask, edges)
    adv = batch.advantages.to(mask.device)
    rows: dict[str, list] = {}
    k = edges.numel() - 1
    for (rule, mode), res in results.items():
        ref = results.get((reference, mode))
        d = res.delta.to(mask.device)
        d_ref = ref.delta.to(mask.device) if ref is not None else torch.zeros_like(d)
        s = res.shares.to(mask.device) if res.shares is not None else None
        dh = res.entropy.to(mask.device) if res.entropy is not None else None
        kl = res.kl.to(mask.device) if res.kl is not None else None
        sweep, value = res.sweep if res.sweep is not None else (None, None)
        none, ref_none = (
            _no_update(res) or res.diverged,
            ref is not None and (_no_update(ref) or ref.diverged),
        )
        for i in range(mask.size(0)):
            for b in range(k):
                m = bins[i] == b
                n = int(m.sum())
                if n == 0:
                    continue
                a, x, diff = adv[i][m], d[i][m], (d[i] - d_ref[i])[m]
                lo, hi = bin_bounds(edges, b)
                values = {
                    "step": step,
                    "rule": rule,
                    "mode": mode,
                    "seq": i,
                    "bin": b,
                    "bin_lo": lo,
                    "bin_hi": hi,
                    "count": n,
                    "n_pos": int((a > 0).sum()),
                    "n_neg": int((a < 0).sum()),
                    "up_pos": int(((a > 0) & (x > 0)).sum()),
                    "down_neg": int(((a < 0) & (x < 0)).sum()),
                    "tie_pos": int(((a > 0) & (x == 0)).sum()),
                    "tie_neg": int(((a < 0) & (x == 0)).sum()),
                    "sum_dpi": float(x.sum()),
                    "sum_dpi_ref": float(d_ref[i][m].sum()),
                    "sum_diff": float(diff.sum()),
                    "sum_diff2": float((diff * diff).sum()),
                    "sum_share": float(s[i][m].sum()) if s is not None else None,
                    "sum_dentropy": float(dh[i][m].sum()) if dh is not None else None,
                    "sum_kl_ref": float(kl[i][m].sum()) if kl is not None else None,
                    "inner_steps": res.inner_steps,
                    "sweep": sweep,
                    "sweep_value": value,
                    "lr": res.lr,
                    "param_step": res.param_step,
                    "norm_ratio": res.norm_ratio,
                    "diverged": res.diverged,
                    **resolution_columns(res.resolution),
                }
                # (a diverged rule's, or one with no norm to match)
                for c in ("lr", "param_step", "norm_ratio"):
                    if values[c] is not None and not math.isfinite(values[c]):
                        values[c] = None
                if ref is not None and ref.diverged:
                    values["sum_kl_ref"] = None  # (to a policy that is not finite)
                if none:
                    values.update(dict.fromkeys(_MEASURED))
                if none or ref_none:
                    values.update(dict.fromkeys(_PAIRED))
                for c, v in values.items():
                    rows.setdefault(c, []).append(v)
    return to_frame("paired", rows)


# the columns of a row that measure the rule's update, and those that pair it with the reference rule's
_MEASURED = ("count", "n_pos", "n_neg", "up_pos", "down_neg", "tie_pos", "tie_neg", "sum_dpi", "sum_share",
             "sum_dentropy", "sum_kl_ref")  # fmt: skip
_PAIRED = ("sum_dpi_ref", "sum_diff", "sum_diff2")


def _no_update(res) -> bool:
    return res.resolution is not None and res.resolution.no_update
