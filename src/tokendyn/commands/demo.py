"""The demo: GRPO, +Reweight (alpha = 0.3) and +Lopti (eta = 0.5) on K&K from the embedded default policy, with the
probe and the rebalancing analyses on, then every figure and report.html for the three runs side by side.

    from tokendyn.commands.demo import demo
    report = demo("runs/demo", quick=True)

Every run starts from the same policy and seed and sees the same number of rollout batches (``rollouts``; Lopti
takes two optimizer steps per rollout). Draft for `tokendyn demo [--quick] [--out DIR]`.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

# (run folder, method fields of TokendynGRPOConfig): the paper's settings on K&K
METHODS: tuple[tuple[str, dict], ...] = (
    ("grpo", {}),
    ("reweight", {"advantage_reweight_alpha": 0.3}),
    ("lopti", {"lopti_eta": 0.5}),
)


@dataclass(frozen=True)
class DemoSize:
    """How much each of the three runs trains and measures."""

    rollouts: int  # rollout batches per run (RunArguments.rollouts)
    people: tuple[int, ...]  # puzzle sizes trained on
    eval_people: tuple[int, ...]  # puzzle sizes evaluated (held-out accuracy per size)
    eval_n: int  # held-out puzzles per size per evaluation
    eval_every: int  # evaluation every this many rollouts
    probe_every: int  # optimizer steps between probed steps (analyses run on probed rollout starts)
    probe_sample_sequences: int  # sequences of a probed rollout the rebalancing analyses use
    lr_sweep: tuple[float, ...] = ()  # step sizes of the counterfactual SGD sweep (probe_lr_sweep)


FULL = DemoSize(rollouts=15, people=(3, 4, 5), eval_people=(3, 4, 5, 6, 7), eval_n=20, eval_every=5,
                probe_every=2, probe_sample_sequences=8, lr_sweep=(1e-3, 1e-2, 1e-1, 0.3, 1.0, 3.0, 10.0))  # fmt: skip
QUICK = DemoSize(rollouts=3, people=(3, 4), eval_people=(3, 4), eval_n=5, eval_every=3, probe_every=2,
                 probe_sample_sequences=4, lr_sweep=(1e-3, 1.0))  # fmt: skip


def _configs(out: Path, size: DemoSize, model: str | None, overrides: dict):
    """(name, RunArguments, TokendynGRPOConfig) of the three runs."""
    import torch

    from tokendyn.trainers.config import TokendynGRPOConfig
    from tokendyn.trainers.runner import EMBEDDED_DEFAULTS, RunArguments

    runs = []
    for name, method in METHODS:
        run = RunArguments(
            model_name_or_path=model,
            people=list(size.people),
            eval_people=list(size.eval_people),
            eval_n=size.eval_n,
            rollouts=size.rollouts,
        )
        fields = dict(EMBEDDED_DEFAULTS)
        fields.update(
            output_dir=str(out / name),
            eval_steps=size.eval_every,
            probe_every=size.probe_every,
            probe_sample_sequences=size.probe_sample_sequences,
            probe_lr_sweep=list(size.lr_sweep) or None,
            # the paper's Fig. 2a reads the direct gradients: every 10th probed micro-batch, whatever they cost
            probe_direct_budget=None,
            use_cpu=not torch.cuda.is_available(),
        )
        fields.update(method)
        fields.update(overrides)
        runs.append((name, run, TokendynGRPOConfig(**fields)))
    return runs


def demo(
    out_dir: str | os.PathLike = "runs/demo",
    quick: bool = False,
    *,
    model: str | None = None,
    size: DemoSize | None = None,
    overrides: dict | None = None,
    say: Callable[[str], None] | None = None,
) -> Path:
    """Train the three runs into OUT_DIR/{grpo,reweight,lopti}, draw the figures and the report into
    OUT_DIR/figures; returns the report's path. ``model``: a policy directory or hub id (default: the embedded
    default); ``size``: how much to train (default FULL, or QUICK with ``quick``); ``overrides``: any
    TokendynGRPOConfig field for every run (e.g. a smaller batch for a smoke test)."""
    from rich.console import Console

    from tokendyn.common import check_writable
    from tokendyn.figures.report import build_report
    from tokendyn.trainers.runner import earlier_run, method_name, train

    out = Path(out_dir)
    check_writable(out, "--out")
    console = Console()
    say = say or (lambda msg: console.print(msg, highlight=False))
    size = size or (QUICK if quick else FULL)
    if model is None:
        from tokendyn.policy import default_policy_dir

        default_policy_dir()  # fail now, with its message, if the embedded default is missing
    runs = _configs(out, size, model, dict(overrides or {}))  # every config validated before any training
    t0 = time.time()
    dirs = []
    for i, (_name, run, cfg) in enumerate(runs, 1):
        say(f"[bold][{i}/{len(runs)}] {method_name(cfg)}[/bold]: {size.rollouts} rollouts on K&K {list(size.people)} "
            f"-> {cfg.output_dir}")  # fmt: skip
        if earlier_run(cfg.output_dir):  # the demo's own earlier run of this method: replaced, not mixed in
            say(f"    replacing the earlier run in {cfg.output_dir}")
            shutil.rmtree(cfg.output_dir)
        meta = train(run, cfg)
        s = meta["summary"]
        say(
            f"    done in {meta['wall_time_s']:.0f} s; mean held-out accuracy {_fmt(s['mean_heldout_accuracy'])}"
        )
        dirs.append(Path(cfg.output_dir))
    say(f"[bold]figures and report[/bold] -> {out / 'figures'}")
    result = build_report(dirs, out / "figures", progress=lambda m: say(f"    {m}"))
    for name, note in result.notes.items():
        say(f"    [yellow]{name}[/yellow]: {note}")
    say(f"demo finished in {time.time() - t0:.0f} s")
    return result.path


def with_size(base: DemoSize, **changes) -> DemoSize:
    """A DemoSize with some fields changed (e.g. ``with_size(QUICK, rollouts=1)``)."""
    return replace(base, **changes)


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"
