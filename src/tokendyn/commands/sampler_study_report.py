"""The sampler study's report from its finished run folders alone: `tokendyn study --policy smollm2-135m
--use_vllm --out DIR --report-only [--reference docs/study/llm]`.

The runs (`tokendyn.commands.llm_study.SAMPLER_METHODS`) sample with TRL's colocated vLLM engine; ``--reference`` is
the study whose runs sampled with the trainer's own float32 ``generate`` at the same seeds (GRPO, Reweight, Lopti).
Sections: what ran and what it cost; held-out accuracy; each method minus GRPO under the bf16 sampler with TRL's
correction (the baseline), with the paper's verdicts for the two remedies; the consistency rows (each vLLM GRPO minus
the generate-sampled GRPO at the same seeds); each remedy's effect under the sampler beside its effect under
``generate`` and their difference; the mechanism per method; the sampler's mismatch per pi_old bin (intervals over
seeds, then probed steps: `tokendyn.analysis.mismatch_seeds`) with the (1 - pi) slope and the share of each bin's
tokens in a sequence TRL's ``sequence_mask`` zeroed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .llm_study import CAMP, SAMPLER_BASELINE, SAMPLER_ORDER, LLMStudySize
from .llm_study_report import heldout_section, load_evals, load_finished, mechanism_table
from .study_engine import START, finished_runs, read_marker
from .study_identity import check_reference
from .study_report import cost_section, document, run_records, section, seed_section

# a remedy under the bf16 sampler -> the same remedy in the reference (generate-sampled) study
UNDER = {"reweight_vllm_bf16": "reweight", "lopti_vllm_bf16": "lopti"}
REFERENCE_METHODS = ("grpo", "reweight", "lopti")
CONSISTENCY = (("grpo_vllm_fp32", "grpo"), ("grpo_vllm_bf16", "grpo"), ("grpo_vllm_bf16_raw", "grpo"))


def reference_evals(reference: Path, seeds: set[int]):
    """The reference study's GRPO / Reweight / Lopti outcomes at the given seeds (its starting policy's rows
    included), or an empty frame."""
    import polars as pl

    from tokendyn.common import UsageError

    every = finished_runs(reference, REFERENCE_METHODS)
    if not every:
        raise UsageError(
            f"--reference: {str(reference)!r} holds no finished run of {', '.join(REFERENCE_METHODS)} "
            "(a study made by tokendyn study --policy smollm2-135m)"
        )
    runs = {k: d for k, d in every.items() if k[1] in seeds}
    if not runs:
        return {}, pl.DataFrame()
    evals = load_evals(reference, runs)
    return runs, evals.filter(pl.col("method") != START)


def remedies_table(evals, final: int, n_boot: int):
    """Per remedy: its accuracy effect under the bf16 sampler (minus GRPO bf16), under generate (minus GRPO in the
    reference), and the difference of the two, x[s, j] = (R_b - G_b)[s, j] - (R_g - G_g)[s, j], over the seeds all
    four share (two-stage interval)."""
    import polars as pl

    from tokendyn.analysis import seed_tests as T
    from tokendyn.analysis.seeds import hierarchical_interval, outcome_matrix, paired_difference

    rows = []
    for under, plain in UNDER.items():
        quads = [(under, SAMPLER_BASELINE), (plain, "grpo")]
        seeds = None
        for m in (under, SAMPLER_BASELINE, plain, "grpo"):
            found = set(outcome_matrix(evals, m, final)[0])
            seeds = found if seeds is None else seeds & found
        if not seeds:
            continue
        row = {"remedy": plain, "seeds": len(seeds)}
        for name, (m, ref) in zip(("under_vllm_bf16", "under_generate"), quads, strict=True):
            d, lo, hi, _ = paired_difference(evals, m, ref, final, n_boot)
            row[name], row[f"{name}_lo"], row[f"{name}_hi"] = d, lo, hi
        x = [
            outcome_matrix(evals, m, final, sorted(seeds))[1]
            for m in (under, SAMPLER_BASELINE, plain, "grpo")
        ]
        dx = (x[0] - x[1]) - (x[2] - x[3])
        if len(seeds) >= 2:
            d, lo, hi = hierarchical_interval(dx, n_boot)
        else:
            d, lo, hi = float(dx.mean()), float("nan"), float("nan")
        t = T.paired_t(dx.mean(axis=1))
        k, n = T.sign_agreement(dx.mean(axis=1))
        row.update(sampler_minus_generate=d, lo=lo, hi=hi, t_lo=t["lo"], t_hi=t["hi"], agree=f"{k}/{n}", k=k,
                   p=t["p"])  # fmt: skip
        rows.append(row)
    for row, p_holm in zip(rows, T.holm([r["p"] for r in rows]), strict=True):
        sides = T.check_sides(row["lo"], row["hi"], row["t_lo"], row["t_hi"], row["sampler_minus_generate"], p_holm,
                              row["k"], row["seeds"])  # fmt: skip
        agreed = T.agreed_side(sides) if row["seeds"] >= 2 else 0
        reading = (
            "no data"
            if not np.isfinite(row["lo"])
            else T.disagreement(sides, p_holm, row["k"], row["seeds"])
            if agreed is None
            else {1: "above 0", -1: "below 0", 0: "holds 0: no difference resolved"}[agreed]
        )
        row.update(p_holm=p_holm, reading=reading)  # fmt: skip
        del row["k"]
    return pl.DataFrame(rows) if rows else pl.DataFrame()


def mismatch_tables(runs: dict, n_boot: int):
    """Per method: the per-bin mismatch over seeds then probed steps, and the (1 - pi) slope."""
    import polars as pl

    from tokendyn.analysis.mismatch_seeds import mismatch_over_seeds, sampler_rows, slope_over_seeds

    tables, slopes = [], []
    for method in SAMPLER_ORDER:
        frames = {s: sampler_rows(d) for (m, s), d in sorted(runs.items()) if m == method}
        frames = {s: f for s, f in frames.items() if f.height}
        if not frames:
            continue
        t = mismatch_over_seeds(frames, n_boot=n_boot)
        tables.append(t.with_columns(pl.lit(method).alias("method")).select("method", *t.columns))
        s, lo, hi = slope_over_seeds(frames, n_boot)
        slopes.append({"method": method, "seeds": len(frames), "slope": s, "lo": lo, "hi": hi})
    table = pl.concat(tables, how="diagonal_relaxed") if tables else pl.DataFrame()
    return table, pl.DataFrame(slopes) if slopes else pl.DataFrame()


def mismatched_tables(runs: dict):
    """Why a remedy helps under the sampler (`tokendyn.analysis.sampler_mechanism`): from the baseline's runs, each
    rule's update carried by the mismatched tokens per bin minus GRPO's, from the same states; per method, the
    correlation of a sequence's importance weight with its advantage. Third value: the runs left out, with reasons."""
    import polars as pl

    from tokendyn.analysis.sampler_mechanism import carried_over_seeds, weight_reward_over_seeds

    of = lambda method: {s: d for (m, s), d in runs.items() if m == method}  # noqa: E731
    carried, excluded = carried_over_seeds(of(SAMPLER_BASELINE))
    excluded = [f"{SAMPLER_BASELINE} {e}" for e in excluded]
    weights = []
    for method in SAMPLER_ORDER:
        if not of(method):
            continue
        stats, left = weight_reward_over_seeds(of(method))
        excluded += [f"{method} {e} (weights)" for e in left]
        if stats:
            weights.append({"method": method, **stats})
    return carried, pl.DataFrame(weights) if weights else pl.DataFrame(), excluded


