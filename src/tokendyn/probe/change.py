"""Probability change of the sampled tokens after an update, and the correct ratios (DESIGN.md).

    delta_pi_t = pi_after(o_t) - pi_before(o_t)      (same tokens, same temperature, eval mode)

(a) `counterfactual_change`: an update of a copy of the parameters, by default the paper's diagnostic (plain SGD,
    lr 1e-3, one step on the full loss L = sum_t l_t, or on the loss restricted to a token set). The copy is a set of
    detached parameter tensors fed through ``torch.func.functional_call``: the model itself is never modified, hooks
    and ``.grad`` are untouched, and any ``torch.optim`` optimizer can make the step. Several stages run in sequence
    on the same copy and the same optimizer (Lopti: stage 1 then stage 2, pi_old fixed).
(b) `real_change`: pi before (a tensor measured before the optimizer step, or a model) and after a real update
    (re-forward of the same tokens, no grad, mode restored).

Correct ratios (per bin): among A_t > 0 tokens increased / (increased + decreased); among A_t < 0 decreased /
(increased + decreased); pooled = (both numerators) / (both denominators). A tie (delta_pi_t = 0 at float64
resolution) is counted apart (tie_pos, tie_neg), never as a failure. Tokens with A_t = 0 are in neither.

Resolution: pi is measured with a float64 log-softmax of the model's logits (`completion_probs`), so a
near-certain token (1 - pi ~ 1e-7) whose logit margin rises is seen to rise; in float32 its log pi is 0.0 exactly
before and after, and the change would read as a tie.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from tokendyn.probe.bins import bin_bounds
from tokendyn.probe.tokenloss import (
    Objective,
    ProbeBatch,
    completion_logp,
    eval_mode,
    loss_and_measured_logp,
    token_loss,
    trainable_parameters,
)
from tokendyn.records import to_frame
from tokendyn.vocab import LOPTI, TRAIN

OptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]
QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)


def sgd(lr: float = 1e-3) -> OptimizerFactory:
    """The paper's diagnostic optimizer: plain SGD (no momentum, no weight decay)."""
    if not float(lr) > 0:
        raise ValueError(f"change: lr must be > 0, got {lr!r}")
    return lambda params: torch.optim.SGD(params, lr=float(lr), momentum=0.0, weight_decay=0.0)


