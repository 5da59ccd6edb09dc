"""The equal-norm step size of the paired comparison (`tokendyn.effects.compare`): the lr search that brings a rule's
||dtheta|| to the target, and the warning for a rule that leaves the local regime."""

from __future__ import annotations

import math
import warnings

from tokendyn.effects.compare_optim import _set_lr
from tokendyn.effects.compare_rule import _apply

# equal_norm, several steps: after the first correction the lr is searched until ||dtheta|| is within this factor of
# the target, in at most NORM_PASSES passes in all (one pass: the rule's every step again from theta_0), each moving
# the lr by at most MAX_LOG_STEP in log
NORM_TOLERANCE, NORM_PASSES, MAX_LOG_STEP = 1.05, 8, math.log(10.0)


def _to_norm(update, batch, objective, stages, k, lr, achieved, target, theta0) -> float:
    """Redo the rule's steps from theta_0 at the lr that makes ||dtheta|| = ``target`` (``achieved`` at ``lr``: the
    steps just made), in place; returns that lr, the model left at its steps. Nothing to scale (``achieved`` or
    ``target`` not finite, ``achieved`` 0): the steps are kept as made. The first correction is lr T / achieved,
    exactly as before the search (a one-stage update at k = 1 scales so; Lopti's two stages at k = 1 land within 1e-4
    of T on SmolLM2-135M). While the norm is more than `NORM_TOLERANCE` off T (T > 0): the next lr is the secant of
    log ||dtheta|| over log lr through the last two finite passes (slope 1 with one; clamped to [1/4, 4] and a move of
    at most `MAX_LOG_STEP` until T is bracketed, then bisection in log lr where the secant leaves the bracket); a
    pass that is not finite bounds the bracket from above; a norm that falls as the lr grows, or a bracket the
    passes invert, ends the search. At most `NORM_PASSES` passes, then the best pass is made again if the last was
    not it. (k > 1 updates start where the first left the ratios, so the norm need not be linear in the lr: DPPO-TV
    at k = 3 on the tiny test model grows as lr^5 near T, and one correction ended at 0.0013 of it.) Stage 1's
    gradient at theta_0 is computed once (``update.last_gradient``)."""
    if not (math.isfinite(achieved) and achieved > 0 and math.isfinite(target)):
        return lr
    first = update.last_gradient  # stage 1 from theta_0 again: the same gradient

    def run(rate: float) -> float:
        update.load(update.initial())
        _set_lr(update, rate)
        _apply(update, batch, objective, stages, first=first, repeats=k)
        return update.relative_step() * theta0

    lr = lr * target / achieved
    achieved = run(lr)
    if not target > 0:
        return lr
    goal, tol = math.log(target), math.log(NORM_TOLERANCE)
    points: list[tuple[float, float]] = []  # (log lr, log ||dtheta||) of the finite passes
    # log lr of the largest finite pass short of T, and of the smallest beyond it (or not finite)
    below = above = None
    best: tuple[float, float] | None = None  # (|log ||dtheta|| - log T|, log lr)
    for _ in range(NORM_PASSES - 1):
        x = math.log(lr)
        if math.isfinite(achieved) and achieved > 0:
            y = math.log(achieved)
            if best is None or abs(y - goal) < best[0]:
                best = (abs(y - goal), x)
            if abs(y - goal) <= tol:
                return lr
            points.append((x, y))
            if y < goal:
                below = x if below is None else max(below, x)
            else:
                above = x if above is None else min(above, x)
        else:
            above = x if above is None else min(above, x)
        slope = None
        if len(points) > 1 and points[-1][0] != points[-2][0]:
            slope = (points[-1][1] - points[-2][1]) / (points[-1][0] - points[-2][0])
        if below is not None and above is not None:
            if not below < above:
                break  # (the passes invert the bracket: the norm is not monotone here)
            nxt = points[-1][0] + (goal - points[-1][1]) / slope if slope is not None and slope > 0 else None
            if nxt is None or not below < nxt < above:
                nxt = (below + above) / 2
        elif points and points[-1][0] == x:
            if slope is not None and slope <= 0:
                break  # (the norm falls as the lr grows)
            p = 1.0 if slope is None else min(max(slope, 0.25), 4.0)
            nxt = x + max(-MAX_LOG_STEP, min(MAX_LOG_STEP, (goal - points[-1][1]) / p))
        else:  # this pass was not finite and nothing is short of T yet: back off
            nxt = x - MAX_LOG_STEP
        lr = math.exp(nxt)
        achieved = run(lr)
    last = math.log(achieved) if math.isfinite(achieved) and achieved > 0 else None
    if last is not None and abs(last - goal) <= tol:
        return lr
    if best is not None and best[1] != math.log(lr) and (last is None or abs(last - goal) > best[0]):
        lr = math.exp(best[1])
        run(lr)
    return lr


class DivergedStepWarning(UserWarning):
    """A compared rule's update left the finite numbers, or (equal_norm) ended off the equal norm by more than
    `NORM_RATIO_RANGE` allows (`compare_rules`): its rows' measurements are null, `diverged`."""


# equal_norm: a rule whose ||dtheta|| is off the target by more than this factor after the lr corrections (`_to_norm`)
# left the local regime: its rows are not a comparison at equal norm
NORM_RATIO_RANGE = (0.5, 2.0)


def warn_diverged(rule: str, mode: str, lr: float | None, k: int, ratio: float | None) -> None:
    """The loud flag of a rule whose k updates made a parameter or a probability non-finite (``ratio`` None) or, in
    equal_norm mode (at ``lr``), ended off the equal norm by more than `NORM_RATIO_RANGE` allows after the lr
    search; the advice names what can change it (optimizer mode: the run's own optimizer made the steps)."""
    what = (
        "a parameter or a probability not finite"
        if ratio is None
        else f"its ||dtheta|| {ratio:.3g}x the equal norm after the lr search"
    )
    if mode == "optimizer":
        how = "a copy of the run's optimizer"
        fix = "fewer updates (--probe_compare_inner_steps) keep its steps local"
    else:
        how = f"SGD at lr {lr:.3g}" if lr is not None else "SGD"
        fix = (
            "the later updates start where the first left the ratios r = pi / pi_old: a smaller step "
            "(--probe_compare_lr) keeps them in the local regime"
            if k > 1
            else "a smaller step (--probe_compare_lr) keeps it in the local regime"
        )
    warnings.warn(
        f"compare (rule {rule}, mode {mode}): its {k} update(s) per stage ({how}) diverged ({what}): its rows' "
        f"measurements are null (paired column diverged); {fix}",
        DivergedStepWarning,
        stacklevel=3,
    )
