"""The paired comparison of a probed rollout inside TRL's loop (`tokendyn.hooks.trainer.TrainerProbe.analyze`):
the rules of ``probe_compare_rules`` from the same states, on the analysis sample (`tokendyn.effects.compare`)."""

from __future__ import annotations

from tokendyn.effects.precision import MeasuredPrecision
from tokendyn.probe.parallel import is_fully_sharded
from tokendyn.probe.tokenloss import ProbeBatch

FSDP_NO_OPTIMIZER_COMPARE = (
    "the paired comparison's optimizer mode is off under FSDP2 (a copy of a sharded optimizer's state is not "
    "made); equal_norm runs"
)


def paired_comparison(tp, model, batch: ProbeBatch, sample: dict, step: int, full=None):
    """The paired comparison of ``compare_rules`` on the analysis sample of ``tp`` (the `TrainerProbe`), as its
    `paired` frame and the rules' results: the base rule
    is the run's loss on the advantages before Reweight; Reweight's alpha and Lopti's eta are the run's, else the
    paper's 0.3 and 0.5; the optimizer mode steps a copy of the run's optimizer (not under FSDP2). ``full``: the
    analyses' full step of the batch (`analyze_update`), reused as the base rule's equal_norm update when it is
    that update (a GRPO run's; not Reweight's, whose analyses train on the reweighted advantages). The sweeps'
    points (``compare_c_sweep``, ``compare_eta_sweep``: `tokendyn.effects.axis`) follow the named rules; every rule
    makes ``compare_inner_steps`` updates per stage."""
    from dataclasses import replace

    from tokendyn.effects.axis import axis_rules
    from tokendyn.effects.compare import compare_rules, make_rule, paired_frame
    from tokendyn.effects.shares import as_edges
    from tokendyn.probe.tokenloss import pi_old

    t, cfg = tp.trainer, tp.config
    if sample.get("raw_advantages") is not None:
        batch = replace(batch, advantages=sample["raw_advantages"])
    alpha = float(getattr(t.args, "advantage_reweight_alpha", 0.0) or 0.3)
    eta = tp._compare_eta()
    seed = t.cov_seed() if hasattr(t, "cov_seed") else int(t.args.seed)
    rules = [
        make_rule(name, tp.objective, alpha=alpha, eta=eta, seed=seed) for name in cfg.compare_rules
    ] + axis_rules(tp.objective, cfg.compare_c_sweep, cfg.compare_eta_sweep)
    modes = cfg.compare_modes
    if is_fully_sharded(model) and "optimizer" in modes:
        modes = tuple(m for m in modes if m != "optimizer")
        tp.probe.note("fsdp_no_optimizer_compare", FSDP_NO_OPTIMIZER_COMPARE, step=step)
    with MeasuredPrecision.quiet(tp.precision):  # (model-dtype steps a check agreed to)
        results = compare_rules(
            model,
            batch,
            rules,
            modes=modes,
            lr=cfg.comparison_lr,
            optimizer=t.optimizer,
            full=full,
            precision=MeasuredPrecision.used(cfg.step_precision, tp.precision),
            inner_steps=cfg.compare_inner_steps,
        )
    frame = paired_frame(results, batch, pi_old(model, batch), as_edges(tp.edges), step=step)
    return frame, results
