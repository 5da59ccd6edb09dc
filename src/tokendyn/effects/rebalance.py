"""One call for a trainer or an offline run: every rebalancing analysis of one batch, as record frames.

    frames = analyze_batch(model, batch, step=s, stage_masks=lopti_masks_or_None)     # before the optimizer step
    pi_before = completion_probs(model, batch)                                        # (for the real change)
    ... optimizer step ...
    frames["prob_change"] = pl.concat([frames["prob_change"], real_change_frame(pi_before, model, batch, step=s)])
    write_records(run_dir, frames)

Each analysis can be switched off (`RebalanceOptions`). The counterfactual probability change is read off the
influence run's all-token source (the same update), so turning influence on costs only the per-bin sources; and a
point of the lr sweep at the counterfactual update's own lr is that update again (the same stages from the same state,
the same lr and precision), read off it instead of made twice.

Counterfactual updates without a policy-gradient signal (an influence source, a stage, a sweep point whose tokens
have no A != 0, `tokendyn.effects.resolution`) are no update: their rows are null (``no_update`` true), no warning is
raised, and a ``notes`` record of the batch counts them.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import polars as pl
import torch
from torch import nn

from tokendyn.effects.change import (
    Resolution,
    change_frame,
    counterfactual_change,
    fix_pi_old,
    swaps_steps,
    warn_unresolved,
)
from tokendyn.effects.compare import FullUpdate
from tokendyn.effects.influence import influence, influence_and_shares
from tokendyn.effects.limit import limit_change, limit_refusal
from tokendyn.effects.precision import MeasuredPrecision, measured_analysis
from tokendyn.effects.rebalance_options import RebalanceOptions
from tokendyn.effects.shares import as_edges, gradient_shares
from tokendyn.effects.token_sample import token_shares_frame
from tokendyn.effects.token_view import head_ratios, token_view_frame, view_rows
from tokendyn.effects.update_frames import real_change_frame, stage_shares_frame
from tokendyn.probe.parallel import is_fully_sharded
from tokendyn.probe.tokenloss import Objective, ProbeBatch, analysis_forward, bin_index, trainable_parameters
from tokendyn.records import process_rank, to_frame
from tokendyn.remedies import lopti_masks
from tokendyn.vocab import HIGH, LOPTI, LOW, MEASURED, TRAIN, stage_name

# the options (`tokendyn.effects.rebalance_options`) and the frames of the real update
# (`tokendyn.effects.update_frames`), re-exported
__all__ = ["RebalanceOptions", "real_change_frame", "stage_shares_frame"]


def _stages(stage_masks: Sequence[torch.Tensor] | None, order: str) -> list[tuple[str, torch.Tensor | None]]:
    if stage_masks is None:
        return [(TRAIN, None)]
    return [(stage_name(1, order), stage_masks[0]), (stage_name(2, order), stage_masks[1])]


def analyze_batch(model: nn.Module, batch: ProbeBatch, **keywords) -> dict[str, pl.DataFrame]:
    """The analyses' frames of one batch: `analyze_update` (the same keywords) without its full step."""
    return analyze_update(model, batch, **keywords)[0]


