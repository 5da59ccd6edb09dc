"""What the paired comparison (`tokendyn.effects.compare`) takes from the analyses' own steps: the full
counterfactual step (`FullUpdate`), reused as the base rule's, and a Lopti rule's first-stage gradient from the
influence sources."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokendyn.effects.change import (
    HostSnapshot,
    InPlaceUpdate,
)
from tokendyn.effects.compare_rule import Rule
from tokendyn.effects.influence import SourceSum
from tokendyn.effects.shares import same_forward
from tokendyn.probe.parallel import local
from tokendyn.probe.tokenloss import (
    Objective,
    ProbeBatch,
)


@dataclass(frozen=True)
class FullUpdate:
    """The analyses' full counterfactual step of one batch (plain SGD at ``lr`` on the whole loss from theta_0,
    pi_old fixed: `tokendyn.effects.rebalance.analyze_update`), which is also the base rule's equal_norm update:
    the batch with pi_old fixed, pi at theta_0 (B, C) float64, dpi of every token after the step (B, C) float64,
    ||g|| (float64) and the per-token shares s_t = <grad l_t, g> / ||g||^2 (B, C); ``signal``: whether the step
    carried a policy-gradient signal (else it was no update, `tokendyn.effects.resolution`); ``first_stage``: the
    gradient of a Lopti rule's first stage at theta_0, from the influence matrix's sources (`given_first_stage`),
    or None; ``precision``: the step precision that made it (`reuses` only in the same)."""

    batch: ProbeBatch
    objective: Objective
    lr: float
    pi0: torch.Tensor
    delta: torch.Tensor
    grad_norm: float
    shares: torch.Tensor | None
    signal: bool = True
    first_stage: SourceSum | None = None
    precision: str | None = (
        None  # the steps' precision it was made in (None: not said; `reuses` then trusts it)
    )


def reuses(full: FullUpdate, rule: Rule, batch: ProbeBatch, lr: float) -> bool:
    """Whether ``full`` is ``rule``'s equal_norm update on ``batch`` at ``lr``: one stage, no Reweight, the same
    objective, the same completions, mask and advantages, the same lr."""
    b = full.batch
    same_rule = (
        rule.eta is None
        and not rule.alpha
        and not rule.logp_c
        and rule.w_lambda is None
        and rule.objective == full.objective
    )
    if not (same_rule and float(lr) == float(full.lr) and full.grad_norm > 0):
        return False
    # (pi_old None: fixed by the analyses)
    return _same_batch(b, batch) and (batch.old_logp is None or _same(b.old_logp, batch.old_logp))


def _same_batch(a: ProbeBatch, b: ProbeBatch) -> bool:
    """The same forward (`same_forward`), advantages, sampling terms and normalizer (pi_old apart)."""
    if a.normalizer != b.normalizer or not same_forward(a, b):
        return False
    return all(
        _same(getattr(a, n), getattr(b, n)) for n in ("advantages", "ref_logp", "sampling_logp", "is_ratio")
    )


def given_first_stage(
    full: FullUpdate | None, rule: Rule, batch: ProbeBatch, stages: list, update: InPlaceUpdate
) -> HostSnapshot | None:
    """The analyses' gradient of the rule's first stage at theta_0 (``full.first_stage``: a sum of the influence
    matrix's sources, `tokendyn.effects.influence.influence_and_shares`), when it is that gradient: the same
    objective, the same batch and pi_old, the stage's token mask exactly the sources' union, every tensor the
    shape and dtype of the parameter it steps (the same step precision); else None (the rule makes it)."""
    given = full.first_stage if full is not None else None
    if given is None or stages[0] is None or rule.objective != full.objective:
        return None
    if not (_same_batch(full.batch, batch) and _same(full.batch.old_logp, batch.old_logp)):
        return None
    if not torch.equal(given.mask.to(stages[0].device), stages[0].bool() & batch.completion_mask.bool()):
        return None
    params = {n: local(p) for n, p in update.params.items()}
    if given.gradient.keys() != params.keys() or any(
        (g.shape, g.dtype, g.device) != (params[n].shape, params[n].dtype, params[n].device)
        for n, g in given.gradient.items()
    ):
        return None
    snap = HostSnapshot.borrowed(given.gradient)
    snap.signal = given.signal
    return snap


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.equal(a, b.to(a.device))