def write_sampler_study(out: str | Path, size: LLMStudySize, reference: str | Path | None = None) -> Path:
    """Read every finished sampler run under OUT (and the reference study's GRPO / Reweight / Lopti runs at the same
    seeds), write OUT/tables/*.parquet, OUT/figures/*.png and OUT/study.md."""
    import polars as pl

    from tokendyn.analysis import seeds as S
    from tokendyn.analysis import study as A
    from tokendyn.figures.study import accuracy_curve_figure, difference_figure

    from .study_report import save_report

    out = Path(out)
    runs, evals = load_finished(out, SAMPLER_ORDER, "the sampler study")
    seeds = {s for _, s in runs}
    ref_runs, ref_evals = (
        reference_evals(Path(reference), seeds) if reference is not None else ({}, pl.DataFrame())
    )
    check_reference(runs, ref_runs)  # the same task, budget and probe as this study's, else one line
    both = pl.concat([evals, ref_evals], how="vertical_relaxed") if ref_evals.height else evals
    acc = S.accuracy_over_seeds(both, size.n_boot)
    final = int(acc.filter(pl.col("method") != START)["rollout"].max())
    methods = [m for m in SAMPLER_ORDER if any(k[0] == m for k in runs)]
    effects = {m: S.PAPER_EFFECTS[p] for m, p in UNDER.items()}
    versus = [(m, SAMPLER_BASELINE) for m in methods if m != SAMPLER_BASELINE]
    diffs = pl.concat(
        [S.differences_table(both, versus, r, size.n_boot, tuple(UNDER), SAMPLER_BASELINE, effects)
         for r in sorted(set(acc["rollout"]) - {0})],
        how="vertical_relaxed",
    )  # fmt: skip
    consistency = S.differences_table(both, CONSISTENCY, final, size.n_boot, (), baseline=None)
    remedies = remedies_table(both, final, size.n_boot) if ref_evals.height else pl.DataFrame()
    units = {m: A.load_units({s: str(d) for (mm, s), d in runs.items() if mm == m}) for m in methods}
    units.update({m: A.load_units({s: str(d) for (mm, s), d in ref_runs.items() if mm == m})
                  for m in REFERENCE_METHODS if any(k[0] == m for k in ref_runs)})  # fmt: skip
    mech = mechanism_table(
        units, {**runs, **ref_runs}, both, final, size.n_boot, (*SAMPLER_ORDER, *REFERENCE_METHODS)
    )
    mismatch, slopes = mismatch_tables(runs, size.n_boot)
    per_seed = S.seed_accuracy_table(both, final, (*SAMPLER_ORDER, *REFERENCE_METHODS))
    carried, weights, left_out = mismatched_tables(runs)
    tables = {"evaluations": both, "accuracy": acc, "differences": diffs, "consistency": consistency,
              "remedies": remedies, "mechanism": mech, "mismatch": mismatch, "slopes": slopes,
              "seed_accuracy": per_seed, "mismatched": carried, "weights": weights}  # fmt: skip

    def draw(figs: Path) -> list[Path]:
        written = [accuracy_curve_figure(acc, figs / "accuracy.png")]
        if diffs.height:
            written.append(difference_figure(diffs.filter(pl.col("rollout") == final), figs / "differences.png",
                                             SAMPLER_BASELINE, "GRPO's (vLLM bf16, corrected)"))  # fmt: skip
        return written

    markers = {k: read_marker(d) for k, d in runs.items()}
    setup = setup_sentence(run_records(runs))
    floor = fp32_mismatch(mismatch)
    return save_report(out, tables, draw, lambda figs: _markdown(size, markers, acc, diffs, consistency, remedies,
                                                                 mech, mismatch, slopes, figs, reference, setup,
                                                                 floor, per_seed, final, (carried, weights,
                                                                 left_out)))  # fmt: skip


