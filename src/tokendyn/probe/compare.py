"""Paired counterfactual comparison: what each update rule would do, from the same state, to each group of tokens.

At one parameter state theta_0, on one batch with pi_old fixed, every rule r of `RULES` makes its update (its
loss, its advantages, its stages), in place and undone exactly (`tokendyn.probe.change.InPlaceUpdate`), and the
probability change of every sampled token is measured in float64::

    dpi_t(r) = pi_t(theta_r) - pi_t(theta_0),        paired difference  dpi_t(r) - dpi_t(base)

Two step sizes (``modes``):

* ``equal_norm``: plain SGD at the norm of the base rule's step at the paper's lr:  T = lr ||g_base||, and every
  rule's update has ||theta_r - theta_0|| = T (a one-stage rule: lr_r = T / ||g_r||, exact, `NormalizedSGD`; Lopti's
  two stages: one lr for both, lr first, then corrected once by T / ||achieved||, the achieved norm recorded), so no
  rule is credited for a smaller step.
* ``optimizer``: one step of a copy of the run's optimizer (its state and learning rate, e.g. AdamW's moments) per
  stage; the run's optimizer itself is never touched.

Per rule: the update share of each token, s_t = <grad l_t(r), dtheta_r> / <grad L(r), dtheta_r> (its part of the
first-order change of the rule's loss along the rule's own update, summing to 1; one JVP of the per-token loss at
theta_0, `tokendyn.probe.shares.token_shares`). Records: `paired`, one row per
(rule, mode, sequence, bin), sums that add up over sequences and steps, so intervals can be bootstrapped over
(step, sequence) (`tokendyn.analysis.paired`).

Cost per rule (equal_norm): one forward and backward per stage for the step (Lopti: its second stage twice, for the
norm correction; its first stage's gradient at theta_0 is kept in host memory and reused), one forward for pi, one
JVP for the shares. The base rule's equal_norm step is the analyses' own full counterfactual step (plain SGD at lr on
the whole loss): handed over as a `FullUpdate`, it costs nothing more. Memory: that of `InPlaceUpdate` (host
snapshot, one gradient, the optimizer copy's state in optimizer mode; Lopti: one gradient more in host memory) plus
one parameter-sized displacement for the shares' JVP (``shares=False`` drops it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from tokendyn.probe.bins import bin_bounds
from tokendyn.probe.change import (
    InPlaceUpdate,
    OptimizerFactory,
    Resolution,
    _state_to_host,
    fix_pi_old,
    resolution_columns,
    warn_unresolved,
)
from tokendyn.probe.float64 import original
from tokendyn.probe.parallel import local, sum_over_ranks
from tokendyn.probe.shares import dot64, token_shares
from tokendyn.probe.tokenloss import (
    PPO_FAMILY,
    Objective,
    ProbeBatch,
    analysis_forward,
    bin_index,
)
from tokendyn.records import to_frame
from tokendyn.remedies import lopti_masks
from tokendyn.vocab import COMPARE_MODES, COMPARE_RULES

RULES, MODES = COMPARE_RULES, COMPARE_MODES


@dataclass(frozen=True)
class Rule:
    """One update rule: its objective, Reweight's alpha (0: off) and Lopti's eta (None: one stage)."""

    name: str
    objective: Objective
    alpha: float = 0.0
    eta: float | None = None
    order: str = "low_first"


def make_rule(name: str, base: Objective, *, alpha: float = 0.3, eta: float = 0.5, seed: int = 0) -> Rule:
    """The rule ``name`` on top of the run's loss ``base``: reweight (A <- (alpha pi_old + 1 - alpha) A), lopti (two
    stages at eta, low first), reweight_lopti, clip_cov / kl_cov (`Objective.policy_loss`, verl's defaults), 80_20
    (top 20 % entropy tokens), gspo (sequence ratio, clip 3e-4 / 4e-4). Clip-Cov draws on a generator seeded with
    ``seed`` (never torch's global one: the comparison must not move the run's random stream). A rule the base loss
    cannot take raises ValueError naming it."""
    if name not in RULES:
        raise ValueError(f"compare: rule must be one of {', '.join(RULES)}, got {name!r}")
    if name in ("clip_cov", "kl_cov"):
        if (
            base.loss_type not in PPO_FAMILY
            or base.importance_sampling_level != "token"
            or base.eps_low is None
        ):
            raise ValueError(
                f"compare: rule {name} needs a clipped PPO-family base loss (loss_type one of "
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
    return Rule(
        name,
        base,
        alpha=alpha if name in ("reweight", "reweight_lopti") else 0.0,
        eta=eta if name in ("lopti", "reweight_lopti") else None,
    )


def rule_batch(rule: Rule, batch: ProbeBatch) -> ProbeBatch:
    """The batch the rule trains on: Reweight's advantages A_t (alpha pi_old,t + 1 - alpha) (pi_old fixed)."""
    if not rule.alpha:
        return batch
    weight = rule.alpha * torch.exp(batch.old_logp.to(torch.float64)) + 1.0 - rule.alpha
    return replace(batch, advantages=batch.advantages * weight.to(batch.advantages.device))


def rule_stages(rule: Rule, batch: ProbeBatch) -> list[torch.Tensor | None]:
    """The rule's update stages as token masks (None: every token): Lopti's two groups of pi_old, in its order."""
    if rule.eta is None:
        return [None]
    first, second = lopti_masks(batch.old_logp, batch.completion_mask, eta=rule.eta, order=rule.order)
    return [first, second]


def optimizer_copy(optimizer: torch.optim.Optimizer) -> OptimizerFactory:
    """A factory of copies of ``optimizer`` (unwrapped from accelerate's wrapper): same class, same parameter groups
    and hyperparameters (the current learning rate included), its state copied (cast to the stepped parameters'
    dtype: float64 copies of them, `tokendyn.probe.float64`), so that its steps leave the original and its state
    untouched."""
    inner = getattr(optimizer, "optimizer", optimizer)

    def make(params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        # the parameters stepped, by the run's parameter each is (or, float64 steps, stands in for)
        by_original = {id(original(p)): p for p in params}
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [by_original[id(p)] for p in g["params"] if id(p) in by_original],
            }
            for g in inner.param_groups
        ]
        copy = type(inner)(groups)
        copy.load_state_dict(_state_to_host(inner.state_dict()))
        return copy

    return make


