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
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from tokendyn.effects.change import (
    InPlaceUpdate,
    Resolution,
    fix_pi_old,
    swaps_steps,
    warn_unresolved,
)
from tokendyn.effects.compare_norm import NORM_RATIO_RANGE, DivergedStepWarning, _to_norm, warn_diverged
from tokendyn.effects.compare_optim import NormalizedSGD, _set_lr, optimizer_copy
from tokendyn.effects.compare_reuse import FullUpdate, given_first_stage, reuses
from tokendyn.effects.compare_rule import SURROGATE_RULES, Rule, _apply, make_rule, rule_batch, rule_stages
from tokendyn.effects.distributions import measure
from tokendyn.effects.paired_records import paired_frame
from tokendyn.effects.shares import dot64, token_shares_many
from tokendyn.probe.forward import completion_proxy_logp
from tokendyn.probe.parallel import is_fully_sharded, local
from tokendyn.probe.tokenloss import (
    ProbeBatch,
    analysis_forward,
)
from tokendyn.vocab import COMPARE_MODES, COMPARE_RULES, FLOAT64, FLOAT64_STEP

RULES, MODES = COMPARE_RULES, COMPARE_MODES
__all__ = [
    "NormalizedSGD",
    "optimizer_copy",
    "paired_frame",
    "Rule",
    "SURROGATE_RULES",
    "make_rule",
    "rule_batch",
    "rule_stages",
    "FullUpdate",
    "given_first_stage",
    "reuses",
    "DivergedStepWarning",
    "NORM_RATIO_RANGE",
    "warn_diverged",
]  # (re-exported: their homes are compare_optim, paired_records, compare_rule, compare_reuse, compare_norm)


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