def setup_sentence(records: dict) -> str:
    """How the runs sampled and corrected, as their run.json recorded it (`study_report.recorded`)."""
    from .study_report import batch_words, recorded, say_recorded, trainer_dtype

    def r(*path, methods=None, fmt=str):
        return say_recorded(recorded(records, *path, methods=methods), fmt)

    switch = recorded(records, "config", "vllm_importance_sampling_correction")
    corrected, off = switch.get(True, []), switch.get(False, [])
    return (
        f"{batch_words(records)}. The rollouts are sampled by TRL's vLLM engine (mode {r('sampler', 'mode')}; "
        f"engine {r('sampler', 'engine')} {r('sampler', 'version')} on {r('sampler', 'device')}; enforce_eager "
        f"{r('sampler', 'enforce_eager')}) in {r('sampler', 'dtype')} against the {trainer_dtype(records)} "
        f"trainer. TRL's correction where on: {r('config', 'vllm_importance_sampling_mode', methods=corrected)}, "
        f"clip {r('config', 'vllm_importance_sampling_clip_max', methods=corrected, fmt=lambda v: f'{v:g}')}; "
        f"off in {', '.join(off) if off else 'no method'}"
        + (f"; not recorded in {', '.join(switch[None])}" if None in switch else "")
        + ". (As every run's run.json recorded them.)"
    )


def fp32_mismatch(mismatch) -> str:
    """The float32 engine's mean |log rho| over every probed token (bin -1 of the mismatch table), in words."""
    import polars as pl

    if not mismatch.height:
        return "not measured (no sampler records)"
    row = mismatch.filter((pl.col("method") == "grpo_vllm_fp32") & (pl.col("bin") == -1))
    if not row.height:
        return "not measured (no grpo_vllm_fp32 sampler records)"
    return f"mean |log rho| {row['abs_mean'][0]:.1e} nats over its probed tokens, the mismatch table below"