class NormalizedSGD(torch.optim.Optimizer):
    """SGD whose step has a given norm: theta <- theta - (target / ||g||) g over all parameters (float64 norm, summed
    over FSDP2 ranks), or plain SGD theta <- theta - lr g while ``target`` is None; ``grad_norm`` keeps the last
    ||g||. No state: its steps are exactly undone by restoring the parameters."""

    def __init__(self, params, model: nn.Module, lr: float) -> None:
        super().__init__(params, {"lr": float(lr)})
        self.model, self.target, self.grad_norm = model, None, float("nan")

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        sq = torch.tensor([sum(dot64(local(x), local(x)) for x in grads)], dtype=torch.float64)
        self.grad_norm = float(sum_over_ranks(sq, self.model)) ** 0.5
        for group in self.param_groups:
            if self.target is None:
                scale = group["lr"]
            else:
                scale = self.target / self.grad_norm if self.grad_norm > 0 else 0.0
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-scale)


def _set_lr(update: InPlaceUpdate, lr: float) -> None:
    for group in update.optimizer.param_groups:
        group["lr"] = lr


def _apply(update: InPlaceUpdate, batch: ProbeBatch, objective: Objective, stages, *, first=None, keep=False):
    """The rule's stages, in place. ``keep``: the first stage's gradient at theta_0 is kept in
    ``update.last_gradient``; ``first``: such a gradient from an earlier pass (that stage's forward and backward
    skipped)."""
    update.objective = objective
    for i, mask in enumerate(stages):
        if i == 0:
            update.step(batch, mask, gradient=first, keep_gradient=keep)
        else:
            update.step(batch, mask)


def _displacement(update: InPlaceUpdate) -> dict[str, torch.Tensor]:
    return {n: local(p).detach() - update.start.tensors[n].to(p.device) for n, p in update.params.items()}


@dataclass(frozen=True)
class FullUpdate:
    """The analyses' full counterfactual step of one batch (plain SGD at ``lr`` on the whole loss from theta_0,
    pi_old fixed: `tokendyn.probe.rebalance.analyze_update`), which is also the base rule's equal_norm update:
    the batch with pi_old fixed, pi at theta_0 (B, C) float64, dpi of every token after the step (B, C) float64,
    ||g|| (float64) and the per-token shares s_t = <grad l_t, g> / ||g||^2 (B, C)."""

    batch: ProbeBatch
    objective: Objective
    lr: float
    pi0: torch.Tensor
    delta: torch.Tensor
    grad_norm: float
    shares: torch.Tensor | None


def reuses(full: FullUpdate, rule: Rule, batch: ProbeBatch, lr: float) -> bool:
    """Whether ``full`` is ``rule``'s equal_norm update on ``batch`` at ``lr``: one stage, no Reweight, the same
    objective, the same completions, mask and advantages, the same lr."""
    b = full.batch
    same_rule = rule.eta is None and not rule.alpha and rule.objective == full.objective
    if not (same_rule and float(lr) == float(full.lr) and full.grad_norm > 0):
        return False
    if (b.temperature, b.normalizer) != (batch.temperature, batch.normalizer):
        return False
    tensors = (
        "input_ids",
        "attention_mask",
        "completion_mask",
        "advantages",
        "ref_logp",
        "sampling_logp",
        "is_ratio",
    )
    if not all(_same(getattr(b, n), getattr(batch, n)) for n in tensors):
        return False
    return batch.old_logp is None or _same(b.old_logp, batch.old_logp)  # None: pi_old fixed by the analyses


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.equal(a, b.to(a.device))


