"""Isolation and influence: what each probability bin's update does to every token's probability (docs/definitions.md).

For each source bin b (and for all tokens, source -1): a counterfactual update of the parameters with only the
tokens of bin b in the loss (L_b = sum_{t in b} l_t: advantages and KL zeroed elsewhere, normalizer
unchanged), then delta_pi_t = pi_after(o_t) - pi_before(o_t) for every token t. The matrix

    M[source b, target b'] = mean over tokens t of bin b' of |delta_pi_t|
                             (and the distribution of delta_pi there: mean, std, quantiles; correct ratios)

has the paper's Fig. 1e (source = the lowest bin) and 1f (the highest) as two of its rows, and Fig. 1c as the
source = all row. Bins are over pi_old.

Lopti (``stage_masks=(stage1, stage2)``, e.g. from `lopti_stage_masks`): the matrix per stage. Stage 1 starts from
the model; its sources are the bins restricted to the stage-1 tokens. Stage 2 starts from the parameters after the
full stage-1 update (optimizer state carried over, pi_old fixed), its sources restricted to the stage-2 tokens; its
delta pi is measured from the start of stage 2. Sources without tokens in a stage produce no rows; a source whose
tokens carry no policy-gradient signal (no token with A != 0, or every such token's weight zero: a "no update",
`tokendyn.effects.resolution`) has its rows with null statistics and ``no_update`` true, and no warning.

Every update is made in place (`tokendyn.effects.change.InPlaceUpdate`), by default on float64 copies of the
parameters (a source's step is far below the float32 rounding of theta), and each source's step records how finely it
was resolved (`tokendyn.effects.change.Resolution`). A source's update is undone by putting the stage's starting
parameters back (plain SGD in the model's dtype on parameters in host memory: their own tensors, never written;
otherwise copied back from host memory), and the model is left bitwise as it was. Host memory: theta_0 and with
two stages the parameters at the start of stage 2 (unless never written); device memory: the float64 copy (none
with precision "model").
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn

from tokendyn.effects.change import (
    ChangeResult,
    InPlaceUpdate,
    OptimizerFactory,
    Resolution,
    fix_pi_old,
    sgd,
    warn_unresolved,
)
from tokendyn.effects.influence_result import InfluenceResult, SourceSum
from tokendyn.effects.shares import (
    FSDP_NO_TOKEN_SHARES,
    BinSplit,
    GroupSums,
    ShareResult,
    as_edges,
    parameter_group,
    with_token_shares,
)
from tokendyn.probe.parallel import fsdp_modules, local
from tokendyn.probe.tokenloss import Objective, ProbeBatch, analysis_forward, bin_index, trainable_parameters
from tokendyn.vocab import HIGH, LOPTI, LOW, TRAIN


def lopti_stage_masks(
    batch: ProbeBatch,
    eta: float | None = None,
    quantile: float | None = None,
    order: str = "low_first",
    pi_old: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two Lopti stage masks of the batch's tokens (`tokendyn.remedies.lopti_masks`, the trainer's
    own rule: low = pi_old < eta). ``pi_old`` is needed only for an on-policy batch (old_logp None)."""
    from tokendyn.remedies import lopti_masks

    if batch.old_logp is not None:
        old = batch.old_logp
    elif pi_old is not None:
        old = torch.log(pi_old)
    else:
        raise ValueError("influence: an on-policy batch (old_logp None) needs pi_old for the Lopti masks")
    return lopti_masks(old, batch.completion_mask, eta=eta, quantile=quantile, order=order)


