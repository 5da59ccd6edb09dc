"""The study: several methods x several seeds x R rollouts from one policy, then accuracy per puzzle size with 95 %
intervals (greedy and sampled), the starting policy's row, per-method bin tables from the runs' records, the paper's
Fig. 3 analogue with intervals, and the table of what reproduces.

    from tokendyn.commands.study import study, QUICK
    study("runs/study", size=QUICK)

Every run goes through the same entry point as the demo (``tokendyn.trainers.runner.train``, the demo's configs).
Resumable: a run whose folder holds ``study_done.json`` (written atomically after its training and its held-out
evaluation) is not recomputed; an unfinished run's folder is cleared and the run redone.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tokendyn.common import UsageError
from tokendyn.vocab import RULE_CAMPS

# method name -> fields of TokendynGRPOConfig (the paper's K&K settings: alpha 0.3, eta 0.5)
METHODS: dict[str, dict] = {
    "grpo": {},
    "reweight": {"advantage_reweight_alpha": 0.3},
    "lopti": {"lopti_eta": 0.5},
    "reweight_lopti": {"advantage_reweight_alpha": 0.3, "lopti_eta": 0.5},
    "lopti_high_first": {"lopti_eta": 0.5, "lopti_order": "high_first"},
}
DONE = "study_done.json"

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
class StudySize:
    """How much the study trains and measures."""

    methods: tuple[str, ...]
    seeds: tuple[int, ...]
    rollouts: int  # rollout batches per run
    people: tuple[int, ...]  # puzzle sizes trained on
    eval_people: tuple[int, ...]  # held-out sizes evaluated after training
    eval_n: int  # held-out puzzles per size (the official test split, first eval_n)
    probe_every: int  # rollouts between probed rollouts (every method probed on as many rollouts)
    probe_sample_sequences: int  # sequences of a probed rollout used by the rebalancing analyses
    n_boot: int = 2000
    # the GRPO runs compare every rule of both camps (BOTH_CAMPS) from their own states, K = 2 inner updates each,
    # and sweep the c axis and Lopti's eta: the study's "both camps" sections (`tokendyn study --both-camps`)
    both_camps: bool = False


# the full study: ~75-90 min on one thread (measured per rollout: GRPO ~6 s, Lopti ~15 s with the probes; evaluation
# ~1 min per run), within the 2 hours on 2 cores the study issue allows
FULL = StudySize(methods=("grpo", "reweight", "lopti"), seeds=(0, 1, 2), rollouts=60, people=(3, 4, 5),
                 eval_people=(3, 4, 5, 6, 7), eval_n=100, probe_every=2, probe_sample_sequences=8)  # fmt: skip
QUICK = StudySize(methods=("grpo", "reweight", "lopti"), seeds=(0, 1), rollouts=1, people=(3,), eval_people=(3,),
                  eval_n=3, probe_every=1, probe_sample_sequences=4, n_boot=200)  # fmt: skip


def check_size(size: StudySize) -> StudySize:
    """One-line UsageError naming the field and the allowed values; nothing is created before this passes."""
    from tokendyn.trainers.runner import MAX_PEOPLE, MIN_PEOPLE

    bad = [m for m in size.methods if m not in METHODS]
    if bad or not size.methods:
        raise UsageError(f"methods: each must be one of {', '.join(METHODS)}, got {list(size.methods)}")
    if len(set(size.methods)) != len(size.methods):
        raise UsageError(f"methods: each method once, got {list(size.methods)}")
    if not size.seeds or any(s < 0 for s in size.seeds) or len(set(size.seeds)) != len(size.seeds):
        raise UsageError(f"seeds: distinct integers >= 0 (at least one), got {list(size.seeds)}")
    if size.rollouts < 1:
        raise UsageError(f"rollouts: must be an integer >= 1, got {size.rollouts}")
    for name in ("people", "eval_people"):
        sizes = getattr(size, name)
        if not sizes or any(not MIN_PEOPLE <= k <= MAX_PEOPLE for k in sizes):
            raise UsageError(f"{name}: every size must be in {MIN_PEOPLE}..{MAX_PEOPLE}, got {list(sizes)}")
    if not 1 <= size.eval_n <= 100:
        raise UsageError(f"eval_n: must be in 1..100 (the official test split), got {size.eval_n}")
    if size.probe_every < 1:
        raise UsageError(f"probe_every: must be an integer >= 1, got {size.probe_every}")
    if size.probe_sample_sequences < 1:
        raise UsageError(
            f"probe_sample_sequences: must be an integer >= 1, got {size.probe_sample_sequences}"
        )
    if size.n_boot < 100:
        raise UsageError(f"n_boot: must be >= 100, got {size.n_boot}")
    return size


def _identity(size: StudySize, model: str | None, overrides: dict) -> dict:
    """What a finished run must share with this study to be reused (not the method/seed lists or n_boot)."""
    d = asdict(size)
    for k in ("methods", "seeds", "n_boot"):
        d.pop(k)
    if not d["both_camps"]:  # a study from before the option: its finished runs are reused
        d.pop("both_camps")
    return json.loads(json.dumps({**d, "model": model, "overrides": overrides}))  # as read back from json


def _config(out: Path, method: str, seed: int, size: StudySize, model: str | None, overrides: dict):
    """(RunArguments, TokendynGRPOConfig) of one run, the demo's defaults with the method's fields."""
    import torch

    from tokendyn.analysis.study import PAIRED_MODE, PAIRED_RULES
    from tokendyn.trainers.config import TokendynGRPOConfig
    from tokendyn.trainers.runner import EMBEDDED_DEFAULTS, RunArguments, optimizer_steps_per_rollout

    run = RunArguments(model_name_or_path=model, people=list(size.people), eval_n=0, rollouts=size.rollouts)
    fields = dict(EMBEDDED_DEFAULTS)
    fields.update(
        output_dir=str(out),
        seed=seed,
        probe_every=size.probe_every,
        probe_sample_sequences=size.probe_sample_sequences,
        # the paper's Fig. 2a reads the direct gradients: every 10th probed micro-batch, whatever they cost
        probe_direct_budget=None,
        use_cpu=not torch.cuda.is_available(),
        save_strategy="no",
    )
    fields.update(METHODS[method])
    if method == "grpo":  # the paired comparison on GRPO's own states: the Fig. 2b rows' paired verdicts
        fields.update(probe_compare_rules=list(PAIRED_RULES), probe_compare_modes=[PAIRED_MODE])
        if size.both_camps:
            fields.update(BOTH_CAMPS)
    fields.update(overrides)
    cfg = TokendynGRPOConfig(**fields)
    cfg.probe_every = size.probe_every * optimizer_steps_per_rollout(cfg)  # probe cadence counted in rollouts
    return run, cfg


def evaluate_puzzles(model_dir: str, people: Sequence[int], n: int, seed: int, label: str, run_seed: int):
    """Per-puzzle outcomes on the first ``n`` official test puzzles of each size, greedy and at T=0.7 (sampling
    seed ``seed``): rows (method, seed, people, mode, puzzle, correct, format_ok, reward)."""
    import polars as pl
    import torch

    from tokendyn.policy import load_policy
    from tokendyn.trainers.evaluate import puzzle_outcomes

    model, tok = load_policy(model_dir, dtype=torch.float32)
    rows = puzzle_outcomes(model, tok, list(people), n, 0.7, seed)
    return pl.DataFrame([{"method": label, "seed": run_seed, **r} for r in rows])


def _done(path: Path, identity: dict) -> bool:
    marker = path / DONE
    if not marker.is_file():
        return False
    found = json.loads(marker.read_text()).get("study")
    if found != identity:
        raise UsageError(
            f"out: {str(path)!r} holds a finished run of a different study ({_diff(found, identity)}); "
            "give a new --out or the same settings"
        )
    return True


def _diff(found: dict | None, want: dict) -> str:
    if not isinstance(found, dict):
        return "no settings recorded"
    keys = [k for k in want if found.get(k) != want[k]]
    return ", ".join(f"{k} {found.get(k)!r} vs {want[k]!r}" for k in keys) or "settings differ"


def _finish(path: Path, identity: dict, evals, extra: dict) -> None:
    from tokendyn.common import write_json
    from tokendyn.records import write_parquet

    path.mkdir(parents=True, exist_ok=True)
    write_parquet(evals, path / "eval.parquet")
    write_json(path / DONE, {"study": identity, **extra})  # last: the run counts as done only now


def study(
    out_dir: str | os.PathLike = "runs/study",
    size: StudySize = FULL,
    *,
    model: str | None = None,
    overrides: dict | None = None,
    say: Callable[[str], None] | None = None,
) -> Path:
    """Train and evaluate every (method, seed) into OUT/runs/{method}-s{seed}, the starting policy into OUT/start-s{seed},
    then write OUT/study.md, OUT/tables/*.parquet and OUT/figures/*.png; returns the path of study.md."""
    from rich.console import Console

    from tokendyn.common import check_writable
    from tokendyn.trainers.runner import train

    size = check_size(size)
    overrides = dict(overrides or {})
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"out: {str(out)!r} exists and is not a directory")
    check_writable(out, "--out")
    if model is None:
        from tokendyn.policy import default_policy_dir

        model_dir = str(default_policy_dir())
    else:
        model_dir = model
    console = Console()
    say = say or (lambda msg: console.print(msg, highlight=False))
    identity = _identity(size, model, overrides)
    plan = [
        (m, s, _config(out / "runs" / f"{m}-s{s}", m, s, size, model, overrides))
        for m in size.methods
        for s in size.seeds
    ]  # fmt: skip  (every config validated before any work)
    starts = [out / f"start-s{s}" for s in size.seeds]
    for p in [*(Path(c[1].output_dir) for _, _, c in plan), *starts]:
        _done(p, identity)  # a finished run of another study is an error now, not after hours
    t0 = time.time()
    for seed, path in zip(size.seeds, starts, strict=True):
        if _done(path, identity):
            say(f"starting policy, seed {seed}: done earlier ({path})")
            continue
        t = time.time()
        ev = evaluate_puzzles(model_dir, size.eval_people, size.eval_n, seed, "start", seed)
        _finish(path, identity, ev, {"wall_time_s": round(time.time() - t, 1)})
        say(f"starting policy, seed {seed}: evaluated in {time.time() - t:.0f} s")
    for i, (method, seed, (run, cfg)) in enumerate(plan, 1):
        path = Path(cfg.output_dir)
        head = f"[{i}/{len(plan)}] {method} seed {seed}"
        if _done(path, identity):
            say(f"{head}: done earlier ({path})")
            continue
        if path.exists():
            say(f"{head}: unfinished earlier run in {path}: starting it over")
            shutil.rmtree(path)
        t = time.time()
        say(f"[bold]{head}[/bold]: {size.rollouts} rollouts on K&K {list(size.people)} -> {path}")
        meta = train(run, cfg, progress=False)
        ev = evaluate_puzzles(str(path / "final"), size.eval_people, size.eval_n, seed, method, seed)
        _finish(
            path,
            identity,
            ev,
            {"train_wall_time_s": meta["wall_time_s"], "wall_time_s": round(time.time() - t, 1)},
        )
        say(f"    done in {time.time() - t:.0f} s")
    report = write_study(out, size)
    say(f"study finished in {time.time() - t0:.0f} s; tables, figures and {report.name} -> {out}")
    return report


def write_study(out: Path, size: StudySize) -> Path:
    """Read every finished run of ``size`` from OUT, write the tables (parquet), the figures and study.md."""
    import polars as pl

    from tokendyn.analysis import study as A
    from tokendyn.figures.study import accuracy_figure, correct_ratio_figure
    from tokendyn.records import write_parquet

    evals = pl.concat(
        [pl.read_parquet(p / "eval.parquet") for p in [out / f"start-s{s}" for s in size.seeds]
         + [out / "runs" / f"{m}-s{s}" for m in size.methods for s in size.seeds]]
    )  # fmt: skip
    acc = A.accuracy_table(evals, size.n_boot)
    units = {m: A.load_units({s: str(out / "runs" / f"{m}-s{s}") for s in size.seeds}) for m in size.methods}
    bins = A.method_bins_table(units, size.n_boot)
    repro = A.reproduces_table(evals, units, size.n_boot)
    paired = A.paired_bins_table(units, size.n_boot)
    (out / "tables").mkdir(parents=True, exist_ok=True)
    tables = (
        ("evaluations", evals),
        ("accuracy", acc),
        ("bins", bins),
        ("reproduces", repro),
        ("paired_bins", paired),
    )
    camps, guide, camp_figs = both_camps_section(out, size)
    tables += (("both_camps", camps), ("guidance", guide))
    for name, df in tables:
        if df.height:
            write_parquet(df, out / "tables" / f"{name}.parquet")
    figs = out / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    written = [f(figs) for f in camp_figs]
    if bins.height and "correct_pos" in bins.columns:
        written.append(correct_ratio_figure(bins, figs / "fig3_correct_ratio.png"))
    if acc.height:
        written.append(accuracy_figure(acc, figs / "accuracy.png"))
    dirs = [out / f"start-s{s}" for s in size.seeds] + [
        out / "runs" / f"{m}-s{s}" for m in size.methods for s in size.seeds
    ]
    walls = [
        float(json.loads((d / DONE).read_text()).get("wall_time_s", 0.0))
        for d in dirs
        if (d / DONE).is_file()
    ]
    text = study_markdown(
        size, acc, bins, repro, [p.relative_to(out) for p in written], sum(walls), paired, camps, guide
    )
    path = out / "study.md"
    from tokendyn.common import atomic_write

    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    return path


def both_camps_section(out: Path, size: StudySize, method: str = "grpo"):
    """(both-camps table, guidance table, figure writers) from the GRPO runs' `paired` records (``method``'s runs:
    grpo, or the real-LLM study's grpo_camps), every seed's steps as units of their own (step + seed * 10**6), the
    pairing kept: empty when the records hold no rule beyond the paper's (both camps) or no sweep (guidance). Set
    them with overrides, e.g. ``probe_compare_rules``, ``probe_compare_c_sweep``."""
    import polars as pl

    from tokendyn.analysis.load import load
    from tokendyn.figures.axis import axis_tables, sweep_curves
    from tokendyn.figures.camps import both_camps, camps_table
    from tokendyn.figures.data import MissingRecords

    parts = []
    for s in size.seeds:
        folder = out / "runs" / f"{method}-s{s}"
        frame = (
            load(folder, "paired").collect() if method in size.methods and folder.is_dir() else pl.DataFrame()
        )
        if frame.height:
            parts.append(frame.with_columns(pl.col("step") + s * 10**6, pl.lit("grpo").alias("run")))
    if not parts:
        return pl.DataFrame(), pl.DataFrame(), []
    paired = pl.concat(parts, how="vertical_relaxed")

    def save(fig, path: Path) -> Path:
        import matplotlib.pyplot as plt

        fig.savefig(path)
        plt.close(fig)
        return path

    camps, guide, figs = pl.DataFrame(), pl.DataFrame(), []
    named = paired.filter(pl.col("sweep").is_null() & ~pl.col("rule").is_in(["base", "reweight", "lopti"]))
    if named.height:
        camps = camps_table(paired)
        figs.append(lambda d: save(both_camps(paired), d / "both_camps.png"))
    try:
        _, guide = axis_tables(paired)
        figs.append(lambda d: save(sweep_curves(paired), d / "axis.png"))
    except MissingRecords:
        pass
    return camps, guide, figs


def study_markdown(
    size: StudySize,
    acc,
    bins,
    repro,
    figures,
    wall_s: float | None = None,
    paired=None,
    camps=None,
    guide=None,
) -> str:
    import polars as pl

    from tokendyn.analysis.study import VERDICT_RULE, markdown

    lines = [
        "# Study",
        "",
        f"methods {', '.join(size.methods)}; seeds {', '.join(map(str, size.seeds))}; {size.rollouts} rollouts per run "
        f"on K&K {list(size.people)}; held-out: first {size.eval_n} official test puzzles per size "
        f"{list(size.eval_people)}; 95 % percentile bootstrap intervals ({size.n_boot} resamples): accuracy over "
        "seeds and puzzles, record statistics over seeds and probed steps."
        + (f" Wall time of its runs and evaluations: {wall_s:,.0f} s." if wall_s else ""),
        "",
        "## Accuracy (reward = 3) per size",
        "",
    ]
    if acc.height:
        wide = acc.with_columns(
            pl.format(
                "{} [{}, {}]", pl.col("accuracy").round(3), pl.col("lo").round(3), pl.col("hi").round(3)
            ).alias("acc")
        ).pivot(on="people", index=["method", "mode"], values="acc")
        lines += [markdown(wide), ""]
    lines += ["## Per bin: token share, update share, ||g_b||/||g||, correct ratio (A > 0; ties apart)", ""]
    if bins.height:
        lines += [markdown(bins), ""]
    lines += ["## What reproduces", "", VERDICT_RULE, "", markdown(repro), ""]
    if paired is not None and paired.height:
        lines += [
            "## Paired comparison per bin: correct ratio (A > 0) of the remedy's update minus GRPO's",
            "",
            "paired: from the same GRPO states and batches, every rule's update at GRPO's ||dtheta|| (equal_norm); "
            "across_runs: the remedy's own runs minus GRPO's. 95 % intervals over seeds and probed steps.",
            "",
            markdown(paired),
            "",
        ]
    if camps is not None and camps.height:
        lines += [
            "## Both camps from the same states",
            "",
            "Every compared rule's update minus GRPO's, from the same GRPO states, per pi_old bin: dpi per token and "
            "the correct ratio, 95 % intervals over (seed, probed step, sequence); side: where the interval lies.",
            "",
            markdown(camps.drop("run")),
            "",
        ]
    if guide is not None and guide.height:
        from tokendyn.analysis.sweep import GUIDANCE_RULE

        lines += [
            "## Guidance along the axis through both camps",
            "",
            GUIDANCE_RULE,
            "",
            markdown(guide.drop("run")),
            "",
        ]
    lines += [f"![{f.stem}]({f.as_posix()})" for f in figures]
    return "\n".join(lines) + "\n"


def with_size(base: StudySize, **changes) -> StudySize:
    return replace(base, **changes)
