"""The demo: GRPO, +Reweight (alpha = 0.3) and +Lopti (eta = 0.5) from one policy, with the probe and the
rebalancing analyses on, then every figure and report.html for the three runs side by side.

    from tokendyn.commands.demo import demo
    report = demo("runs/demo", quick=True)                      # the embedded default on K&K
    report = demo("runs/demo-llm", policy="smollm2-135m")       # the real LLM on two-digit sums

Two policies: the embedded default (a small Qwen2 warm-started on K&K; `tokendyn demo`, what ``make demo`` runs) and
SmolLM2-135M-Instruct from its package (``--policy smollm2-135m``). The real LLM has no reward signal on K&K (0 of 32
samples format-valid), so its demo trains on sums (`tokendyn.tasks.arith`), where GRPO learns. Every run starts from
the same policy and seed and sees the same number of rollout batches (``rollouts``; Lopti takes two optimizer steps
per rollout). `tokendyn demo [--quick] [--policy NAME] [--out DIR]`.
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
    probe_every: int  # rollouts between probed rollouts (every step of a probed rollout, both Lopti stages)
    probe_sample_sequences: int  # sequences of a probed rollout the rebalancing analyses use
    lr_sweep: tuple[float, ...] = ()  # step sizes of the counterfactual SGD sweep (probe_lr_sweep)
    task: str = "kk"  # kk (people, eval_people) or arith (arith_digits, arith_eval_digits)
    arith_digits: tuple[int, ...] = ()  # arith: operand digits trained on
    arith_eval_digits: tuple[int, ...] = ()  # arith: held-out difficulties evaluated (eval_n sums each)
    # the GRPO run compares Reweight's and Lopti's update with its own from the same states (the Fig. 2b paired
    # rows); probe_every counts rollouts either way, so every method is probed and analysed on the same rollouts
    probe_in_rollouts: bool = False
    trainer: tuple[tuple[str, object], ...] = ()  # trainer fields of this size (the policy's own settings)
    # K&K 3-person test puzzles sampled twice at T = 0.7 for the starting policy's Fig. 1a histogram (0: off)
    kk_histogram: int = 0
    # the GRPO run also compares every rule of both camps from its own states (K = 2 inner updates) and sweeps the c
    # axis and Lopti's eta (`tokendyn.commands.study_engine.BOTH_CAMPS`): the report's both-camps and sweep sections
    both_camps: bool = False
    # the c and eta values of those sweeps (empty: the study's, BOTH_CAMPS)
    c_sweep: tuple[float, ...] = ()
    eta_sweep: tuple[float, ...] = ()


# every section of the report within 10 minutes on 2 cores: the analyses on the same rollouts of every run (0, 4, 8:
# intervals over three probed steps), the GRPO run's paired comparison of Reweight and Lopti and of both camps from
# its own states (measured on a fresh clone: 15 rollouts probed every 3rd took 764 s, 417 of them GRPO's)
FULL = DemoSize(rollouts=12, people=(3, 4, 5), eval_people=(3, 4, 5, 6, 7), eval_n=20, eval_every=4,
                probe_every=4, probe_sample_sequences=8, lr_sweep=(1e-3, 1e-1, 1.0, 10.0), probe_in_rollouts=True,
                both_camps=True, c_sweep=(-0.6, -0.3, 0.3, 0.6), eta_sweep=(0.3, 0.7))  # fmt: skip
# (the sweeps shorter than the study's: c on both sides of GRPO, eta on both sides of Lopti's 0.5, which the named
# rule already compares)
QUICK = DemoSize(rollouts=3, people=(3, 4), eval_people=(3, 4), eval_n=5, eval_every=3, probe_every=2,
                 probe_sample_sequences=4, lr_sweep=(1e-3, 1.0), probe_in_rollouts=True, both_camps=True)  # fmt: skip

# the real LLM on sums of one- and two-digit numbers (8 prompts x 4 samples a rollout, one optimizer step each, lr
# 1e-5: the run in which GRPO took two-digit held-out accuracy from 0.19 to 0.75, docs/results.md), every analysis
# and the paired comparison on 16 sequences (4 groups) of rollouts 0, 3 and 6 (three probed steps: an interval per
# claim); greedy held-out accuracy on the 200 two-digit held-out sums before and after
LLM_TRAINER = (("learning_rate", 1e-5), ("per_device_train_batch_size", 32), ("num_generations", 4),
               ("steps_per_generation", 1), ("max_completion_length", 16))  # fmt: skip
LLM = DemoSize(rollouts=7, people=(), eval_people=(), eval_n=200, eval_every=7, probe_every=3,
               probe_sample_sequences=16, task="arith", arith_digits=(1, 2), arith_eval_digits=(2,),
               probe_in_rollouts=True, trainer=LLM_TRAINER, kk_histogram=16)  # fmt: skip
LLM_QUICK = replace(
    LLM, rollouts=1, eval_n=30, eval_every=1, probe_every=1, probe_sample_sequences=8, kk_histogram=4
)

# --policy NAME -> (model source, full size, quick size); "default": the embedded default (or --model) on K&K
POLICIES: dict[str, tuple[str | None, DemoSize, DemoSize]] = {
    "default": (None, FULL, QUICK),
    "smollm2-135m": ("smollm2-135m", LLM, LLM_QUICK),
}


def _configs(out: Path, size: DemoSize, model: str | None, overrides: dict):
    """(name, RunArguments, TokendynGRPOConfig) of the three runs."""
    import torch

    from tokendyn.analysis.study import PAIRED_MODE, PAIRED_RULES
    from tokendyn.trainers.config import TokendynGRPOConfig
    from tokendyn.trainers.runner import EMBEDDED_DEFAULTS, RunArguments

    runs = []
    for name, method in METHODS:
        if size.task == "arith":
            task = dict(task="arith", arith_digits=list(size.arith_digits),
                        arith_eval_digits=list(size.arith_eval_digits))  # fmt: skip
        else:
            task = dict(people=list(size.people), eval_people=list(size.eval_people))
        run = RunArguments(model_name_or_path=model, eval_n=size.eval_n, rollouts=size.rollouts, **task)
        fields = dict(EMBEDDED_DEFAULTS)
        fields.update(size.trainer)
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
        if size.probe_in_rollouts and name == "grpo":
            fields.update(probe_compare_rules=list(PAIRED_RULES), probe_compare_modes=[PAIRED_MODE])
            if size.both_camps:
                from .study_engine import BOTH_CAMPS

                fields.update(BOTH_CAMPS)
                if size.c_sweep:
                    fields.update(probe_compare_c_sweep=list(size.c_sweep))
                if size.eta_sweep:
                    fields.update(probe_compare_eta_sweep=list(size.eta_sweep))
        fields.update(overrides)
        cfg = TokendynGRPOConfig(**fields)  # probe_every counts rollouts: the same ones probed in every run
        runs.append((name, run, cfg))
    return runs


def demo(
    out_dir: str | os.PathLike = "runs/demo",
    quick: bool = False,
    *,
    policy: str = "default",
    model: str | None = None,
    size: DemoSize | None = None,
    overrides: dict | None = None,
    say: Callable[[str], None] | None = None,
) -> Path:
    """Train the three runs into OUT_DIR/{grpo,reweight,lopti}, draw the figures and the report into
    OUT_DIR/figures; returns the report's path. ``policy``: a name of `POLICIES` (the embedded default on K&K, or
    smollm2-135m on sums); ``model``: another policy directory or hub id, on K&K (default policy only);
    ``size``: how much to train (default: the policy's full size, or its quick one with ``quick``); ``overrides``:
    any TokendynGRPOConfig field for every run (e.g. a smaller batch for a smoke test)."""
    from rich.console import Console

    from tokendyn.common import UsageError, check_writable
    from tokendyn.figures.report import build_report
    from tokendyn.trainers.runner import earlier_run, method_name, train

    out = Path(out_dir)
    check_writable(out, "--out")
    console = Console()
    say = say or (lambda msg: console.print(msg, highlight=False))
    if policy not in POLICIES:
        raise UsageError(f"policy: must be one of {', '.join(POLICIES)}, got {policy!r}")
    source, full, short = POLICIES[policy]
    if model is not None and source is not None:
        raise UsageError(f"model: give --model or --policy {policy}, not both")
    model = model if source is None else source
    size = size or (short if quick else full)
    if model is None:
        from tokendyn.policy import default_policy_dir

        default_policy_dir()  # fail now, with its message, if the embedded default is missing
    else:
        from tokendyn.policy import check_model_source

        check_model_source(model, "--policy" if source else "--model")
    runs = _configs(out, size, model, dict(overrides or {}))  # every config validated before any training
    t0 = time.time()
    dirs = []
    for i, (_name, run, cfg) in enumerate(runs, 1):
        on = (
            f"K&K {list(size.people)}"
            if size.task == "kk"
            else f"sums of {list(size.arith_digits)}-digit numbers"
        )
        say(
            f"[bold][{i}/{len(runs)}] {method_name(cfg)}[/bold]: {size.rollouts} rollouts on {on} -> {cfg.output_dir}"
        )
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
    table = write_reproduces(dict(zip([m for m, _ in METHODS], dirs, strict=True)), out / "figures")
    say(f"    what reproduces (Figures 1-2, intervals over the probed steps) -> {table}")
    if size.kk_histogram:
        path = write_kk_histogram(model, size.kk_histogram, out / "figures")
        say(f"    the starting policy's token histogram on K&K (Fig. 1a) -> {path}")
    say(f"demo finished in {time.time() - t0:.0f} s")
    return result.path


# the paper's Fig. 1a (Qwen2.5-7B-Instruct-1M in GRPO on K&K; docs/paper.md §5): shares of [0, .25) / [.25, .5) / [.5, .75) / [.75, 1]
PAPER_HISTOGRAM = (0.1922, 0.1015, 0.1009, 0.6054)


def write_kk_histogram(model: str, n: int, figures: Path, samples: int = 2, seed: int = 0) -> Path:
    """The starting policy's Fig. 1a on K&K, where it needs no reward: the first ``n`` official 3-person test
    puzzles, ``samples`` completions each at T = 0.7 (256 tokens at most), the share of sampled tokens per quarter
    of pi, beside the paper's. Written to FIGURES/kk_histogram.md (atomically)."""
    import torch

    from tokendyn.common import atomic_write
    from tokendyn.policy import load_policy
    from tokendyn.tasks.kk.datasets import kk_dataset
    from tokendyn.trainers.evaluate import generate, token_histogram

    policy, tok = load_policy(model, dtype=torch.float32)
    prompts = [p for p in kk_dataset([3], "test", count=n)["prompt"] for _ in range(samples)]
    _, probs = generate(policy, tok, prompts, 256, 0.7, batch_size=8, seed=seed)
    shares = token_histogram(probs)
    cells = " | ".join(f"{100 * s:.1f} %" for s in shares)
    paper = " | ".join(f"{100 * s:.1f} %" for s in PAPER_HISTOGRAM)
    text = (
        f"# Sampled tokens per bin of pi on K&K ({model}, Fig. 1a)\n\n"
        f"{n} official 3-person test puzzles x {samples} samples at T = 0.7, {len(probs)} tokens.\n\n"
        "| | [0, .25) | [.25, .5) | [.5, .75) | [.75, 1] |\n|---|---|---|---|---|\n"
        f"| {model} | {cells} |\n| the paper (Qwen2.5-7B) | {paper} |\n"
    )
    path = figures / "kk_histogram.md"
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    return path


def write_reproduces(run_dirs: dict[str, Path], figures: Path) -> Path:
    """The study's table of the paper's claims (`tokendyn.analysis.study.reproduces_table`) from the demo's runs,
    one seed each: Figures 1-2 with 95 % bootstrap intervals over the probed steps (the Fig. 3 rows need the study's
    per-problem evaluations: no data here). Written to FIGURES/reproduces.md (atomically)."""
    from tokendyn.analysis import study as A
    from tokendyn.common import atomic_write

    units = {name: A.load_units({0: str(d)}) for name, d in run_dirs.items()}
    text = f"{A.VERDICT_RULE}\n\n{A.markdown(A.reproduces_table(None, units))}\n"
    path = figures / "reproduces.md"
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    return path


def with_size(base: DemoSize, **changes) -> DemoSize:
    """A DemoSize with some fields changed (e.g. ``with_size(QUICK, rollouts=1)``)."""
    return replace(base, **changes)


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"
