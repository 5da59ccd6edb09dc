"""One engine for every study: a `StudySpec` names what a kind of study varies (its methods and their trainer
fields, the task's size and settings, how a trained run and the starting policy are evaluated, the order runs are
made in, its default sizes), and `run_study` trains and evaluates every (method, seed) of a size.

Folders. A run's results go to OUT/runs/{method}-s{seed}, its done marker ``study_done.json`` written last: a run
whose folder holds it is not recomputed, a finished run of another study (other settings) is an error before any
work, an unfinished run starts over. The starting policy is evaluated once (OUT/start) or once per seed
(OUT/start-s{seed}, where its evaluation samples). A kind's runs train either in their result folders (weights kept:
the K&K study) or, ``results_only``, in WORK/{method}-s{seed}, of which only the small result files are copied into
OUT and whose marker also records the threads and the method's fields: folders to commit, and a study to continue on
another machine from them. The starting policy's folders and a results_only run's are filled under a hidden staging
name and renamed into place (a reader sees all of a folder or nothing).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tokendyn.common import UsageError
from tokendyn.vocab import RULE_CAMPS

# re-exported: the reports and tests read a run's marker and identity from the engine
from .study_identity import DONE, check_run, identity, is_done, read_marker  # noqa: F401

START = "start"
# what a results_only run's folder copies from where it trained (beside its eval.parquet and its probe's records/)
RESULT_FILES = ("run.json", "metrics.parquet")

# `--both-camps`: the comparison of the GRPO runs (their own states), every rule of both camps; K = 2 inner updates so
# that the ratio-based rules (DPPO, ASPO, CE-GPPO) act (at K = 1, r = 1 and they are GRPO exactly); the c axis from
# Reweight's alpha = 0.6 (c = -0.6) to the Delta-log-p reweight's c = 0.6, and Lopti's eta
BOTH_CAMPS = dict(
    # every rule with a camp but the combinations and variants of one (Reweight + Lopti, KL-Cov, 80/20, GSPO)
    probe_compare_rules=[r for r in RULE_CAMPS if r not in ("reweight_lopti", "kl_cov", "80_20", "gspo")],
    probe_compare_inner_steps=2,
    probe_compare_c_sweep=[-0.6, -0.3, -0.1, 0.1, 0.3, 0.6],
    probe_compare_eta_sweep=[0.3, 0.5, 0.7],
)


@dataclass(frozen=True)
class StudySpec:
    """What one kind of study varies. Its sizes are frozen dataclasses with the fields every study has (``methods``,
    ``seeds``, ``rollouts``, ``eval_n``, ``probe_every``, ``probe_sample_sequences``, ``both_camps``, ``n_boot``)
    and the task's own; a size less its method and seed lists and n_boot is what its runs share (`identity`)."""

    methods: dict[str, dict]  # method -> fields of TokendynGRPOConfig
    full: Any  # the whole study's size, and a smoke-test size (seconds to minutes: the test suite's)
    quick: Any
    # size -> (RunArguments fields, TokendynGRPOConfig fields) of the task, on top of the embedded defaults
    settings: Callable[[Any], tuple[dict, dict]]
    check: Callable[[Any], None]  # the task's own fields of a size: a one-line UsageError naming the field
    # (folder it trained in, method, seed, size, config) -> its per-problem outcomes (the folder's eval.parquet)
    evaluate: Callable[..., Any]
    evaluate_start: Callable[..., Any]  # (model or None, size, seed) -> the starting policy's outcomes
    order: tuple[str, ...] = ()  # the order runs are made in (empty: the size's own)
    # methods made seed by seed before the others, method by method (a stop leaves whole seeds of them)
    seed_major: tuple[str, ...] = ()
    # methods whose probed states also make Reweight's and Lopti's update (the paired comparison)
    baselines: tuple[str, ...] = ("grpo",)
    sweeps: tuple[str, ...] = ()  # baselines that compare both camps whatever the size says
    camps_fields: dict = field(default_factory=lambda: dict(BOTH_CAMPS))  # what comparing both camps sets
    start_per_seed: bool = False
    results_only: bool = False
    min_probe_every: int = 1  # 0: a size may probe nothing
    # identity keys left out when false or empty: added after studies were committed, whose finished runs are reused
    optional: tuple[str, ...] = ()
    model_field: str = "--model"  # the flag a bad model source is reported under
    default_out: str = "runs/study"
    # where results_only runs train (their weights; removed as each ends)
    default_work: str = "runs/study-work"


def with_size(base, **changes):
    """``base`` with the given fields changed (what the CLI's flags set)."""
    return replace(base, **changes)