@dataclass
class RuleResult:
    """One rule in one mode: dpi (B, C) float64, the update shares s_t (B, C), ||dtheta|| / ||theta_0||, the lr,
    the achieved norm over the target (equal_norm; 1 for one-stage rules), and how finely the step was resolved
    (`tokendyn.probe.change.Resolution`)."""

    delta: torch.Tensor
    shares: torch.Tensor | None
    param_step: float
    lr: float | None
    norm_ratio: float | None
    resolution: Resolution | None = None


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
) -> dict[tuple[str, str], RuleResult]:
    """(rule name, mode) -> `RuleResult`, every rule from the same theta_0 and pi_old (module docstring). The model's
    parameters (bitwise), ``.grad`` and ``optimizer`` (and its state) are left as they were. The first rule is
    the reference of the paired differences and of equal_norm's target (usually "base").

    ``full``: the analyses' full counterfactual update of this batch (`tokendyn.probe.rebalance.analyze_update`).
    When it is the first rule's equal_norm update (`reuses`: one stage, no Reweight, the same objective, advantages
    and lr), that rule's result is taken from it instead of being recomputed: its dpi, ||g|| (so the target
    T = lr ||g||), its shares (the analyses' s_t along g, over their sum) and ||dtheta|| / ||theta_0|| = lr ||g|| /
    ||theta_0||; and pi at theta_0 is the analyses' (no forward; it must then have been measured in the same
    ``precision``). ``precision``: the steps' (`tokendyn.probe.change.InPlaceUpdate`), float64 by default."""
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"compare: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if "optimizer" in modes and optimizer is None:
        raise ValueError("compare: mode 'optimizer' needs the run's optimizer")
    reuse = full is not None and bool(rules) and reuses(full, rules[0], batch, lr)
    if reuse:
        batch, pi0 = full.batch, full.pi0
    else:
        batch, pi0 = fix_pi_old(model, batch, precision=precision)
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
                        update.resolution(target),
                    )
                    continue
                rb, stages = rule_batch(rule, batch), rule_stages(rule, batch)
                step_lr, ratio = None, None
                if mode == "optimizer":
                    _apply(update, rb, rule.objective, stages)
                elif len(stages) == 1:  # one step of norm `target` (the first rule: plain SGD at lr sets it)
                    opt = update.optimizer
                    opt.target = target
                    _apply(update, rb, rule.objective, stages)
                    norm = opt.grad_norm
                    target = lr * norm if target is None else target
                    step_lr = target / norm if norm > 0 else 0.0
                else:  # Lopti's two stages at one lr: plain SGD at lr, then that lr corrected once to the target
                    update.optimizer.target = None
                    _set_lr(update, lr)
                    _apply(update, rb, rule.objective, stages, keep=True)
                    achieved = update.relative_step() * theta0
                    step_lr = lr
                    if target is None:
                        target = achieved
                    elif achieved > 0:
                        first = update.last_gradient  # stage 1 from theta_0 again: the same gradient
                        update.load(update.initial())
                        step_lr = lr * target / achieved
                        _set_lr(update, step_lr)
                        _apply(update, rb, rule.objective, stages, first=first)
                        del first
                    update.last_gradient = None
                pi = update.probs(batch)
                step = update.relative_step()
                resolution = update.resolution(step * theta0, steps=len(stages))
                warn_unresolved(f"compare (rule {rule.name}, mode {mode})", resolution)
                if mode == "equal_norm":
                    ratio = step * theta0 / target if target else float("nan")
                direction = _displacement(update) if shares else None
                update.load(update.initial())
                s = None
                if direction is not None and any(dot64(v, v) > 0 for v in direction.values()):
                    s = token_shares(model, rb, direction, objective=rule.objective)
                    total = float(s.sum())
                    s = s / total if total != 0 else None
                    del direction
                delta = torch.where(mask.to(pi.device), pi - pi0.to(pi.device), torch.zeros_like(pi))
                out[(rule.name, mode)] = RuleResult(delta, s, step, step_lr, ratio, resolution)
    return out


def paired_frame(
    results: dict[tuple[str, str], RuleResult],
    batch: ProbeBatch,
    pi_old: torch.Tensor,
    edges: torch.Tensor,
    *,
    step: int,
    reference: str = "base",
):
    """The `paired` record: one row per (rule, mode, sequence, bin of pi_old) with sums over that sequence's tokens
    of the bin: count, the signs of A, correct / tie counts of dpi, sum dpi, sum dpi(reference), sum of the paired
    difference and its square, the sum of the update shares; and the rule's lr, ||dtheta|| / ||theta||, norm ratio."""
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
                    "lr": res.lr,
                    "param_step": res.param_step,
                    "norm_ratio": res.norm_ratio,
                    **resolution_columns(res.resolution),
                }
                for c, v in values.items():
                    rows.setdefault(c, []).append(v)
    return to_frame("paired", rows)