@analysis_forward
def influence(
    model: nn.Module,
    batch: ProbeBatch,
    edges: torch.Tensor | tuple[float, ...] | list[float] | None = None,
    *,
    stage_masks: Sequence[torch.Tensor] | None = None,
    stage_names: tuple[str, str] = (LOW, HIGH),
    lr: float = 1e-3,
    optimizer: OptimizerFactory | None = None,
    objective: Objective | None = None,
    sources: Sequence[int] | None = None,
    pi_before: torch.Tensor | None = None,
    precision: str = "float64",
) -> InfluenceResult:
    """delta pi of every token after a counterfactual update restricted to each source bin (module docstring).

    ``stage_masks``: None (one update stage "train") or the two Lopti stage masks, in the run's order, named
    ``stage_names`` (low, high; high, low for the reversed order). ``sources``: the source bins to run (default all bins); source -1 (all tokens of the stage) is
    always run. Cost per stage: (len(sources) + 1) x (forward + backward + optimizer step + forward).
    ``optimizer``: params -> torch.optim.Optimizer, default plain SGD(lr). ``pi_before``: as in
    `tokendyn.effects.change.fix_pi_old`. ``precision``: the steps' (`tokendyn.effects.change.InPlaceUpdate`: float64 by
    default, so that a source's step far below the float32 rounding of theta is made whole)."""
    edges_t = as_edges(edges)
    k = edges_t.numel() - 1
    sources = list(range(k)) if sources is None else sorted({int(s) for s in sources})
    if any(not 0 <= s < k for s in sources):
        raise ValueError(f"influence: sources must be bin indices in 0..{k - 1}, got {sources}")
    valid = batch.completion_mask
    if stage_masks is None:
        stages = [(TRAIN, valid)]
    else:
        if len(stage_masks) != 2:
            raise ValueError(
                f"influence: stage_masks must be two (B, C) masks (Lopti), got {len(stage_masks)}"
            )
        stages = [
            (n, m.bool().to(valid.device) & valid) for n, m in zip(stage_names, stage_masks, strict=True)
        ]
    batch, pi_start = fix_pi_old(model, batch, pi_before, precision)
    bins = bin_index(torch.exp(batch.old_logp.to(torch.float64)), valid, edges_t)
    deltas: dict[tuple[str, int], torch.Tensor] = {}
    counts: dict[tuple[str, int], int] = {}
    resolution: dict[tuple[str, int], Resolution] = {}
    with InPlaceUpdate(model, optimizer or sgd(lr), objective, precision) as update:
        pi_start = pi0 = update.pi_start(batch, pi_start)
        change, signal = ChangeResult(pi0), False
        for i, (name, smask) in enumerate(stages):
            stage_start = update.save()
            start_norm = update.norm2() ** 0.5 if i else None  # (None: theta_0's)
            for src in sources:
                mask = smask & (bins == src)
                if not bool(mask.any()):
                    continue
                update.step(batch, mask)
                deltas[(name, src)] = _masked(update.probs(batch) - pi_start, valid)
                counts[(name, src)] = int(mask.sum())
                resolution[(name, src)] = update.resolution(
                    update.distance(stage_start), start_norm, signal=update.step_signal
                )
                update.load(stage_start)
            # the full stage update: source -1, and the start of the next stage
            change.losses[name] = update.step(batch, smask)
            pi_next = update.probs(batch)
            deltas[(name, -1)] = _masked(pi_next - pi_start, valid)
            counts[(name, -1)] = int(smask.sum())
            resolution[(name, -1)] = update.resolution(
                update.distance(stage_start), start_norm, signal=update.step_signal
            )
            signal = signal or update.step_signal
            _record_stage(change, update, name, i, pi_next, deltas[(name, -1)], resolution[(name, -1)])
            del stage_start
            pi_start = pi_next
        if len(stages) > 1:  # (as `counterfactual_change`: the stages together, from theta_0)
            change.delta[LOPTI] = _masked(pi_start - pi0, valid)
            change.param_step[LOPTI] = change.param_step[stages[-1][0]]
            change.resolution[LOPTI] = update.resolution(
                change.param_step[LOPTI] * update.start_norm2**0.5, steps=len(stages), signal=signal
            )
    _warn(resolution)
    ordered = dict(sorted(deltas.items(), key=lambda kv: (kv[0][0], kv[0][1])))
    return InfluenceResult(
        edges_t,
        bins,
        batch,
        ordered,
        {key: counts[key] for key in ordered},
        lr if optimizer is None else None,
        {key: resolution[key] for key in ordered},
        pi0,
        change,
    )


def _record_stage(
    change: ChangeResult,
    update: InPlaceUpdate,
    name: str,
    index: int,
    pi_after: torch.Tensor,
    delta: torch.Tensor,
    res: Resolution,
) -> None:
    """One stage's all-token update into ``change`` as `counterfactual_change` records it: its ||theta - theta_0||
    / ||theta_0|| (`InPlaceUpdate.relative_step`; for the first stage, which starts from theta_0, the resolution's
    own distance, the same float, with no second pass over the parameters)."""
    change.pi_after[name], change.delta[name], change.resolution[name] = pi_after, delta, res
    if index == 0:
        norm2 = update.start_norm2
        change.param_step[name] = res.step_norm / norm2**0.5 if norm2 > 0 else float("nan")
    else:
        change.param_step[name] = update.relative_step()


