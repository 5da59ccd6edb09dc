"""The tokens behind a spike: a probed step's top tokens by exact update share, and the `spikes` record.

With l_t the per-token loss terms (`tokendyn.probe.tokenloss`, L = sum_t l_t) and g = grad_theta L:

    s_t = <grad_theta l_t, g> / ||g||^2        (sum_t s_t = 1)

for every token at once from one backward (g) and one forward-mode JVP along g (`tokendyn.effects.shares_jvp.token_shares`),
or from the per-token shares the step's analyses already made. The spike's tokens are the ``top`` largest s_t (signed:
the tokens that carry the update; a token with s_t < 0 is pulled against it), each with its text, pi_old, advantage,
log rho = log pi_old - log mu (null without a sampler), the importance weight the loss applied (null without one),
its bin of pi_old, and its sequence (index, position, and the text of its completion up to it). Whether a step is a
spike is `tokendyn.effects.spike_trigger`'s: `step_signals` gives it the step's values.

Same inputs as every measurement (model, `ProbeBatch`, objective, edges); the model is left as it was (eval mode for
the passes, no ``.grad`` written, no parameter changed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl
import torch
from torch import nn

from tokendyn.effects.shares_jvp import token_shares
from tokendyn.effects.shares_sums import as_edges, dot64
from tokendyn.effects.spike_trigger import (
    DEFAULT_K,
    DEFAULT_MIN_HISTORY,
    DEFAULT_QUANTITIES,
    DEFAULT_WINDOW,
    SPIKE_QUANTITIES,
    SpikeCheck,
    SpikeWatch,
    strongest,
)
from tokendyn.effects.token_view import token_texts
from tokendyn.probe.tokenloss import (
    Objective,
    ProbeBatch,
    analysis_forward,
    bin_index,
    eval_mode,
    token_loss,
    trainable_parameters,
)
from tokendyn.records import to_frame
from tokendyn.vocab import TRAIN

DEFAULT_TOP = 10
CONTEXT_TOKENS = 12  # tokens of the completion shown before a spike's token


@dataclass
class SpikeTokens:
    """A step's per-token shares and what a spike's rows are read from (all (B, C), on the CPU).

    shares: s_t (float64, 0 on padding); pi_old: float64; bins: long, -1 on padding; log_rho, is_weight: float64 or
    None; loss: L; grad_norm: ||g|| (None when the shares were handed in); order: (n, 2) (row, pos) of the scored
    tokens by s_t, largest first."""

    shares: torch.Tensor
    pi_old: torch.Tensor
    bins: torch.Tensor
    edges: torch.Tensor
    log_rho: torch.Tensor | None
    is_weight: torch.Tensor | None
    loss: float | None
    grad_norm: float | None
    order: torch.Tensor

    def top(self, n: int) -> torch.Tensor:
        """(row, pos) of the n largest shares."""
        return self.order[: max(int(n), 0)]

    def rank_of(self, row: int, pos: int) -> int | None:
        """1-based rank of token (row, pos) by share; None when it is not a scored token."""
        hit = ((self.order[:, 0] == row) & (self.order[:, 1] == pos)).nonzero()
        return int(hit[0, 0]) + 1 if len(hit) else None


def share_order(shares: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(n, 2) (row, pos) of the scored tokens (``mask``) by s_t, largest first (ties in row-major order)."""
    s = shares.detach().to("cpu", torch.float64)
    m = mask.detach().cpu().bool()
    idx = m.flatten().nonzero().flatten()
    vals = s.flatten()[idx]
    order = idx[torch.sort(-vals, stable=True).indices]
    c = s.size(1)
    return torch.stack([order // c, order % c], 1)


def sampler_values(
    batch: ProbeBatch, pi_old: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(log rho = log pi_old - log mu, the importance weight applied), (B, C) float64 each, or None where the batch
    has no sampler log-probabilities / no weight."""
    log_rho = None
    if batch.sampling_logp is not None:
        log_rho = torch.log(pi_old.cpu()) - batch.sampling_logp.detach().to("cpu", torch.float64)
    weight = None
    if batch.is_ratio is not None:
        weight = batch.is_ratio.detach().to("cpu", torch.float64).expand_as(batch.completion_mask)
    return log_rho, weight


def step_signals(
    batch: ProbeBatch, pi_old: torch.Tensor | None, *, loss: float | None, grad_norm: float | None
) -> dict[str, float | None]:
    """The trigger's values of one step (`spike_trigger.SPIKE_QUANTITIES`): ||g||, L, max_t |log rho_t| and
    max_t w_t over the scored tokens (None where not measured: no sampler, no weight, no token; log rho also
    without ``pi_old``)."""
    m = batch.completion_mask.detach().cpu().bool()
    log_rho, weight = sampler_values(batch, torch.ones_like(batch.advantages) if pi_old is None else pi_old)
    if pi_old is None:
        log_rho = None

    def top(x: torch.Tensor | None) -> float | None:
        if x is None or not bool(m.any()):
            return None
        return float(x[m].max())

    return {
        "grad_norm": grad_norm,
        "loss": loss,
        "max_abs_log_rho": top(None if log_rho is None else log_rho.abs()),
        "max_is_weight": top(weight),
    }


@analysis_forward
def spike_tokens(
    model: nn.Module,
    batch: ProbeBatch,
    *,
    objective: Objective | None = None,
    edges: torch.Tensor | Sequence[float] | None = None,
    shares: torch.Tensor | None = None,
) -> SpikeTokens:
    """Every token's exact update share s_t on ``batch`` (module docstring), ranked. Cost: one forward and one
    backward for g, then one JVP; with ``shares`` (the step's s_t, (B, C), from its analyses) one forward without
    grad for pi_old where the batch is on-policy, and none otherwise. A zero gradient (no advantage, no KL term) has
    no shares: a ValueError."""
    edges_t = as_edges(edges)
    loss = grad_norm = None
    if shares is None:
        params = trainable_parameters(model)
        with eval_mode(model):
            tl = token_loss(model, batch, objective)
            grads = torch.autograd.grad(tl.loss, list(params.values()), allow_unused=True)
        direction = {
            n: torch.zeros_like(p) if g is None else g
            for (n, p), g in zip(params.items(), grads, strict=True)
        }
        loss = float(tl.loss.detach())
        grad_norm = math.sqrt(sum(dot64(v, v) for v in direction.values()))
        logp_old = tl.logp.detach() if batch.old_logp is None else batch.old_logp
        del tl, grads
        shares = token_shares(model, batch, direction, objective=objective)  # raises on g = 0
        del direction
    elif batch.old_logp is None:
        with torch.no_grad(), eval_mode(model):
            logp_old = token_loss(model, batch, objective).logp
    else:
        logp_old = batch.old_logp
    pi = torch.exp(logp_old.detach().to("cpu", torch.float64))
    mask = batch.completion_mask.cpu()
    shares = shares.detach().to("cpu", torch.float64)
    log_rho, weight = sampler_values(batch, pi)
    return SpikeTokens(
        shares,
        pi,
        bin_index(pi, mask, edges_t),
        edges_t,
        log_rho,
        weight,
        loss,
        grad_norm,
        share_order(shares, mask),
    )


def spikes_frame(
    found: SpikeTokens,
    batch: ProbeBatch,
    *,
    step: int,
    stage: str = TRAIN,
    top: int = DEFAULT_TOP,
    trigger: SpikeCheck | None = None,
    k: float | None = None,
    tokenizer=None,
) -> pl.DataFrame:
    """The `spikes` record of one spiking step: its ``top`` tokens by share (rank 1 = largest), each with the
    columns of the module docstring and the trigger that fired (quantity, value, running median, ratio, k; null
    when the step was localised without a trigger)."""
    if not isinstance(top, int) or top < 1:
        raise ValueError(f"spike: top must be an integer >= 1, got {top!r}")
    picked = found.top(top).tolist()
    ids = batch.completion_ids.detach().cpu()
    mask = batch.completion_mask.detach().cpu().bool()
    cols: dict[str, list] = {c: [] for c in ("rank", "seq", "pos", "token_id", "text", "context")}
    for rank, (r, j) in enumerate(picked, start=1):
        lo = max(0, j - CONTEXT_TOKENS)
        shown = [p for p in range(lo, j + 1) if mask[r, p] or p == j]
        texts, _ = token_texts(tokenizer, ids[r, shown].tolist())
        cols["rank"].append(rank)
        cols["seq"].append(r)
        cols["pos"].append(j)
        cols["token_id"].append(int(ids[r, j]))
        cols["text"].append(texts[-1])
        cols["context"].append("".join(texts))

    def take(x: torch.Tensor | None) -> list:
        return [None if x is None else float(x[r, j]) for r, j in picked]

    b = [int(found.bins[r, j]) for r, j in picked]
    n = len(picked)
    cols.update(
        step=[step] * n,
        stage=[stage] * n,
        trigger=[None if trigger is None else trigger.quantity] * n,
        trigger_value=[None if trigger is None else trigger.value] * n,
        trigger_median=[None if trigger is None else trigger.median] * n,
        trigger_ratio=[None if trigger is None else trigger.ratio] * n,
        k=[k] * n,
        bin=b,
        bin_lo=[float(found.edges[x]) for x in b],
        bin_hi=[float(found.edges[x + 1]) for x in b],
        pi_old=take(found.pi_old),
        advantage=take(batch.advantages.detach().cpu()),
        log_rho=take(found.log_rho),
        is_weight=take(found.is_weight),
        share=take(found.shares),
        grad_norm=[found.grad_norm] * n,
        loss=[found.loss] * n,
    )
    return to_frame("spikes", cols)


def shares_signals(shares: pl.DataFrame | None) -> dict[str, float | None]:
    """(loss, grad_norm) of a step's `shares` record (its all-token row, bin -1, group "all"; the first stage's
    where there are several), or None each without one."""
    if shares is None or shares.is_empty():
        return {"loss": None, "grad_norm": None}
    row = shares.filter((pl.col("bin") == -1) & (pl.col("group") == "all")).row(0, named=True)
    return {"loss": row["loss"], "grad_norm": row["total_norm"]}


class SpikeMonitor:
    """The trigger over a run's probed steps and, when it fires, the step's `spikes` record: what a probe calls
    once per probed step with the batch it analysed and the frames its analyses made. On a step that does not
    spike it reads ||g|| (and L, when ``quantities`` holds it) from the step's `shares` frame (no pass of its own:
    without that frame only the sampler's quantities are watched) and max |log rho|, max w from the batch; on a
    spike it localises (one backward, one JVP). ``quantities``: those judged (`DEFAULT_QUANTITIES`: not the loss)."""

    def __init__(self, k: float = DEFAULT_K, min_history: int = DEFAULT_MIN_HISTORY,
                 window: int = DEFAULT_WINDOW, top: int = DEFAULT_TOP,
                 quantities: Sequence[str] = DEFAULT_QUANTITIES) -> None:  # fmt: skip
        if not isinstance(top, int) or top < 1:
            raise ValueError(f"spike: top must be an integer >= 1, got {top!r}")
        unknown = sorted(set(quantities) - set(SPIKE_QUANTITIES))
        if unknown or not quantities:
            raise ValueError(
                f"spike: quantities must be some of {list(SPIKE_QUANTITIES)}, got {list(quantities)}"
            )
        self.watch = SpikeWatch(k, min_history, window)
        self.top = top
        self.quantities = tuple(quantities)

    def observe(self, model: nn.Module, batch: ProbeBatch, *, step: int, frames: dict[str, pl.DataFrame],
                stage: str = TRAIN, objective: Objective | None = None,
                edges: torch.Tensor | Sequence[float] | None = None, tokenizer=None) -> pl.DataFrame | None:  # fmt: skip
        """The `spikes` frame of this step when the trigger fires on it, else None."""
        pi_old = (
            None if batch.old_logp is None else torch.exp(batch.old_logp.detach().to("cpu", torch.float64))
        )
        signals = step_signals(batch, pi_old, **shares_signals(frames.get("shares")))
        trigger = strongest(self.watch.check({q: v for q, v in signals.items() if q in self.quantities}))
        if trigger is None:
            return None
        found = spike_tokens(model, batch, objective=objective, edges=edges)
        return spikes_frame(found, batch, step=step, stage=stage, top=self.top, trigger=trigger,
                            k=self.watch.k, tokenizer=tokenizer)  # fmt: skip
