"""What a counterfactual step's numbers are worth: whether it was an update at all, and how finely it was resolved.

**No update.** A step (an influence source, a Lopti stage, the full update, a compared rule, a sweep point, the lr -> 0
limit) is an update of the policy only if some token it trains on carries a policy-gradient weight:

    signal  <=>  exists t in the step's tokens with  A_t != 0  and  w_t = d pg_t / d log pi_t != 0

with pg_t the advantage term of the loss (`tokendyn.probe.objective.Objective`, its KL term to pi_ref and its entropy
bonus left out; the weight by autograd through the loss terms alone, `policy_signal`). The criterion is exact, with
no threshold, because the two cases it separates never meet: a token with A_t != 0 at the start of a step has
|w_t| = |A_t| / N up to the clip (N the loss's normaliser; a clipped token has w_t = 0 exactly), never a weight at
rounding level; without such a token the step moves only through the regularisers (in float64 steps typically
||dtheta|| ~ 1e-13: the KL gradient of a float32 pi_ref against a float64 pi, both of the same model), or not at all
(||dtheta|| = 0). Its delta pi is rounding or regulariser drift, and no learning rate changes that: zero times any lr
is zero. Such a step is **no update**: its records carry ``no_update`` true and null measurements (every delta pi
statistic, the ties, the correct ratios, ``step_rounding``, ``step_resolved``), it is counted (a ``notes`` record
per analysed batch, `tokendyn.effects.rebalance.analyze_update`) and no warning is raised for it. Another stack's
loss (a `TokenObjective`) is judged by its advantages alone (A_t != 0 on some token).

**Resolution** of a step that is an update: `Resolution` (step_rounding: the most that rounding theta + dtheta to the
parameters' dtype can take of the step); a step not resolved is flagged (``step_resolved`` false and a warning,
`warn_unresolved`) with the remedy that fits it: in the model's dtype, float64 steps or a larger lr; in float64, a
larger lr.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch

from tokendyn.probe.batch import ProbeBatch
from tokendyn.probe.objective import Objective
from tokendyn.probe.tokenloss import loss_terms

# a counterfactual step is resolved when rounding theta + delta theta to the parameters' dtype cannot take more than
# this fraction of it (`Resolution`); a number from a step that is not is flagged (step_resolved false, a warning)
STEP_ROUNDING_LIMIT = 1e-3


@dataclass(frozen=True)
class Resolution:
    """How finely a counterfactual step was resolved: ``step_norm`` = ||theta_after - theta_before|| (float64 sums),
    ``step_dtype`` the dtype the parameters held during the step, and

        step_rounding = n u (||theta_before|| + ||delta theta||) / ||delta theta||

    the largest fraction of the step that rounding the parameters to step_dtype could take (u its unit roundoff:
    each stored entry is within u |theta_i| of the exact theta_i + delta_i, ``n`` the steps stored between the two
    states; subnormals aside; 0 for a zero step that was no update, infinite for an update that rounding took
    whole; None, with step_norm and step_dtype, where no step was made: the lr -> 0 limit, `tokendyn.effects.limit`).
    ``resolved``: step_rounding <= `STEP_ROUNDING_LIMIT`. A float32 model at the paper's lr 1e-3 has steps of
    ||delta theta|| / ||theta|| ~ 1e-6 .. 1e-5 (a single bin's: less), so step_rounding of 1 % .. 10 % in float32
    and ~1e-10 in float64. ``no_update``: the step carried no policy-gradient signal (module docstring); its
    rounding is then not a question (null in the records, never warned about)."""

    step_norm: float | None
    step_dtype: str | None
    step_rounding: float | None
    no_update: bool = False

    @property
    def resolved(self) -> bool:
        return self.no_update or self.step_rounding is None or self.step_rounding <= STEP_ROUNDING_LIMIT

    def columns(self) -> dict[str, float | str | bool | None]:
        """The record's columns; step_rounding and step_resolved null for no update or no step (None)."""
        none = self.no_update or self.step_rounding is None
        return {
            "step_norm": self.step_norm,
            "step_dtype": self.step_dtype,
            "step_rounding": None if none else self.step_rounding,
            "step_resolved": None if none else self.resolved,
            "no_update": self.no_update,
        }


def resolution_columns(res: Resolution | None) -> dict[str, float | str | bool | None]:
    """A record's step_norm, step_dtype, step_rounding, step_resolved, no_update (all null without a
    `Resolution`: a real update)."""
    if res is None:
        return {
            "step_norm": None,
            "step_dtype": None,
            "step_rounding": None,
            "step_resolved": None,
            "no_update": None,
        }
    return res.columns()


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2 of a floating dtype (float32: 2^-24, bfloat16: 2^-8, float64: 2^-53)."""
    return float(torch.finfo(dtype).eps) / 2.0


def remedy(step_dtype: str) -> str:
    """What resolves a step of an update that is not resolved in ``step_dtype``: in the model's own dtype float64
    steps or a larger lr; in float64 only a larger lr."""
    if step_dtype == "float64":
        return "a larger step (--probe_lr) resolves it"
    return "float64 steps (--probe_step_precision float64) or a larger step (--probe_lr) resolve it"


class UnresolvedStepWarning(UserWarning):
    """A counterfactual step whose rounding bound exceeds `STEP_ROUNDING_LIMIT` (`warn_unresolved`)."""


def warn_unresolved(where: str, res: Resolution) -> None:
    """The loud flag of an update's step below the resolution (`Resolution`); nothing for a step that was no update
    (module docstring)."""
    if res.no_update or res.resolved:
        return
    lost = (
        "rounding took all of it"
        if res.step_rounding == float("inf")
        else f"rounding can take up to {100 * res.step_rounding:.3g} % of it"
    )
    warnings.warn(
        f"{where}: the counterfactual step (||dtheta|| = {res.step_norm:.3g}) is not resolved in "
        f"{res.step_dtype}: {lost} (limit {100 * STEP_ROUNDING_LIMIT:.3g} %); {remedy(res.step_dtype)}",
        UnresolvedStepWarning,
        stacklevel=3,
    )


def has_advantage(batch: ProbeBatch, mask: torch.Tensor | None = None) -> bool:
    """Whether some scored token of ``mask`` (None: every completion token) has A_t != 0."""
    m = batch.completion_mask & (batch.advantages.to(batch.completion_mask.device) != 0)
    if mask is not None:
        m = m & mask.to(m.device).bool()
    return bool(m.any())


def policy_signal(
    logp: torch.Tensor,
    batch: ProbeBatch,
    mask: torch.Tensor | None,
    objective,
    entropy: torch.Tensor | None = None,
) -> bool:
    """Whether a step on L_mask = sum_{t in mask} l_t carries a policy-gradient signal (module docstring): some token
    of ``mask`` with A_t != 0 and w_t = d (sum_{u in mask} pg_u) / d log pi_t != 0, the weights by autograd through
    the loss terms alone from ``logp`` (B, C) detached (no model pass), with the objective's KL term and entropy
    bonus off. ``entropy``: H_t, for an objective with an entropy mask. A `TokenObjective` (another stack's loss):
    A_t != 0 on some token of the mask."""
    if not has_advantage(batch, mask):
        return False
    objective = objective or Objective()
    if not isinstance(objective, Objective):
        return True
    step = batch.completion_mask.to(logp.device)
    if mask is not None:
        step = step & mask.to(logp.device).bool()
    keep = step & (batch.advantages.to(logp.device) != 0)
    lp = logp.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        terms = loss_terms(lp, batch, replace(objective, beta=0.0, entropy_coef=0.0), entropy)
        (w,) = torch.autograd.grad(terms[step].sum(), lp, allow_unused=True)
    return w is not None and bool((w[keep] != 0).any())