@analysis_forward
def influence_and_shares(
    model: nn.Module,
    batch: ProbeBatch,
    edges: torch.Tensor | tuple[float, ...] | list[float] | None = None,
    *,
    lr: float = 1e-3,
    objective: Objective | None = None,
    per_token: bool = True,
    pi_before: torch.Tensor | None = None,
    precision: str = "float64",
    keep: Sequence[int] = (),
) -> tuple[InfluenceResult, ShareResult]:
    """`influence` (one update stage, plain SGD at lr) and `gradient_shares` (method "stream") from the same
    gradients. Each source's counterfactual step is made with g_b = grad L_b, the gradient the shares need, and the
    full update with g: so the shares' per-group ||g||^2, ||g_b||^2 and <g_b, g> (float64, `GroupSums`) are taken
    from the steps' own gradients, and their separate forward and K + 1 backward passes are not made. The full
    update runs first (its g is kept on the device while the sources run: two parameter-sized gradients at a time,
    as the stream method holds), each source then starts from theta_0 restored bitwise. Results: those of the two
    functions (each source's update from the same theta_0 with the same gradient; the shares up to the rounding of a
    backward through a separate forward). Cost: (K + 1) x (forward + backward + step + forward) and the JVP.
    ``precision``: the steps' (`influence`); the shares are then reduced from float64 gradients, the JVP runs at the
    model's own precision. ``keep``: source bins whose gradients' sum is kept (`InfluenceResult.kept`, e.g. Lopti's
    first stage for the paired comparison, which then makes no forward and backward of its own for it): one
    parameter-sized buffer more from the first of them on (the first source's gradient itself, the later ones added
    into it)."""
    edges_t = as_edges(edges)
    k = edges_t.numel() - 1
    valid = batch.completion_mask
    batch, pi_start = fix_pi_old(model, batch, pi_before, precision)
    pi_old = torch.exp(batch.old_logp.to(torch.float64))
    bins = bin_index(pi_old, valid, edges_t)
    if per_token and fsdp_modules(model):
        warnings.warn(FSDP_NO_TOKEN_SHARES, stacklevel=2)
        per_token = False
    deltas: dict[tuple[str, int], torch.Tensor] = {}
    counts: dict[tuple[str, int], int] = {}
    total: list[torch.Tensor | None] = []
    resolution: dict[tuple[str, int], Resolution] = {}
    with InPlaceUpdate(model, sgd(lr), objective, precision) as update:
        pi_start = update.pi_start(batch, pi_start)
        names = list(update.params)
        groups = [parameter_group(n) for n in names]
        sums = GroupSums(names, groups, k)

        def keep_total(g: list[torch.Tensor | None]) -> None:
            sums.add_total(g)
            total.extend(g)

        loss = update.step(batch, valid, inspect=keep_total)
        pi_after = update.probs(batch)
        deltas[(TRAIN, -1)] = _masked(pi_after - pi_start, valid)
        counts[(TRAIN, -1)] = int(valid.sum())
        resolution[(TRAIN, -1)] = update.resolution(update.distance(), signal=update.step_signal)
        change = ChangeResult(pi_start, losses={TRAIN: loss})
        _record_stage(change, update, TRAIN, 0, pi_after, deltas[(TRAIN, -1)], resolution[(TRAIN, -1)])
        kept: list[torch.Tensor | None] = []
        kept_mask, kept_signal = torch.zeros_like(valid, dtype=torch.bool), False

        def add_bin(gb: list[torch.Tensor | None], b: int) -> None:
            sums.add_bin(b, gb, total)
            if b not in keep:
                return
            if not kept:  # (the step reads g_b and never writes it: kept as it is)
                kept.extend(gb)
                return
            for i, g in enumerate(gb):
                if g is not None:
                    kept[i] = g if kept[i] is None else kept[i].add_(g)

        for src in range(k):
            mask = valid & (bins == src)
            if not bool(mask.any()):
                continue
            update.load(update.initial())
            update.step(batch, mask, inspect=lambda gb, b=src: add_bin(gb, b))
            if src in keep:
                kept_mask |= mask
                kept_signal = kept_signal or bool(update.step_signal)
            deltas[(TRAIN, src)] = _masked(update.probs(batch) - pi_start, valid)
            counts[(TRAIN, src)] = int(mask.sum())
            resolution[(TRAIN, src)] = update.resolution(update.distance(), signal=update.step_signal)
        source_sum = None
        if kept:
            named = zip(update.params.items(), kept, strict=True)
            source_sum = SourceSum(
                {n: torch.zeros_like(local(p)) if g is None else g for (n, p), g in named},
                kept_mask,
                kept_signal,
            )
            kept.clear()
    _warn(resolution)
    total = [None if g is None else g.to(p.dtype) for g, p in zip(total, update.params.values(), strict=True)]
    split = BinSplit(names, groups, edges_t, bins, pi_old, loss, None)
    shares = sums.reduce(model).shares(split)
    direction = None
    if per_token and float(shares.total_norm[0]) > 0:
        params = trainable_parameters(model)
        direction = {
            n: torch.zeros_like(params[n]) if g is None else g for n, g in zip(names, total, strict=True)
        }
    total.clear()
    ordered = dict(sorted(deltas.items(), key=lambda kv: (kv[0][0], kv[0][1])))
    result = InfluenceResult(
        edges_t,
        bins,
        batch,
        ordered,
        {key: counts[key] for key in ordered},
        lr,
        {key: resolution[key] for key in ordered},
        pi_start,
        change,
        source_sum,
    )
    return result, with_token_shares(model, batch, split, shares, direction, objective)


def _warn(resolution: dict[tuple[str, int], Resolution]) -> None:
    for (stage, src), res in resolution.items():
        warn_unresolved(f"influence (update stage {stage}, source bin {src})", res)


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.to(x.device), x, torch.zeros_like(x))
