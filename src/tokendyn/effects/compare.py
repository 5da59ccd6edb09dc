"""Paired counterfactual comparison: what each update rule would do, from the same state, to each group of tokens.

At one parameter state theta_0, on one batch with pi_old fixed, every rule r of `RULES` makes its update (its
loss, its advantages, its stages), in place and undone exactly (`tokendyn.effects.change.InPlaceUpdate`), and the
probability change of every sampled token is measured in float64::

    dpi_t(r) = pi_t(theta_r) - pi_t(theta_0),        paired difference  dpi_t(r) - dpi_t(base)

Two step sizes (``modes``):

* ``equal_norm``: plain SGD at the norm of the base rule's step at the paper's lr:  T = lr ||g_base||, and every
  rule's update has ||theta_r - theta_0|| = T (a one-stage rule: lr_r = T / ||g_r||, exact, `NormalizedSGD`; Lopti's
  two stages: one lr for both, lr first, then corrected by T / ||achieved|| and, while more than 5 % off, by a secant
  search in log lr, the achieved norm recorded), so no rule is credited for a smaller step.
* ``optimizer``: one step of a copy of the run's optimizer (its state and learning rate, e.g. AdamW's moments) per
  stage; the run's optimizer itself is never touched.

``inner_steps`` k (default 1): each stage of each rule takes k updates on the same batch, pi_old fixed at theta_0, as
TRL's ``num_iterations`` does, so from the second update on r_t != 1 and the ratio-based rules (DPPO, ASPO, CE-GPPO,
clip-higher, CISPO), which at r = 1 are GRPO exactly, act. With k > 1 every rule's steps in equal_norm mode are plain
SGD at one lr, searched (`_to_norm`) so that its total displacement ||theta_r - theta_0|| equals the first rule's at lr
within 5 % (the achieved ratio recorded, as for Lopti). A rule whose steps leave the finite numbers, or whose norm the
search cannot bring within 2x of the target, is `diverged`: warned, its rows null. On a real LLM the paper's lr 1e-3
is far outside the local regime at k > 1 (SmolLM2-135M: the second update's loss 230x the first's, then NaN): give
the comparison a smaller lr (``--probe_compare_lr``, e.g. 1e-4 there, where every rule landed within 3 % at once).

Sweeps (`tokendyn.effects.axis`): the Reweight / Delta-log-p family as one parameter c (A_t <- (1 + c (1 - pi_old,t))
A_t; c = -alpha is the Reweight rule, c = 0 the base rule) and Lopti's eta, each value a rule of its own from the same
state; with them every rule's entropy change and KL to the first rule's updated policy are measured too.

Per rule: the update share of each token, s_t = <grad l_t(r), dtheta_r> / <grad L(r), dtheta_r> (its part of the
first-order change of the rule's loss along the rule's own update, summing to 1; one JVP of the per-token loss at
theta_0, two rules' in one batched forward-mode pass, `tokendyn.effects.shares.token_shares_many`). Records:
`paired`, one row per (rule, mode, sequence, bin), sums that add up over sequences and steps, so intervals can be
bootstrapped over (step, sequence) (`tokendyn.analysis.paired`).

Cost per rule (equal_norm): one forward and backward per stage for the step (Lopti: its second stage twice, for the
norm correction, and once more per further pass of the norm search where the first correction lands > 5 % off;
its first stage's gradient at theta_0 is kept in host memory and reused, or taken from the analyses' influence
sources when they kept it, `given_first_stage`: then its first pass is one forward and backward), one forward for
pi, one JVP for the shares (batched by two: the primal forward once per pair). The base rule's equal_norm step is
the analyses' own full counterfactual step (plain SGD at lr on the whole loss): handed over as a `FullUpdate`, it
costs nothing more. Memory: that of `InPlaceUpdate` (host snapshot, one gradient, the optimizer copy's state in
optimizer mode; Lopti: one gradient more in host memory) plus `JVP_BATCH` (2) parameter-sized displacements for the
shares' JVPs (``shares=False`` drops them).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from tokendyn.effects.change import (
    HostSnapshot,
    InPlaceUpdate,
    Resolution,
    fix_pi_old,
    swaps_steps,
    warn_unresolved,
)
from tokendyn.effects.compare_optim import NormalizedSGD, _set_lr, optimizer_copy
from tokendyn.effects.distributions import measure
from tokendyn.effects.influence import SourceSum
from tokendyn.effects.paired_records import paired_frame
from tokendyn.effects.shares import dot64, same_forward, token_shares_many
from tokendyn.probe.forward import completion_proxy_logp
from tokendyn.probe.parallel import is_fully_sharded, local
from tokendyn.probe.rules import SURROGATES
from tokendyn.probe.tokenloss import (
    PPO_FAMILY,
    Objective,
    ProbeBatch,
    analysis_forward,
)
from tokendyn.remedies import logp_reweight_advantages, lopti_masks, w_reinforce_advantages
from tokendyn.vocab import COMPARE_MODES, COMPARE_RULES, FLOAT64, FLOAT64_STEP

RULES, MODES = COMPARE_RULES, COMPARE_MODES
__all__ = [
    "NormalizedSGD",
    "optimizer_copy",
    "paired_frame",
]  # (re-exported: their homes are compare_optim, paired_records)


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


@dataclass
class RuleResult:
    """One rule in one mode: dpi (B, C) float64, the update shares s_t (B, C), ||dtheta|| / ||theta_0||, the lr,
    the achieved norm over the target (equal_norm; 1 for one-stage rules), and how finely the step was resolved
    (`tokendyn.effects.change.Resolution`); with ``distributions``: the entropy change dH_t and the KL to the first
    rule's updated policy (B, C) float64 (`tokendyn.effects.axis.measure`); k inner updates; the rule's sweep point;
    ``diverged``: its updates made a parameter or a probability non-finite, or (equal_norm) ended off the equal norm
    by more than `NORM_RATIO_RANGE` allows (`warn_diverged`; its rows null)."""

    delta: torch.Tensor
    shares: torch.Tensor | None
    param_step: float
    lr: float | None
    norm_ratio: float | None
    resolution: Resolution | None = None
    entropy: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    inner_steps: int = 1
    sweep: tuple[str, float] | None = None
    # non-finite, or off the equal norm (`NORM_RATIO_RANGE`): every measured column null
    diverged: bool = False


@analysis_forward
def compare_rules(
    model: nn.Module,
    batch: ProbeBatch,
    rules: Sequence[Rule],
    *,
    modes: Sequence[str] = ("equal_norm",),
    lr: float = 1e-3,
    optimizer: torch.optim.Optimizer | None = None,
    shares: bool = True,
    full: FullUpdate | None = None,
    precision: str = "float64",
    inner_steps: int = 1,
    distributions: bool | None = None,
) -> dict[tuple[str, str], RuleResult]:
    """(rule name, mode) -> `RuleResult`, every rule from the same theta_0 and pi_old (module docstring). The model's
    parameters (bitwise), ``.grad`` and ``optimizer`` (and its state) are left as they were. The first rule is
    the reference of the paired differences and of equal_norm's target (usually "base").

    ``full``: the analyses' full counterfactual update of this batch (`tokendyn.effects.rebalance.analyze_update`).
    When it is the first rule's equal_norm update (`reuses`: one stage, no Reweight, the same objective, advantages
    and lr), that rule's result is taken from it instead of being recomputed: its dpi, ||g|| (so the target
    T = lr ||g||), its shares (the analyses' s_t along g, over their sum) and ||dtheta|| / ||theta_0|| = lr ||g|| /
    ||theta_0||; and pi at theta_0 is the analyses' (no forward; it must then have been measured in the same
    ``precision``). ``precision``: the steps' (`tokendyn.effects.change.InPlaceUpdate`), float64 by default
    ("float64_step", a check step's analyses', is made "float64": the rules' entropy and KL are read off the model;
    on an FSDP2-sharded model both are "model").
    ``inner_steps``: k updates per stage on the same batch (module docstring; ``full`` is reused only at k = 1). A
    rule reading Lp-Reg's proxy gets it from theta_0 (`completion_proxy_logp`) when the batch has none.
    ``distributions`` (default: on when a rule is a sweep point): each rule's entropy change and KL to the first
    rule's updated policy (`tokendyn.effects.axis`; then ``full`` is not reused: the first rule's update is made here,
    its distribution kept in host memory)."""
    if isinstance(inner_steps, bool) or not isinstance(inner_steps, int) or inner_steps < 1:
        raise ValueError(f"compare: inner_steps must be an integer >= 1, got {inner_steps!r}")
    # the rules' distributions are read off the model itself: every op in float64
    if precision == FLOAT64_STEP:
        precision = FLOAT64
    if precision == FLOAT64 and is_fully_sharded(model):  # (FSDP2: no float64 backward; the distributions are
        precision = "model"  # read off the model in its own dtype, in which its shards step)
    k = inner_steps
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"compare: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if "optimizer" in modes and optimizer is None:
        raise ValueError("compare: mode 'optimizer' needs the run's optimizer")
    dist = any(r.sweep is not None for r in rules) if distributions is None else bool(distributions)
    same = full is not None and full.precision in (None, precision)  # (a check's float64_step: made again)
    reuse = not dist and same and bool(rules) and k == 1 and reuses(full, rules[0], batch, lr)
    if reuse:
        batch, pi0 = full.batch, full.pi0
    else:
        batch, pi0 = fix_pi_old(model, batch, precision=precision)
    proxy = next((r.objective for r in rules if r.objective.needs_proxy), None)
    if proxy is not None and batch.proxy_logp is None:
        batch = replace(batch, proxy_logp=completion_proxy_logp(model, batch, proxy.lp_reg_kappa))
    mask = batch.completion_mask
    out: dict[tuple[str, str], RuleResult] = {}
    for mode in modes:
        if mode == "equal_norm":
            factory = lambda params: NormalizedSGD(params, model, lr)  # noqa: E731
        else:
            factory = optimizer_copy(optimizer)
        with InPlaceUpdate(model, factory, precision=precision) as update:
            if not reuse:
                pi0 = update.pi_start(batch, pi0)
            theta0 = update.start_norm2**0.5
            target = None
            start = measure(model, batch) if dist else None  # H at theta_0
            reference = None  # the first rule's updated log-softmax (KL)
            pending = _Shares(JVP_BATCH if swaps_steps(model) else 1)
            for i, rule in enumerate(rules):
                if reuse and i == 0 and mode == "equal_norm":
                    target = lr * full.grad_norm
                    total = float(full.shares.sum()) if full.shares is not None else 0.0
                    out[(rule.name, mode)] = RuleResult(
                        full.delta,
                        full.shares / total if shares and total != 0 else None,
                        target / theta0 if theta0 > 0 else float("nan"),
                        lr,
                        1.0,
                        update.resolution(target, signal=full.signal),
                        sweep=rule.sweep,
                    )
                    continue
                rb, stages = rule_batch(rule, batch), rule_stages(rule, batch)
                step_lr, ratio = None, None
                given = given_first_stage(full, rule, rb, stages, update) if len(stages) > 1 else None
                if mode == "optimizer":
                    _apply(update, rb, rule.objective, stages, first=given, repeats=k)
                elif (
                    len(stages) == 1 and k == 1
                ):  # one step of norm `target` (the first rule's at lr sets it)
                    opt = update.optimizer
                    # (the first rule diverged: no norm to match, a plain step at lr)
                    plain = target is not None and not math.isfinite(target)
                    opt.target, opt.norm_lr = None if plain else target, lr if target is None else None
                    _apply(update, rb, rule.objective, stages)
                    norm, opt.norm_lr = opt.grad_norm, None
                    if not plain:
                        target = opt.target
                    step_lr = lr if plain else (target / norm if norm > 0 else 0.0)
                else:  # several steps (Lopti's stages, k > 1) at one lr: plain SGD at lr, its lr corrected to the target
                    update.optimizer.target = None
                    _set_lr(update, lr)
                    _apply(update, rb, rule.objective, stages, first=given, keep=given is None, repeats=k)
                    if (
                        given is not None
                    ):  # (stage 1 from theta_0 again in the norm search: the same gradient)
                        update.last_gradient = given
                    achieved = update.relative_step() * theta0
                    step_lr = lr
                    if target is None:
                        target = achieved
                    else:
                        step_lr = _to_norm(
                            update, rb, rule.objective, stages, k, lr, achieved, target, theta0
                        )
                    update.last_gradient = None
                m = None
                if dist:
                    m = measure(model, batch, reference, keep=reference is None)
                    pi, reference = m.pi, reference if reference is not None else m.log_softmax
                else:
                    pi = update.probs(batch)
                step = update.relative_step()
                finite = math.isfinite(step) and bool(torch.isfinite(pi[mask.to(pi.device)]).all())
                resolution = update.resolution(step * theta0, steps=len(stages) * k) if finite else None
                if mode == "equal_norm" and finite:
                    ratio = step * theta0 / target if target else float("nan")
                off = (  # off the equal norm: only a step that carried a signal, against a real target
                    resolution is not None
                    and not resolution.no_update
                    and ratio is not None
                    and math.isfinite(ratio)
                    and not NORM_RATIO_RANGE[0] <= ratio <= NORM_RATIO_RANGE[1]
                )
                diverged = not finite or off
                if diverged:
                    resolution = None
                    warn_diverged(rule.name, mode, step_lr, k, ratio if finite else None)
                    if not finite:
                        step = float("nan")
                else:
                    warn_unresolved(f"compare (rule {rule.name}, mode {mode})", resolution)
                if shares and not diverged:  # (its shares' JVP batched with the next rule's: `_Shares`)
                    pending.add((rule.name, mode), rb, rule.objective, update)
                update.load(update.initial())
                delta = torch.where(mask.to(pi.device), pi - pi0.to(pi.device), torch.zeros_like(pi))
                out[(rule.name, mode)] = RuleResult(
                    delta,
                    None,
                    step,
                    step_lr,
                    ratio,
                    resolution,
                    entropy=torch.where(mask.to(pi.device), m.entropy - start.entropy, 0.0) if m else None,
                    kl=torch.where(mask.to(pi.device), m.kl, 0.0)
                    if m and m.kl is not None
                    else (torch.zeros_like(delta) if m else None),  # the first rule: its KL to itself is 0
                    inner_steps=k,
                    sweep=rule.sweep,
                    diverged=diverged,
                )
                if len(pending.items) == pending.size:
                    pending.flush(model, out)
            pending.flush(model, out)
    return out


# the rules' share JVPs made together (`tokendyn.effects.shares.token_shares_many`): one parameter-sized
# displacement held per rule of a batch (parameters in host memory, `swaps_steps`; on a GPU one at a time)
JVP_BATCH = 2


class _Shares:
    """The rules' update shares pending their JVP: each rule's displacement theta_r - theta_0 written into a slot of
    one stacked buffer (``size`` slots, allocated at the first), then `token_shares_many` for all of them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: list[tuple[tuple[str, str], ProbeBatch, object]] = []
        self.stack: dict[str, torch.Tensor] | None = None

    def add(self, key: tuple[str, str], batch: ProbeBatch, objective, update: InPlaceUpdate) -> None:
        """The rule's displacement from theta_0 (the model at its update) into the next slot; none (no shares)
        when it is zero."""
        if self.stack is None:
            self.stack = {
                n: torch.empty((self.size, *local(p).shape), dtype=local(p).dtype, device=local(p).device)
                for n, p in update.params.items()
            }
        slot = len(self.items)
        for n, t in update.current().items():
            torch.sub(t, update.start.tensors[n].to(t.device), out=self.stack[n][slot])
        if any(dot64(v[slot], v[slot]) > 0 for v in self.stack.values()):
            self.items.append((key, batch, objective))

    def flush(self, model: nn.Module, out: dict) -> None:
        """The pending rules' shares s_t (over their sum), into their results; the buffer freed."""
        if self.items:
            n = len(self.items)
            directions = [{name: v[i] for name, v in self.stack.items()} for i in range(n)]
            found = token_shares_many(
                model,
                [(b, d, o) for (_, b, o), d in zip(self.items, directions, strict=True)],
                {name: v[:n] for name, v in self.stack.items()},
            )
            for (key, _, _), s in zip(self.items, found, strict=True):
                total = float(s.sum())
                out[key].shares = s / total if total != 0 else None
        self.items, self.stack = [], None


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