def _markdown(size, markers, acc, diffs, consistency, remedies, mech, mismatch, slopes, figures, reference,
              setup="", floor="", per_seed=None, final=None, why=None) -> str:  # fmt: skip
    from tokendyn.analysis.seeds import VERDICT_TEXT

    lines = [
        "# Does the sampler change the story? GRPO and the remedies under vLLM on SmolLM2-135M-Instruct",
        "",
        f"The seeded study's task and budget (docs/study/llm): sums of {', '.join(map(str, size.digits))}-digit "
        f"numbers, {size.rollouts} rollouts of {setup} Greedy held-out accuracy on the first "
        f"{size.eval_n} two-digit held-out sums every {size.eval_every} rollouts. Probe every "
        f"{size.probe_every} rollouts. Intervals: 95 %, {size.n_boot} two-stage bootstrap resamples (seeds, then "
        "problems; records: seeds, then probed steps)."
        + (
            f" Reference (generate-sampled runs at the same seeds): `{Path(reference).as_posix()}`."
            if reference
            else " No reference study given: the consistency and remedy rows are left out."
        ),  # fmt: skip
        "",
        *cost_section(markers, SAMPLER_ORDER, CAMP, column="what"),
        *heldout_section(acc),
        *seed_section(per_seed, final),
        *section(f"Each method minus GRPO under the sampler ({SAMPLER_BASELINE})", VERDICT_TEXT, table=diffs),
        *section(
            "Consistency: vLLM-sampled GRPO minus generate-sampled GRPO, same seeds",
            f"The float32 engine samples what the trainer would (its mismatch: {floor}): it should differ from "
            "the generate-sampled GRPO by nothing resolved. The bf16 rows are the sampler's own effect on GRPO. "
            "Columns and checks as above (the Holm family: these rows, all minus the generate-sampled GRPO); "
            "above 0 / below 0 only when all four checks agree, holds 0 when none resolves.",
            table=consistency,
            empty="No reference runs at these seeds yet.",
        ),
        *section(
            "Each remedy under the sampler against its effect under generate",
            "under_vllm_bf16: the remedy minus GRPO, both sampled by vLLM in bf16 with TRL's correction; "
            "under_generate: the remedy minus GRPO in the reference study; sampler_minus_generate: the first minus "
            "the second, paired by seed and problem; its seed-level t-interval (t_lo, t_hi), seeds agreeing in "
            "sign, and p Holm-adjusted across these rows (the remedies), read as above.",
            table=remedies,
            empty="No pair with both sides finished yet.",
        ),
        *section(
            "The mechanism on the same runs",
            "Per method, from its probed steps: the [0, .25) bin's share of the update and of the tokens, the top "
            "bin's correct ratio (A > 0), the mean entropy of its samples and the final accuracy (generate-sampled "
            "rows from the reference at the same seeds).",
            table=mech,
        ),
    ]
    cols = ["method", "bin", "seeds", "steps", "count", "abs_mean", "abs_mean_lo", "abs_mean_hi", "mean_log_rho",
            "mean_log_rho_lo", "mean_log_rho_hi", "frac_seq_masked", "frac_seq_masked_lo", "frac_seq_masked_hi",
            "per_one_minus_pi", "abs_p99", "envelope"]  # fmt: skip
    lines += section(
        "The sampler's mismatch per pi_old bin",
        "Per method, every token of the probed micro-batches (`sampler` records; log rho = log pi_old - log mu): "
        "mean |log rho| and signed mean log rho, the share of tokens in a sequence TRL's sequence_mask zeroed, mean "
        "|log rho| per unit of (1 - pi_old), with intervals over seeds then probed steps; pooled p99 and the envelope "
        "max |log rho| / (1 - pi_old). Bin -1 is every token.",
        table=mismatch.select([c for c in cols if c in mismatch.columns]) if mismatch.height else None,
    )
    if slopes.height:
        from tokendyn.analysis.study import markdown

        lines += [
            "The (1 - pi) law: least-squares slope of |log rho| on 1 - pi_old through 0, per method.",
            "",
            markdown(slopes),
            "",
        ]
    if why is not None:
        lines += why_section(*why)
    return document(lines, figures)


def why_section(carried, weights, left_out) -> list[str]:
    """The mechanism from the records: the mismatched tokens' update under each rule, the weight against reward."""
    lines = section(
        "Does a remedy take weight off the mismatched tokens?",
        f"From each {SAMPLER_BASELINE} run's probed states, at the token view's tokens with |log rho| > log 1.1: the "
        "update they carry under each rule's update from the same state (the rules at equal size), per pi_old bin, "
        "minus GRPO's own (minus_base); mean over seeds with the seed-level t-interval (t_lo, t_hi) and the seeds "
        "agreeing in sign. A bin with no mismatched token reads 0.",
        table=carried,
        empty="No run with the sampler's log rho in its token view and rules compared from its states yet.",
    )
    lines += section(
        "Does the correction take weight from the sequences that carry the reward?",
        "Per method: the Pearson r of a sequence's importance weight (0 when masked) with its advantage over the "
        "sequences with a signal of each run's probed steps; mean over seeds with the seed-level t-interval and the "
        "seeds agreeing in sign; removed_pos / removed_neg: the mean of 1 - weight among positive / negative "
        "advantages (negative: weight added).",
        table=weights,
        empty="No run with importance weights and a signal yet.",
    )
    if left_out:
        lines += ["Runs left out of these two tables:", "", *[f"- {e}" for e in left_out], ""]
    return lines
