"""The update rules the paired comparison compares (`tokendyn.effects.compare`): each rule's objective, its
advantages and its stages on a batch."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tokendyn.effects.change import (
    InPlaceUpdate,
)
from tokendyn.probe.rules import SURROGATES
from tokendyn.probe.tokenloss import (
    PPO_FAMILY,
    Objective,
    ProbeBatch,
)
from tokendyn.remedies import logp_reweight_advantages, lopti_masks, w_reinforce_advantages
from tokendyn.vocab import COMPARE_RULES as RULES


@dataclass(frozen=True)
class Rule:
    """One update rule: its objective, Reweight's alpha (0: off), the Delta-log-p reweight's c (0: off),
    W-REINFORCE's lambda (None: the batch's advantages) and Lopti's eta (None: one stage); ``sweep``: the point
    (kind "c" / "eta", value) of the comparison's sweep it is (`tokendyn.effects.axis`), None for a named rule."""

    name: str
    objective: Objective
    alpha: float = 0.0
    eta: float | None = None
    order: str = "low_first"
    logp_c: float = 0.0
    w_lambda: float | None = None
    sweep: tuple[str, float] | None = None


# the rules that replace PPO's surrogate (`tokendyn.probe.rules`), compared by their registered defaults
SURROGATE_RULES = ("clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "aspo", "ce_gppo", "lp_reg")


def make_rule(
    name: str,
    base: Objective,
    *,
    alpha: float = 0.3,
    eta: float = 0.5,
    seed: int = 0,
    c: float = 0.1,
    lam: float = 0.1,
) -> Rule:
    """The rule ``name`` on top of the run's loss ``base``: reweight (A <- (alpha pi_old + 1 - alpha) A), lopti (two
    stages at eta, low first), reweight_lopti, logp_reweight (A <- (1 + c - c pi_old) A), w_reinforce (A = lam on
    reward 1, -1 on reward 0: needs batch.rewards), a rule replacing PPO's surrogate (`SURROGATE_RULES`:
    `Objective.policy_loss` with its registered defaults: clip_cov / kl_cov verl's, dppo_tv, dppo_kl, aspo, ce_gppo,
    lp_reg their authors'), 80_20 (top 20 % entropy tokens), gspo (sequence ratio, clip 3e-4 / 4e-4). Clip-Cov
    draws on a generator seeded with ``seed`` (never torch's global one: the comparison must not move the run's
    random stream). no_correction: the base loss without the sampler's importance weights (TRL's correction; the
    base must have it), so the comparison shows what the correction does to each bin. A rule the base loss cannot
    take raises ValueError naming it."""
    if name not in RULES:
        raise ValueError(f"compare: rule must be one of {', '.join(RULES)}, got {name!r}")
    if name == "no_correction":
        if not base.is_correction:
            raise ValueError(
                "compare: rule no_correction needs the sampler's importance-sampling correction in the run's loss "
                "(use_vllm with vllm_importance_sampling_correction), got a loss without it"
            )
        return Rule(name, replace(base, is_correction=False))
    if name in SURROGATE_RULES:
        needs_clip = SURROGATES[name].needs_clip
        if (
            base.loss_type not in PPO_FAMILY
            or base.importance_sampling_level != "token"
            or (needs_clip and base.eps_low is None)
        ):
            raise ValueError(
                f"compare: rule {name} needs a{' clipped' if needs_clip else ''} PPO-family base loss (loss_type one of "
                f"{', '.join(PPO_FAMILY)}, token ratios), got loss_type={base.loss_type!r}"
            )
        seed = base.cov_seed if base.cov_seed is not None else seed
        return Rule(name, replace(base, policy_loss=name, delta=None, entropy_coef=0.0, cov_seed=seed))
    if name == "80_20":
        return Rule(name, replace(base, top_entropy_quantile=0.2))
    if name == "gspo":
        return Rule(
            name,
            replace(
                base,
                importance_sampling_level="sequence",
                loss_type="grpo",
                eps_low=3e-4,
                eps_high=4e-4,
                delta=None,
            ),
        )
    if name == "logp_reweight":
        return Rule(name, base, logp_c=c)
    if name == "w_reinforce":
        return Rule(name, base, w_lambda=lam)
    return Rule(
        name,
        base,
        alpha=alpha if name in ("reweight", "reweight_lopti") else 0.0,
        eta=eta if name in ("lopti", "reweight_lopti") else None,
    )


def rule_batch(rule: Rule, batch: ProbeBatch) -> ProbeBatch:
    """The batch the rule trains on: W-REINFORCE's advantages from batch.rewards, then Reweight's A_t (alpha
    pi_old,t + 1 - alpha) or the Delta-log-p reweight's A_t (1 + c - c pi_old,t) (pi_old fixed)."""
    if rule.w_lambda is not None:
        if batch.rewards is None:
            raise ValueError(f"compare: rule {rule.name} needs the batch's rewards (ProbeBatch.rewards)")
        adv = w_reinforce_advantages(batch.rewards.to(torch.float64), rule.w_lambda)
        batch = replace(batch, advantages=adv.to(batch.advantages.device))
    if rule.alpha:
        weight = rule.alpha * torch.exp(batch.old_logp.to(torch.float64)) + 1.0 - rule.alpha
        batch = replace(batch, advantages=batch.advantages * weight.to(batch.advantages.device))
    if rule.logp_c:
        adv = logp_reweight_advantages(batch.advantages, batch.old_logp.to(torch.float64), rule.logp_c)
        batch = replace(batch, advantages=adv.to(batch.advantages.device))
    return batch


def rule_stages(rule: Rule, batch: ProbeBatch) -> list[torch.Tensor | None]:
    """The rule's update stages as token masks (None: every token): Lopti's two groups of pi_old, in its order."""
    if rule.eta is None:
        return [None]
    first, second = lopti_masks(batch.old_logp, batch.completion_mask, eta=rule.eta, order=rule.order)
    return [first, second]


def _apply(
    update: InPlaceUpdate,
    batch: ProbeBatch,
    objective: Objective,
    stages,
    *,
    first=None,
    keep=False,
    repeats=1,
):
    """The rule's stages, each ``repeats`` updates on the same batch (pi_old fixed), in place. ``keep``: the first
    update's gradient at theta_0 is kept in ``update.last_gradient``; ``first``: such a gradient from an earlier pass
    (that update's forward and backward skipped)."""
    update.objective = objective
    for i, mask in enumerate(stages):
        for j in range(repeats):
            if i == 0 and j == 0:
                update.step(batch, mask, gradient=first, keep_gradient=keep)
            else:
                update.step(batch, mask)