@analysis_forward
def analyze_update(
    model: nn.Module,
    batch: ProbeBatch,
    *,
    step: int,
    stage: str = "train",
    edges: torch.Tensor | Sequence[float] | None = None,
    options: RebalanceOptions | None = None,
    objective: Objective | None = None,
    stage_masks: Sequence[torch.Tensor] | None = None,
    lopti_order: str = "low_first",
    tokenizer=None,
    precision_state: MeasuredPrecision | None = None,
    first_stage: tuple[float, str] | None = None,
    _reuse: bool = True,
) -> tuple[dict[str, pl.DataFrame], FullUpdate | None]:
    """The `shares`, `token_shares`, `prob_change` (counterfactual, and "sweep" rows for ``options.lr_sweep``, the
    first of them its lr -> 0 limit),
    `influence` and `token_view` frames of one batch, for the analyses switched on, and the full counterfactual step
    it made (`tokendyn.effects.compare.FullUpdate`: the base rule's equal_norm update of the paired comparison, which
    then need not make it again; None when it made none, or with Lopti's stages, no per-token shares, a zero
    gradient). ``stage_masks``: the two Lopti stage masks in the run's order ``lopti_order`` (then the
    counterfactual update and the influence matrix run per stage, update stages low / high and lopti for both), or
    None (update stage train). The model is left bitwise as it was (the counterfactual updates are made in place
    and undone, `tokendyn.effects.change.InPlaceUpdate`); ``.grad`` and any optimizer are untouched. ``tokenizer``:
    decodes the `token_view` tokens (else their text is empty). With the influence matrix and the shares both on
    (one update stage, method "stream") they come from one set of gradients (`influence_and_shares`). Counterfactual
    updates that were no update (`tokendyn.effects.resolution`) are counted in a `notes` frame (absent when none).
    A sweep point at ``options.lr`` is the counterfactual update's (or the influence run's all-token sources') own
    result, not a second step (``_reuse`` False: made again, as a check that the two are the same).
    ``options.step_precision`` "measured": `tokendyn.effects.precision.measured_analysis` with the run's
    ``precision_state`` (a check on this call when None; ``precision_state.last`` says which precision was used).
    ``first_stage``: the (eta, order) of a Lopti rule the paired comparison will make: with steps in the model's
    dtype, when its first stage's tokens are a union of the influence matrix's source bins, the sum of those
    sources' gradients is kept in the `FullUpdate` (``first_stage``), and the comparison makes no forward and
    backward of its own for that stage: one parameter-sized buffer more while the later sources run, no more than
    the copy of theta_0 swapped steps no longer make, so only where they are swapped (`_keeps_first_stage`: float32
    or float64 parameters in host memory; not under float64 steps, nor on a GPU, whose peaks it would raise)."""
    opts = options or RebalanceOptions()
    if opts.step_precision == MEASURED:

        def analyze(o: RebalanceOptions):
            return analyze_update(model, batch, step=step, stage=stage, edges=edges, options=o, objective=objective,
                                  stage_masks=stage_masks, lopti_order=lopti_order, tokenizer=tokenizer,
                                  first_stage=first_stage, _reuse=_reuse)  # fmt: skip

        state = precision_state if precision_state is not None else MeasuredPrecision()
        frames, full, _ = measured_analysis(analyze, model, opts, state, step=step, stage=stage,
                                            sharded=is_fully_sharded(model))  # fmt: skip
        return frames, full
    made = None  # the counterfactual update at opts.lr as `counterfactual_change` reports it, once made
    edges_t = as_edges(edges)
    batch, pi0 = fix_pi_old(model, batch, precision=opts.step_precision)  # pi_old fixed once for all
    pi_old = torch.exp(batch.old_logp.to(torch.float64))
    bins = bin_index(pi_old, batch.completion_mask, edges_t)
    frames: dict[str, pl.DataFrame] = {}
    all_delta = None
    stages = _stages(stage_masks, lopti_order)
    want_shares = opts.shares or opts.token_shares > 0
    res = None
    if opts.influence and want_shares and stage_masks is None and opts.share_method == "stream":
        # one set of gradients for both: each source's step is made with the g_b the shares reduce
        keep = ()
        if first_stage is not None and opts.step_precision == "model" and _keeps_first_stage(model):
            keep = _source_union(batch, bins, edges_t, *first_stage)
        inf, res = influence_and_shares(
            model,
            batch,
            edges_t,
            lr=opts.lr,
            objective=objective,
            per_token=opts.token_shares > 0,
            pi_before=pi0,
            precision=opts.step_precision,
            keep=keep,
        )
    elif opts.influence:
        names = tuple(n for n, _ in stages) if stage_masks is not None else (LOW, HIGH)
        inf = influence(
            model,
            batch,
            edges_t,
            stage_masks=stage_masks,
            stage_names=names,
            lr=opts.lr,
            objective=objective,
            pi_before=pi0,
            precision=opts.step_precision,
        )
    pi_start = pi0  # pi at theta_0 as the counterfactual deltas were measured from it (their precision)
    if opts.influence:
        frames["influence"] = inf.to_frame(step, stage)
        deltas = {name: inf.deltas[(name, -1)] for name, _ in stages}
        resolution = {name: inf.resolution[(name, -1)] for name, _ in stages}
        if len(stages) > 1:
            deltas[LOPTI] = sum(deltas.values())
            # (no step of its own: null; no update when neither stage was one)
            none = all(r.no_update for r in resolution.values())
            resolution[LOPTI] = Resolution(None, None, None, True) if none else None
        main, pi_start = None, inf.pi0
        made = inf.change  # (the same update as `counterfactual_change`'s, for the sweep)
    elif opts.prob_change:
        main = counterfactual_change(
            model,
            batch,
            stages,
            lr=opts.lr,
            objective=objective,
            pi_before=pi0,
            precision=opts.step_precision,
        )
        deltas, resolution, pi_start = main.delta, main.resolution, main.pi_before
        made = main
    else:
        deltas, main, resolution = {}, None, {}
    if deltas:
        all_delta = deltas[TRAIN] if stage_masks is None else deltas[LOPTI]
    sweep_res: dict[str, Resolution] = {}
    if opts.prob_change:
        steps_of = main.param_step if main is not None else {}
        parts = [
            change_frame(d, batch, bins, edges_t, step=step, stage=stage, update_stage=name, lr=opts.lr,
                         param_step=steps_of.get(name), resolution=resolution.get(name))
            for name, d in deltas.items()
        ]  # fmt: skip
        full = TRAIN if stage_masks is None else LOPTI
        refused = limit_refusal(model) if opts.lr_sweep else None
        if refused:
            warnings.warn(refused, stacklevel=2)
        elif opts.lr_sweep:  # the sweep's first point: its lr -> 0 limit, d pi / d lr at lr = 0
            lim = limit_change(model, batch, stages, objective=objective)
            sweep_res["limit"] = lim.resolution
            parts.append(
                change_frame(lim.rate, batch, bins, edges_t, step=step, stage=stage, update="sweep",
                             update_stage=full, lr=0.0, param_step=0.0, resolution=lim.resolution, limit=True)
            )  # fmt: skip
        for lr in opts.lr_sweep:
            if _reuse and made is not None and lr == float(opts.lr):  # that very update: its result again
                swept = made
                for part, flag in swept.resolution.items():  # (the loud flag the second call would raise)
                    warn_unresolved(f"change ({part})", flag)
            else:
                swept = counterfactual_change(model, batch, stages, lr=lr, objective=objective, pi_before=pi0,
                                              precision=opts.step_precision)  # fmt: skip
            sweep_res[f"lr {lr:g}"] = swept.resolution[full]
            parts.append(
                change_frame(swept.delta[full], batch, bins, edges_t, step=step, stage=stage, update="sweep",
                             update_stage=full, lr=lr, param_step=swept.param_step[full],
                             resolution=swept.resolution[full])
            )  # fmt: skip
        frames["prob_change"] = pl.concat(parts)
    if want_shares and res is None:
        res = gradient_shares(
            model,
            batch,
            edges_t,
            objective=objective,
            method=opts.share_method,
            per_token=opts.token_shares > 0,
        )
    if res is not None:
        if opts.shares:
            frames["shares"] = res.bins.to_frame(step, stage)
        if res.tokens is not None:
            frames["token_shares"] = token_shares_frame(
                res.tokens,
                bins,
                edges_t,
                pi_old,
                batch.advantages,
                batch.completion_ids,
                step=step,
                stage=stage,
                per_bin=opts.token_shares,
                seed=opts.seed + step,
                delta_pi=all_delta,
            )
    if opts.view_sequences:
        n = view_rows(batch, opts.view_sequences)
        frames["token_view"] = token_view_frame(
            batch,
            n,
            step=step,
            stage=stage,
            pi_old=pi_old,
            bins=bins,
            tokenizer=tokenizer,
            shares=res.tokens if res is not None else None,
            dpi_cf=all_delta,
            groups=[(name, m) for name, m in stages if m is not None],
            head_ratio=head_ratios(model, batch.select(slice(0, n))),
        )
    full = None
    if stage_masks is None and all_delta is not None and res is not None and res.tokens is not None:
        full = FullUpdate(
            batch,
            objective or Objective(),
            float(opts.lr),
            pi_start,
            all_delta,
            # ||g|| of the step made (its own precision), else the shares' (the same gradient in the model's dtype)
            resolution[TRAIN].step_norm / float(opts.lr)
            if resolution.get(TRAIN)
            else float(res.bins.total_norm[0]),
            res.tokens,
            not (resolution.get(TRAIN) is not None and resolution[TRAIN].no_update),
            inf.kept if opts.influence else None,
            opts.step_precision,
        )
    notes = _no_update_notes(step, inf.resolution if opts.influence else {}, resolution, sweep_res)
    if notes is not None:
        frames["notes"] = notes
    return frames, full