def check_size(spec: StudySpec, size):
    """One-line UsageError naming the field and the allowed values; nothing is created before this passes."""
    bad = [m for m in size.methods if m not in spec.methods]
    if bad or not size.methods:
        raise UsageError(f"methods: each must be one of {', '.join(spec.methods)}, got {list(size.methods)}")
    if len(set(size.methods)) != len(size.methods):
        raise UsageError(f"methods: each method once, got {list(size.methods)}")
    if not size.seeds or any(s < 0 for s in size.seeds) or len(set(size.seeds)) != len(size.seeds):
        raise UsageError(f"seeds: distinct integers >= 0 (at least one), got {list(size.seeds)}")
    if size.rollouts < 1:
        raise UsageError(f"rollouts: must be an integer >= 1, got {size.rollouts}")
    spec.check(size)
    if size.probe_every < spec.min_probe_every:
        raise UsageError(f"probe_every: must be an integer >= {spec.min_probe_every}, got {size.probe_every}")
    if size.probe_sample_sequences < 1:
        raise UsageError(
            f"probe_sample_sequences: must be an integer >= 1, got {size.probe_sample_sequences}"
        )
    if size.n_boot < 100:
        raise UsageError(f"n_boot: must be >= 100, got {size.n_boot}")
    return size


def run_config(spec: StudySpec, path: Path, method: str, seed: int, size, model: str | None, overrides=None):
    """(RunArguments, TokendynGRPOConfig) of one run trained in ``path``: the embedded defaults, the task's
    settings, the probe's, the method's fields, on a baseline the paired comparison from its own states (and both
    camps), the overrides; the probe cadence counted in rollouts."""
    import torch

    from tokendyn.analysis.study import PAIRED_MODE, PAIRED_RULES
    from tokendyn.trainers.config import TokendynGRPOConfig
    from tokendyn.trainers.runner import EMBEDDED_DEFAULTS, RunArguments

    run_fields, task_fields = spec.settings(size)
    run = RunArguments(model_name_or_path=model, rollouts=size.rollouts, **run_fields)
    fields = {**EMBEDDED_DEFAULTS, **task_fields}
    fields.update(
        output_dir=str(path),
        seed=seed,
        probe_every=size.probe_every,
        probe_sample_sequences=size.probe_sample_sequences,
        # the paper's Fig. 2a reads the direct gradients: every 10th probed micro-batch, whatever they cost
        probe_direct_budget=None,
        use_cpu=not torch.cuda.is_available(),
        save_strategy="no",
    )
    fields.update(spec.methods[method])
    if method in spec.baselines and size.probe_every:  # the Fig. 2b rows' paired verdicts on its own states
        fields.update(probe_compare_rules=list(PAIRED_RULES), probe_compare_modes=[PAIRED_MODE])
        if size.both_camps or method in spec.sweeps:
            fields.update(spec.camps_fields)
    fields.update(overrides or {})
    cfg = TokendynGRPOConfig(**fields)
    return run, cfg


def run_plan(spec: StudySpec, size) -> list[tuple[str, int]]:
    """(method, seed) in the order the runs are made: the ``seed_major`` methods seed by seed, then the others
    method by method."""
    order = [m for m in spec.order if m in size.methods] if spec.order else list(size.methods)
    first = [m for m in order if m in spec.seed_major]
    rest = [m for m in order if m not in first]
    return [(m, s) for s in size.seeds for m in first] + [(m, s) for m in rest for s in size.seeds]


def start_folders(spec: StudySpec, out: Path, seeds) -> list[tuple[str, int, Path]]:
    """(label, seed, folder) of the starting policy's evaluations: one per seed, or one (seed 0) for every seed."""
    if spec.start_per_seed:
        return [(f"starting policy, seed {s}", s, out / f"{START}-s{s}") for s in seeds]
    return [("starting policy", 0, out / START)]


def finished_runs(out: Path, methods=None) -> dict[tuple[str, int], Path]:
    """(method, seed) -> folder of every finished run under OUT/runs (its done marker present), of ``methods``
    only where given."""
    found = {}
    for d in sorted((Path(out) / "runs").glob("*-s*")):
        if not (d / DONE).is_file() or d.name.startswith("."):
            continue
        method, _, seed = d.name.rpartition("-s")
        if (methods is None or method in methods) and seed.isdigit():
            found[(method, int(seed))] = d
    return found


def _mark(folder: Path, ident: dict, extra: dict) -> None:
    from tokendyn.common import write_json

    write_json(folder / DONE, {"study": ident, **extra})