def completion_probs(
    model: nn.Module, batch: ProbeBatch, params: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """pi_t(o_t) at the batch temperature, (B, C) float64, without grad, in eval mode (mode restored); the
    log-softmax is taken in float64 (`completion_logp`'s ``float64``) so that a change of a near-certain token's
    probability keeps its sign."""
    with torch.no_grad(), eval_mode(model):
        return torch.exp(completion_logp(model, batch, params, float64=True))


class ParamCopy:
    """A detached copy of a model's trainable parameters with its own optimizer; `step(batch, mask)` applies one
    update of sum_{t in mask} l_t to the copy, `probs(batch)` forwards the model with the copy."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerFactory,
        objective: Objective | None = None,
        start: dict[str, torch.Tensor] | None = None,
        state: dict | None = None,
    ) -> None:
        self.model, self.objective, self.factory = model, objective, optimizer
        source = trainable_parameters(model) if start is None else start
        self.params = {n: p.detach().clone().requires_grad_(True) for n, p in source.items()}
        self.optimizer = optimizer(list(self.params.values()))
        if state is not None:
            self.optimizer.load_state_dict(state)

    def fork(self) -> ParamCopy:
        """An independent copy of this copy, optimizer state included."""
        import copy

        return ParamCopy(
            self.model, self.factory, self.objective, self.params, copy.deepcopy(self.optimizer.state_dict())
        )

    def step(self, batch: ProbeBatch, mask: torch.Tensor | None = None) -> float:
        """One optimizer step on L_mask = sum_{t in mask} l_t (mask None: every token). Returns L_mask."""
        tensors = list(self.params.values())
        with eval_mode(self.model):
            terms = token_loss(self.model, batch, self.objective, self.params).terms
            loss = terms.sum() if mask is None else (terms * mask.to(terms.device, terms.dtype)).sum()
            grads = torch.autograd.grad(loss, tensors, allow_unused=True)
        for p, g in zip(tensors, grads, strict=True):
            p.grad = torch.zeros_like(p) if g is None else g
        self.optimizer.step()
        for p in tensors:
            p.grad = None
        return float(loss.detach())

    def probs(self, batch: ProbeBatch) -> torch.Tensor:
        return completion_probs(self.model, batch, self.params)

    def relative_step(self, start: dict[str, torch.Tensor]) -> float:
        """||theta_copy - theta_start|| / ||theta_start|| over every parameter of the copy (float64 sums)."""
        num = sum(
            float((p.detach() - start[n]).to(torch.float64).pow(2).sum()) for n, p in self.params.items()
        )
        den = sum(float(start[n].to(torch.float64).pow(2).sum()) for n in self.params)
        return (num / den) ** 0.5 if den > 0 else float("nan")


@dataclass
class ChangeResult:
    """pi before every stage and after the last, and delta pi per stage (relative to the state the stage started
    from); ``delta["lopti"]`` is after the last stage minus before the first (present with two or more stages)."""

    pi_before: torch.Tensor  # (B, C) float64
    pi_after: dict[str, torch.Tensor] = field(default_factory=dict)
    delta: dict[str, torch.Tensor] = field(default_factory=dict)
    losses: dict[str, float] = field(default_factory=dict)
    param_step: dict[str, float] = field(
        default_factory=dict
    )  # ||theta - theta_0|| / ||theta_0|| after each stage


def fix_pi_old(model: nn.Module, batch: ProbeBatch) -> tuple[ProbeBatch, torch.Tensor]:
    """(batch with old_logp set, pi_before): an on-policy batch gets pi_old = the current pi, fixed for every later
    stage (as the trainer does: pi_old is not recomputed between Lopti stages)."""
    if batch.old_logp is not None:
        return batch, completion_probs(model, batch)
    logp, logp64 = loss_and_measured_logp(
        model, batch
    )  # pi_old: the loss's own log pi, ratio exactly 1 at start
    return batch.with_old_logp(logp), torch.exp(logp64)


def counterfactual_change(
    model: nn.Module,
    batch: ProbeBatch,
    stages: Sequence[tuple[str, torch.Tensor | None]] | None = None,
    *,
    lr: float = 1e-3,
    optimizer: OptimizerFactory | None = None,
    objective: Objective | None = None,
) -> ChangeResult:
    """delta pi of every completion token after counterfactual update(s) of a copy of the parameters.

    ``stages``: (name, token mask or None for all tokens), applied in order on the same copy and optimizer, each one
    step on L_mask = sum_{t in mask} l_t; default ``[("train", None)]``, the paper's one-step diagnostic. Lopti:
    ``[("low", low), ("high", high)]`` (`tokendyn.vocab`). ``optimizer``: params -> torch.optim.Optimizer; default
    plain SGD(lr).
    """
    stages = [(TRAIN, None)] if stages is None else list(stages)
    if not stages:
        raise ValueError("change: stages must hold at least one (name, mask)")
    names = [s[0] for s in stages]
    if len(set(names)) != len(names) or LOPTI in names:
        raise ValueError(f"change: stage names must be distinct and not {LOPTI!r}, got {names}")
    batch, pi0 = fix_pi_old(model, batch)
    copy = ParamCopy(model, optimizer or sgd(lr), objective)
    start = {n: p.detach() for n, p in trainable_parameters(model).items()}
    result = ChangeResult(pi0)
    before = pi0
    for name, mask in stages:
        result.losses[name] = copy.step(batch, mask)
        result.param_step[name] = copy.relative_step(start)
        after = copy.probs(batch)
        result.pi_after[name] = after
        result.delta[name] = _masked(after - before, batch.completion_mask)
        before = after
    if len(stages) > 1:
        result.delta[LOPTI] = _masked(before - pi0, batch.completion_mask)
        result.param_step[LOPTI] = result.param_step[stages[-1][0]]
    return result


def real_change(before: torch.Tensor | nn.Module, after: nn.Module, batch: ProbeBatch) -> torch.Tensor:
    """delta pi = pi_after - pi_before on the batch's completion tokens, (B, C) float64, zero on padding.
    ``before``: pi measured before the update (`completion_probs`, taken before the optimizer step) or the model
    before the update; ``after``: the model after it. Side-effect free (no grad, each module's mode restored)."""
    pi_before = completion_probs(before, batch) if isinstance(before, nn.Module) else before.to(torch.float64)
    pi_after = completion_probs(after, batch)
    if pi_before.shape != pi_after.shape:
        raise ValueError(
            f"change: before has shape {list(pi_before.shape)}, the batch's completion {list(pi_after.shape)}"
        )
    return _masked(pi_after - pi_before.to(pi_after.device), batch.completion_mask)


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.to(x.device), x, torch.zeros_like(x))


def correct_ratios(
    delta: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> dict[str, float | int]:
    """Correct ratios on the tokens of ``mask``, ties apart (DESIGN.md):

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
):
    """The `prob_change` record of one delta pi: one row per bin of pi_old (``bins``: (B, C), -1 on padding) and
    one for all tokens (bin -1). ``update``: "counterfactual", "sweep" (the counterfactual step at another step size,
    `tokendyn.probe.rebalance.RebalanceOptions.lr_sweep`) or "real"; ``update_stage``: "train", "low", "high",
    "lopti" (`tokendyn.vocab`); ``source_bin``: the bin the update was restricted to (-1: all tokens); ``param_step``: the update's
    ||delta theta|| / ||theta||."""

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
        }
        row.update(delta_summary(delta, batch.advantages, mask))
        rows.append(row)
    return to_frame("prob_change", {c: [r[c] for r in rows] for c in rows[0]})