def _keeps_first_stage(model: nn.Module) -> bool:
    """Whether the analyses keep Lopti's first stage for the comparison: steps swapped in (`swaps_steps`: parameters
    in host memory, so the kept sum takes the place of theta_0's copy, no memory more) and float32 or float64
    weights (bf16 sums of the sources would round at 2^-9)."""
    params = list(trainable_parameters(model).values())
    return swaps_steps(model) and all(p.dtype in (torch.float32, torch.float64) for p in params)


def _source_union(
    batch: ProbeBatch, bins: torch.Tensor, edges: torch.Tensor, eta: float, order: str
) -> tuple:
    """The source bins whose union is Lopti's first stage at (eta, order) on this batch's tokens (its
    `tokendyn.remedies.lopti_masks`, pi_old fixed), or () when the stage is not such a union (eta inside a bin
    that holds tokens on both sides of it) or holds no token."""
    first = lopti_masks(batch.old_logp, batch.completion_mask, eta=eta, order=order)[0].to(bins.device)
    valid = batch.completion_mask.bool().to(bins.device)
    sources = tuple(b for b in range(edges.numel() - 1) if bool((first & (bins == b)).any()))
    union = valid & torch.isin(bins, torch.tensor(sources, dtype=bins.dtype, device=bins.device))
    return sources if sources and torch.equal(union, first & valid) else ()


def _no_update_notes(step: int, sources: dict, stages: dict, sweep: dict) -> pl.DataFrame | None:
    """The `notes` record counting the batch's counterfactual updates that were no update (None when none was):
    the influence sources (update stage, source bin), the counterfactual update's stages, the sweep's points."""
    seen = [(f"influence {u} source {src}", r) for (u, src), r in (sources or {}).items()]
    if not sources:
        seen += [(f"prob_change {name}", r) for name, r in stages.items()]
    seen += [(f"sweep {name}", r) for name, r in sweep.items()]
    seen = [(what, r) for what, r in seen if r is not None]
    none = [what for what, r in seen if r.no_update]
    if not none:
        return None
    message = (f"step {step}: {len(none)} of {len(seen)} counterfactual updates carried no policy-gradient signal "
               f"(no token with A != 0 and a non-zero weight) and were no update; their records are null "
               f"(no_update): {', '.join(none)}")  # fmt: skip
    columns = {
        "step": [step],
        "rank": [process_rank()],
        "code": [f"no_update_step_{step}"],
        "message": [message],
    }
    return to_frame("notes", columns)
