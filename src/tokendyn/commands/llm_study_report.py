"""The real-LLM study's report from its finished run folders alone (no training): tables (parquet), figures and
study.md. `tokendyn study --policy smollm2-135m --out DIR --report-only`.

Sections: what ran and what it cost; held-out accuracy per method and rollout (intervals over seeds and problems,
two-stage bootstrap: `tokendyn.analysis.seeds`); each method minus GRPO with its verdict; GRPO's across-seed spread;
Lopti's two controls and which one its effect follows; the mechanism per method from the runs' probed steps (the
low bin's share of the update, the top bin's correct ratio, entropy) beside its accuracy; the claim table of
Figures 1-2; the both-camps comparison and sweep from the GRPO runs' own states, with its guidance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .llm_study import CAMP, METHODS, ORDER, PAPER_METHODS, SAME_AS_GRPO, LLMStudySize
from .study_engine import DONE, START, finished_runs, read_marker
from .study_report import batch_words, run_records, section, with_interval

# verdicts (`tokendyn.analysis.seeds.differences_table`) of a row every check puts above / below 0
RESOLVED_ABOVE = ("reproduced", "better than GRPO", "above 0")
RESOLVED_BELOW = ("reversed", "worse than GRPO", "below 0")
CONTROL_PAIRS = (
    ("lopti", "grpo"),
    ("random_halves", "grpo"),
    ("lopti_half_lr", "grpo"),
    ("lopti", "random_halves"),
    ("lopti", "lopti_half_lr"),
)


def load_finished(out: Path, methods, what: str):
    """(finished runs of ``methods`` under OUT, their outcomes: `load_evals`); a UsageError where there is none."""
    from tokendyn.common import UsageError

    runs = finished_runs(out, methods)
    if not runs:
        raise UsageError(
            f"out: {str(out)!r} holds no finished run of {what} (OUT/runs/<method>-s<seed>/{DONE})"
        )
    return runs, load_evals(out, runs)


def load_evals(out: Path, runs: dict[tuple[str, int], Path]):
    """Every finished run's outcomes, the starting policy's as rollout 0 of every method and seed that ran."""
    import polars as pl

    parts = [pl.read_parquet(d / "eval.parquet") for d in runs.values()]
    start = out / START / "eval.parquet"
    if start.is_file() and (out / START / DONE).is_file():
        s = pl.read_parquet(start)
        parts.append(s)  # the starting policy's own row
        for method, seed in runs:
            parts.append(
                s.with_columns(
                    pl.lit(method).alias("method"), pl.lit(seed).cast(s["seed"].dtype).alias("seed")
                )
            )
    if not parts:
        return pl.DataFrame()
    return pl.concat([p.with_columns(pl.col("seed").cast(pl.Int64), pl.col("rollout").cast(pl.Int64))
                      for p in parts], how="vertical_relaxed")  # fmt: skip


def control_reading(diff) -> str:
    """Which one Lopti's effect follows, read off the controls' intervals (CONTROL_PAIRS) by the rule written out
    in the sentence itself."""

    def row(m, ref):
        r = diff.filter((diff["method"] == m) & (diff["minus"] == ref)) if diff.height else diff
        return None if not r.height else (r["difference"][0], r["lo"][0], r["hi"][0], r["verdict"][0])

    def side(x):  # resolved only where the row's four checks agree (its verdict)
        return 0 if x is None else 1 if x[3] in RESOLVED_ABOVE else -1 if x[3] in RESOLVED_BELOW else 0

    lopti = row("lopti", "grpo")
    if lopti is None:
        return "Lopti's runs are not finished: no reading of its controls yet."
    if int(diff["seeds"].min()) < 2:
        return (
            "One training seed so far: these intervals are over the held-out problems alone and say nothing about "
            "training, so there is no reading of Lopti's controls yet."
        )
    s = side(lopti)
    parts = []
    if s == 0:
        parts.append(f"Lopti − GRPO is not resolved ({lopti[0]:+.3f} [{lopti[1]:+.3f}, {lopti[2]:+.3f}])")
    else:
        word = "above" if s > 0 else "below"
        parts.append(f"Lopti lies {word} GRPO ({lopti[0]:+.3f} [{lopti[1]:+.3f}, {lopti[2]:+.3f}])")
    halves, half_lr = row("random_halves", "grpo"), row("lopti_half_lr", "grpo")
    split, lr = row("lopti", "random_halves"), row("lopti", "lopti_half_lr")
    if halves is not None:
        same = side(halves) == s != 0
        parts.append(
            f"two steps on random halves (Lopti's step count, no split) give {halves[0]:+.3f} "
            f"[{halves[1]:+.3f}, {halves[2]:+.3f}] against GRPO"
            + (": the step count alone moves accuracy the same way" if same else "")
        )
    if split is not None:
        parts.append(
            f"Lopti − random halves (the split itself at equal steps) {split[0]:+.3f} [{split[1]:+.3f}, "
            f"{split[2]:+.3f}]"
            + ("" if side(split) else ": not resolved, so the split adds nothing resolved")
        )
    if half_lr is not None:
        parts.append(
            f"Lopti at half the learning rate {half_lr[0]:+.3f} [{half_lr[1]:+.3f}, {half_lr[2]:+.3f}] against GRPO"
            + (
                ": halving the step removes the resolved effect, so it follows the movement per batch"
                if s != 0 and side(half_lr) == 0 and lr is not None and side(lr) == s
                else ""
            )
        )
    return "; ".join(parts) + "."


def mechanism_table(units: dict, runs: dict, evals, final: int, n_boot: int, order=ORDER):
    """Per method: the low bin's share of the update and token share, the top bin's correct ratio (A > 0,
    counterfactual step) with intervals over seeds and probed steps, the mean entropy of its samples over training
    (mean over seeds, their range), and its final accuracy."""
    import polars as pl

    from tokendyn.analysis import study as A

    bins = A.method_bins_table(units, n_boot) if units else pl.DataFrame()
    rows = []
    for method in [m for m in order if m in units]:
        row = {"method": method}
        b = bins.filter(pl.col("method") == method) if bins.height else bins
        if b.height:
            low, top = b.filter(pl.col("bin") == 0), b.filter(pl.col("bin") == b["bin"].max())
            for name, r, col in (("low_update_share", low, "update_share"), ("low_token_share", low, "token_share"),
                                 ("top_correct", top, "correct_pos")):  # fmt: skip
                if col in r.columns and r.height:
                    row[name], row[f"{name}_lo"], row[f"{name}_hi"] = (
                        r[col][0],
                        r[f"{col}_lo"][0],
                        r[f"{col}_hi"][0],
                    )
        ent = []
        for (m, _), d in runs.items():
            if m == method:
                e = pl.read_parquet(d / "metrics.parquet")
                if "entropy" in e.columns:
                    ent.append(float(e["entropy"].drop_nulls().mean()))
        if ent:
            row["entropy"], row["entropy_min"], row["entropy_max"] = float(np.mean(ent)), min(ent), max(ent)
        acc = evals.filter((pl.col("method") == method) & (pl.col("rollout") == final))
        if acc.height:
            row["accuracy"] = float(acc["correct"].mean())
        rows.append(row)
    return pl.DataFrame(rows) if rows else pl.DataFrame()


def write_llm_study(out: str | Path, size: LLMStudySize) -> Path:
    """Read every finished run under OUT, write OUT/tables/*.parquet, OUT/figures/*.png and OUT/study.md."""
    import polars as pl

    from tokendyn.analysis import seeds as S
    from tokendyn.analysis import study as A
    from tokendyn.figures.study import accuracy_curve_figure, difference_figure

    from .study_report import both_camps_section, save_report

    out = Path(out)
    runs, evals = load_finished(out, METHODS, "the study")
    acc = S.accuracy_over_seeds(evals, size.n_boot)
    trained = acc.filter(pl.col("method") != START)
    final = int(trained["rollout"].max())
    methods = [m for m in ORDER if any(k[0] == m for k in runs)]
    versus = [(m, "grpo") for m in methods if m != "grpo" and m not in SAME_AS_GRPO]
    diffs = pl.concat(
        [S.differences_table(evals, versus, r, size.n_boot) for r in sorted(set(trained["rollout"]) - {0})],
        how="vertical_relaxed",
    )
    controls = S.differences_table(evals, CONTROL_PAIRS, final, size.n_boot, PAPER_METHODS)
    units = {
        m: A.load_units({s: str(d) for (mm, s), d in runs.items() if mm == m})
        for m in methods
        if m not in SAME_AS_GRPO
    }
    mech = mechanism_table(units, runs, evals, final, size.n_boot)
    repro = A.reproduces_table(None, units, size.n_boot) if "grpo" in units else pl.DataFrame()
    if repro.height:  # its Fig. 3 rows are K&K accuracy: this study's accuracy is the sections above
        repro = repro.filter(~pl.col("phenomenon").str.starts_with("Fig. 3"))
    sweep_from = "grpo_camps" if "grpo_camps" in methods else "grpo"  # (the sweeps' runs, else GRPO's own)
    camps, guide, camp_figs = both_camps_section(
        {s: d for (m, s), d in sorted(runs.items()) if m == sweep_from}
    )
    same = same_training(evals, runs)
    per_seed = S.seed_accuracy_table(evals, final, ORDER)
    tables = {"evaluations": evals, "accuracy": acc, "differences": diffs, "controls": controls,
              "mechanism": mech, "reproduces": repro, "both_camps": camps, "guidance": guide,
              "seed_accuracy": per_seed}  # fmt: skip

    def draw(figs: Path) -> list[Path]:
        written = [accuracy_curve_figure(acc, figs / "accuracy.png")]
        if diffs.height:
            written.append(
                difference_figure(diffs.filter(pl.col("rollout") == final), figs / "differences.png")
            )
        return written + [f(figs) for f in camp_figs]

    markers = {k: read_marker(d) for k, d in runs.items()}
    budget = batch_words(run_records(runs))
    return save_report(out, tables, draw, lambda figs: _markdown(size, markers, acc, diffs, controls, mech, repro,
                                                                 camps, guide, final, figs, same, sweep_from, budget,
                                                                 per_seed))  # fmt: skip


def same_training(evals, runs: dict) -> list[tuple[int, bool]]:
    """Per seed with both a grpo and a grpo_camps run: whether their held-out outcomes are equal problem by problem
    at every evaluation (the comparisons made from the states are undone bitwise, so training is the same)."""
    import polars as pl

    out = []
    for seed in sorted(s for (m, s) in runs if m == "grpo_camps" and ("grpo", s) in runs):
        a, b = (evals.filter((pl.col("method") == m) & (pl.col("seed") == seed)).select("rollout", "problem", "correct")
                .sort("rollout", "problem") for m in ("grpo", "grpo_camps"))  # fmt: skip
        out.append((seed, a.equals(b)))
    return out


def _markdown(size, markers, acc, diffs, controls, mech, repro, camps, guide, final, figures, same=(),
              sweep_from="grpo", budget="", per_seed=None) -> str:  # fmt: skip
    import polars as pl

    from tokendyn.analysis.seeds import VERDICT_TEXT
    from tokendyn.analysis.study import VERDICT_RULE

    from .study_report import cost_section, document, guidance_section, seed_section

    lines = [
        "# Does it help? The seeded study on SmolLM2-135M-Instruct",
        "",
        f"Sums of {', '.join(map(str, size.digits))}-digit numbers; every method {size.rollouts} rollouts of "
        f"{budget} (as the runs' run.json recorded them); greedy held-out accuracy on the first {size.eval_n} "
        f"two-digit held-out sums every {size.eval_every} rollouts (the starting policy once). Probe every "
        f"{size.probe_every} rollouts, analyses on {size.probe_sample_sequences} sequences with a signal "
        f"(counterfactual steps in the {size.step_precision} dtype). Intervals: 95 %, {size.n_boot} two-stage "
        "bootstrap resamples (seeds, then problems within seeds; records: seeds, then probed steps).",
        "",
        *cost_section(markers, ORDER, CAMP, note=" Per method: seeds finished, mean wall time per run."),
        *heldout_section(acc),
        *seed_section(per_seed, final),
    ]
    grpo = acc.filter((pl.col("method") == "grpo") & (pl.col("rollout") == final)) if acc.height else acc
    if grpo.height and grpo["seeds"][0] < 2:
        lines += ["GRPO's across-seed spread: one seed so far, no spread yet.", ""]
    elif grpo.height:
        g = grpo.row(0, named=True)
        lines += [
            f"GRPO's across-seed spread after {final} rollouts: the {g['seeds']} seeds' accuracies range "
            f"{g['seed_min']:.3f}-{g['seed_max']:.3f} (sd {g['seed_sd']:.3f}).",
            "",
        ]
    lines += section("Each method minus GRPO", VERDICT_TEXT, table=diffs)
    if diffs.height:
        for r in diffs.filter(pl.col("rollout") == final).iter_rows(named=True):
            lines.append(
                f"- **{r['method']}** − GRPO after {final} rollouts: {r['difference']:+.3f} [{r['lo']:+.3f}, "
                f"{r['hi']:+.3f}] (seed-level t-interval [{r['t_lo']:+.3f}, {r['t_hi']:+.3f}], {r['agree']} seeds "
                f"agree, Holm p {r['p_holm']:.2g} in a family of {r['holm_m']}) over {r['seeds']} seeds: {r['verdict']}."
            )
        lines.append("")
    lines += section("Lopti's controls: its split, or its two steps per batch?",
                     "Columns and checks as in the table above; the Holm families here: the rows minus GRPO, and "
                     "each other base's own row.", table=controls,
                     empty="Lopti's and its controls' runs are not finished yet.")  # fmt: skip
    if controls.height:
        lines += [control_reading(controls), ""]
    lines += section(
        "The mechanism on the same runs",
        "Per method, from its probed steps (intervals over seeds, then probed steps): the [0, .25) bin's share of "
        "the update and of the tokens, the top bin's correct ratio (A > 0: share of rising tokens after the "
        "counterfactual step), the mean entropy of the sampled tokens over training (mean over seeds [range]), "
        "and the final accuracy.",
        table=mech,
    )
    if repro.height:
        lines += section("Figures 1-2: what reproduces (GRPO's runs)", VERDICT_RULE, table=repro)
    if same:
        equal = [s for s, ok in same if ok]
        lines += section(
            "GRPO trained twice",
            f"The grpo_camps runs retrain GRPO with the same seeds and make every rule of both camps from its probed "
            f"states; their held-out outcomes equal GRPO's problem by problem at every evaluation for "
            f"{len(equal)} of {len(same)} seeds ({', '.join(str(s) for s, _ in same)})"
            + (
                "."
                if len(equal) == len(same)
                else ": the comparisons are not free of side effects on training."
            ),
        )
    if camps is not None and camps.height:
        lines += section(f"Both camps from the GRPO runs' states ({sweep_from})", table=camps.drop("run"))
    lines += guidance_section(guide)
    return document(lines, figures)


def heldout_section(acc) -> list[str]:
    """Held-out accuracy per method and rollout, with its interval and the spread over seeds."""
    shown = acc.select("method", "rollout", "seeds", with_interval("accuracy [95 %]"), "seed_sd", "seed_min",
                       "seed_max") if acc.height else None  # fmt: skip
    return section("Held-out accuracy (two-digit sums, greedy)", table=shown)
