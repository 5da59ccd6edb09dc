"""The K&K study: several methods x several seeds x R rollouts from one policy, then accuracy per puzzle size with 95 %
intervals (greedy and sampled), the starting policy's row, per-method bin tables from the runs' records, the paper's
Fig. 3 analogue with intervals, and the table of what reproduces.

    from tokendyn.commands.study import study, QUICK
    study("runs/study", size=QUICK)

Every run goes through the same entry point as the demo (``tokendyn.trainers.runner.train``, the demo's configs),
made by the study engine (`tokendyn.commands.study_engine`, the spec ``KK``): each run trains in its result folder
OUT/runs/{method}-s{seed} (weights kept) and is evaluated on the held-out puzzles after training, the starting policy
once per seed (its sampled evaluation takes the seed); a folder holding ``study_done.json`` is not recomputed, an
unfinished run's folder is cleared and the run redone.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokendyn.common import UsageError

from .study_engine import DONE, StudySpec, read_marker, run_study, start_folders

# method name -> fields of TokendynGRPOConfig (the paper's K&K settings: alpha 0.3, eta 0.5)
METHODS: dict[str, dict] = {
    "grpo": {},
    "reweight": {"advantage_reweight_alpha": 0.3},
    "lopti": {"lopti_eta": 0.5},
    "reweight_lopti": {"advantage_reweight_alpha": 0.3, "lopti_eta": 0.5},
    "lopti_high_first": {"lopti_eta": 0.5, "lopti_order": "high_first"},
}


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


def _check(size: StudySize) -> None:
    from tokendyn.trainers.runner import MAX_PEOPLE, MIN_PEOPLE

    for name in ("people", "eval_people"):
        sizes = getattr(size, name)
        if not sizes or any(not MIN_PEOPLE <= k <= MAX_PEOPLE for k in sizes):
            raise UsageError(f"{name}: every size must be in {MIN_PEOPLE}..{MAX_PEOPLE}, got {list(sizes)}")
    if not 1 <= size.eval_n <= 100:
        raise UsageError(f"eval_n: must be in 1..100 (the official test split), got {size.eval_n}")


def _settings(size: StudySize) -> tuple[dict, dict]:
    """K&K puzzles of the trained sizes, no evaluation during training: the demo's trainer settings."""
    return {"people": list(size.people), "eval_n": 0}, {}


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


def _evaluate(trained: Path, method: str, seed: int, size: StudySize, cfg):
    return evaluate_puzzles(str(trained / "final"), size.eval_people, size.eval_n, seed, method, seed)


def _evaluate_start(model: str | None, size: StudySize, seed: int):
    from tokendyn.policy import default_policy_dir

    return evaluate_puzzles(
        model or str(default_policy_dir()), size.eval_people, size.eval_n, seed, "start", seed
    )


KK = StudySpec(
    methods=METHODS,
    full=FULL,
    quick=QUICK,
    settings=_settings,
    check=_check,
    evaluate=_evaluate,
    evaluate_start=_evaluate_start,
    start_per_seed=True,
    optional=("both_camps",),  # a study from before the option: its finished runs are reused
)


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
    out = run_study(KK, out_dir, size, model=model, overrides=overrides, say=say)
    return write_study(out, size)


def write_study(out: Path, size: StudySize) -> Path:
    """Read every finished run of ``size`` from OUT, write the tables (parquet), the figures and study.md."""
    import polars as pl

    from tokendyn.analysis import study as A
    from tokendyn.figures.study import accuracy_figure, correct_ratio_figure

    from .study_report import both_camps_section, save_report

    out = Path(out)
    dirs = [p for _, _, p in start_folders(KK, out, size.seeds)]
    dirs += [out / "runs" / f"{m}-s{s}" for m in size.methods for s in size.seeds]
    evals = pl.concat([pl.read_parquet(d / "eval.parquet") for d in dirs])
    acc = A.accuracy_table(evals, size.n_boot)
    units = {m: A.load_units({s: str(out / "runs" / f"{m}-s{s}") for s in size.seeds}) for m in size.methods}
    bins = A.method_bins_table(units, size.n_boot)
    repro = A.reproduces_table(evals, units, size.n_boot)
    paired = A.paired_bins_table(units, size.n_boot)
    grpo = {s: out / "runs" / f"grpo-s{s}" for s in size.seeds} if "grpo" in size.methods else {}
    camps, guide, camp_figs = both_camps_section(grpo)
    diffs, per_seed = greedy_differences(evals, size)
    tables = {"evaluations": evals, "accuracy": acc, "bins": bins, "reproduces": repro, "paired_bins": paired,
              "both_camps": camps, "guidance": guide, "differences": diffs, "seed_accuracy": per_seed}  # fmt: skip

    def draw(figs: Path) -> list[Path]:
        written = [f(figs) for f in camp_figs]
        if bins.height and "correct_pos" in bins.columns:
            written.append(correct_ratio_figure(bins, figs / "fig3_correct_ratio.png"))
        if acc.height:
            written.append(accuracy_figure(acc, figs / "accuracy.png"))
        return written

    wall = sum(float(read_marker(d).get("wall_time_s", 0.0)) for d in dirs if (d / DONE).is_file())
    return save_report(
        out,
        tables,
        draw,
        lambda figs: study_markdown(
            size, acc, bins, repro, figs, wall, paired, camps, guide, diffs, per_seed
        ),
    )