def _staging(final: Path) -> Path:
    staging = final.parent / f".{final.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _publish(staging: Path, final: Path, ident: dict, extra: dict) -> None:
    """The done marker into the filled staging folder, then the folder renamed into place."""
    _mark(staging, ident, extra)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)


def _keep(spec: StudySpec, method: str, trained: Path, final: Path, ident: dict, evals, train_s: float,
          t0: float) -> float:  # fmt: skip
    """A trained run's outcomes (and, ``results_only``, its small files) into ``final``, its marker last; returns
    its wall time (s) since ``t0``."""
    from tokendyn.records import write_parquet

    if not spec.results_only:  # it trained in its result folder: its outcomes beside the rest
        write_parquet(evals, final / "eval.parquet")
        wall = round(time.time() - t0, 1)
        _mark(
            final,
            ident,
            {"train_wall_time_s": train_s, "wall_time_s": wall, "method_fields": spec.methods[method]},
        )
        return wall
    staging = _staging(final)
    write_parquet(evals, staging / "eval.parquet")
    for name in RESULT_FILES:
        shutil.copy2(trained / name, staging / name)
    if (trained / "records").is_dir():
        shutil.copytree(trained / "records", staging / "records")
    wall = round(time.time() - t0, 1)
    threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or None
    _publish(staging, final, ident, {"train_wall_time_s": train_s, "wall_time_s": wall, "threads": threads,
                                     "method_fields": spec.methods[method]})  # fmt: skip
    shutil.rmtree(trained)  # the weights: never kept with the results
    return wall


def run_study(
    spec: StudySpec,
    out_dir: str | os.PathLike,
    size,
    *,
    model: str | None = None,
    overrides: dict | None = None,
    work_dir: str | os.PathLike | None = None,
    say: Callable[[str], None] | None = None,
) -> Path:
    """Train and evaluate every (method, seed) of ``size`` not finished yet into OUT/runs (``results_only``: train
    in WORK, default ``spec.default_work``), and the starting policy (`start_folders`); returns OUT. The settings
    are checked and every run's config is built before any work."""
    from rich.console import Console

    from tokendyn.common import check_writable
    from tokendyn.records import write_parquet
    from tokendyn.trainers.runner import train

    size = check_size(spec, size)
    overrides = dict(overrides or {})
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"out: {str(out)!r} exists and is not a directory")
    check_writable(out, "--out")
    if model is not None:
        from tokendyn.policy import check_model_source

        check_model_source(model, spec.model_field)
    work = (
        Path(work_dir if work_dir is not None else spec.default_work) if spec.results_only else out / "runs"
    )
    console = Console()
    say = say or (lambda msg: console.print(msg, highlight=False))
    ident = identity(spec, size, model, overrides)
    plan = run_plan(spec, size)
    configs = {(m, s): run_config(spec, work / f"{m}-s{s}", m, s, size, model, overrides) for m, s in plan}
    starts = start_folders(spec, out, size.seeds)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    for (m, s), (
        run,
        cfg,
    ) in configs.items():  # a finished run of another study is an error now, not after hours
        check_run(out / "runs" / f"{m}-s{s}", ident, run, cfg, spec.methods[m])
    for _, _, folder in starts:
        is_done(folder, ident)
    t0 = time.time()
    for label, seed, folder in starts:
        if is_done(folder, ident):
            say(f"{label}: done earlier ({folder})")
            continue
        t = time.time()
        staging = _staging(folder)
        write_parquet(spec.evaluate_start(model, size, seed), staging / "eval.parquet")
        _publish(staging, folder, ident, {"wall_time_s": round(time.time() - t, 1)})
        say(f"{label}: evaluated in {time.time() - t:.0f} s")
    for i, (method, seed) in enumerate(plan, 1):
        final = out / "runs" / f"{method}-s{seed}"
        head = f"[{i}/{len(plan)}] {method} seed {seed}"
        run, cfg = configs[(method, seed)]
        if check_run(final, ident, run, cfg, spec.methods[method]):
            say(f"{head}: done earlier ({final})")
            continue
        trained = Path(cfg.output_dir)
        if trained.exists():
            say(f"{head}: unfinished earlier run in {trained}: starting it over")
            shutil.rmtree(trained)
        say(f"[bold]{head}[/bold]: {size.rollouts} rollouts -> {final}")
        t = time.time()
        meta = train(run, cfg, progress=False, eval_at_start=False)
        evals = spec.evaluate(trained, method, seed, size, cfg)
        wall = _keep(spec, method, trained, final, ident, evals, meta["wall_time_s"], t)
        say(f"    done in {wall:.0f} s")
    say(f"runs finished in {time.time() - t0:.0f} s")
    return out