def greedy_differences(evals, size: StudySize):
    """(each method minus GRPO, accuracy per seed): the greedy outcomes, puzzle sizes pooled, as the seeded
    studies' rows (`tokendyn.analysis.seeds.differences_table`: two-stage bootstrap, seed-level t-interval, seeds
    agreeing in sign, Holm across the rows minus GRPO)."""
    import polars as pl

    from tokendyn.analysis import seeds as S

    g = evals.filter((pl.col("mode") == "greedy") & (pl.col("method") != "start"))
    if not g.height:
        return pl.DataFrame(), pl.DataFrame()
    g = g.select("method", pl.col("seed").cast(pl.Int64), pl.lit(size.rollouts).alias("rollout"),
                 pl.col("people").alias("digits"), pl.col("puzzle").alias("problem"), "correct")  # fmt: skip
    pairs = [(m, "grpo") for m in size.methods if m != "grpo"] if "grpo" in size.methods else []
    diffs = S.differences_table(g, pairs, size.rollouts, size.n_boot) if pairs else pl.DataFrame()
    return diffs, S.seed_accuracy_table(g, size.rollouts, size.methods)


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
    diffs=None,
    per_seed=None,
) -> str:
    from tokendyn.analysis.study import VERDICT_RULE, markdown

    from .study_report import document, guidance_section, section, with_interval

    lines = [
        "# Study",
        "",
        f"methods {', '.join(size.methods)}; seeds {', '.join(map(str, size.seeds))}; {size.rollouts} rollouts per run "
        f"on K&K {list(size.people)}; held-out: first {size.eval_n} official test puzzles per size "
        f"{list(size.eval_people)}; 95 % percentile bootstrap intervals ({size.n_boot} resamples): accuracy over "
        "seeds and puzzles, record statistics over seeds and probed steps."
        + (f" Wall time of its runs and evaluations: {wall_s:,.0f} s." if wall_s else ""),
        "",
    ]
    wide = (
        acc.with_columns(with_interval("acc")).pivot(on="people", index=["method", "mode"], values="acc")
        if acc.height
        else None
    )
    lines += section("Accuracy (reward = 3) per size", table=wide)
    lines += section(
        "Per bin: token share, update share, ||g_b||/||g||, correct ratio (A > 0; ties apart)", table=bins
    )
    if diffs is not None and diffs.height:
        from tokendyn.analysis.seeds import VERDICT_TEXT

        from .study_report import seed_section

        lines += seed_section(per_seed, size.rollouts)
        lines += section("Each method minus GRPO (greedy, sizes pooled)", VERDICT_TEXT, table=diffs)
    lines += section("What reproduces", VERDICT_RULE) + [markdown(repro), ""]  # (its table even with no rows)
    if paired is not None and paired.height:
        lines += section(
            "Paired comparison per bin: correct ratio (A > 0) of the remedy's update minus GRPO's",
            "paired: from the same GRPO states and batches, every rule's update at GRPO's ||dtheta|| (equal_norm); "
            "across_runs: the remedy's own runs minus GRPO's. 95 % intervals over seeds and probed steps.",
            table=paired,
        )
    if camps is not None and camps.height:
        lines += section(
            "Both camps from the same states",
            "Every compared rule's update minus GRPO's, from the same GRPO states, per pi_old bin: dpi per token and "
            "the correct ratio, 95 % intervals over (seed, probed step, sequence); side: where the interval lies.",
            table=camps.drop("run"),
        )
    lines += guidance_section(guide)
    return document(lines, figures)
