"""The seeded study on a real LLM: does a remedy help, over training seeds? `tokendyn study --policy smollm2-135m`.

Every method trains from the same policy (SmolLM2-135M-Instruct) on sums of one- and two-digit numbers with the same
budget (``rollouts`` rollout batches of 8 prompts x 4 samples, lr 1e-5, the real-LLM demo's settings), once per
training seed; greedy accuracy on the fixed 200 two-digit held-out sums every ``eval_every`` rollouts (the starting
policy once: greedy decoding of one policy is one result). The methods:

* the paper's: GRPO, +Reweight (alpha 0.3), +Lopti (eta 0.5);
* Lopti's two controls, which tell its split from its two optimizer steps per rollout batch: GRPO over two stages on
  random halves of the tokens (``random_halves``: Lopti's step count, no split by pi), and Lopti at half the learning
  rate (with Adam two steps move about twice as far as one);
* the camp that protects low-probability tokens, with the rules that act at r = 1: the Delta-log-p reweight (c 0.2),
  W-REINFORCE (lambda 0.1), and DPPO-TV with two updates per rollout batch (``num_iterations`` 2) so that it can
  differ from GRPO;
* ``grpo_camps``: GRPO trained again with the same seeds, its probed states also making every rule of both camps
  and the c / eta sweeps (``BOTH_CAMPS``, at the comparison lr ``CAMPS_LR``; too slow to run in every GRPO run):
  the both-camps table and the guidance come from these runs, and their accuracy, which must equal grpo's seed by
  seed, checks that the comparisons left training untouched.

Each run is probed every ``probe_every`` rollouts (the recorder, and ``analyses`` on the first
``probe_sample_sequences`` sequences with a signal, counterfactual steps in the model's dtype: on this model they
agree with float64 steps to 1.5e-3 of a bin's mean |dpi|, every sign equal, as measured); the GRPO runs
also compare, from their own states, Reweight's and Lopti's update with theirs and (``both_camps``) every rule of
both camps and the c / eta sweeps.

Files. The study engine makes the runs (`tokendyn.commands.study_engine`, the specs ``LLM`` and, for the sampler
mode, ``SAMPLER``): a run trains in ``WORK/{method}-s{seed}`` (weights; removed when it ends) and its results, small
files only (run.json, metrics, every held-out problem's outcome, the probe's records), are copied into
``OUT/runs/{method}-s{seed}`` with ``study_done.json`` written last: a run whose folder holds it is skipped, an
unfinished one starts over, so the study survives a stop and continues on another machine from the committed
folders. ``write_llm_study`` (``--report-only``) writes the tables, figures and study.md from those folders alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from tokendyn.common import UsageError

from .study_engine import BOTH_CAMPS, START, StudySpec, run_study

LR = 1e-5  # the real-LLM demo's learning rate (GRPO: held-out 0.19 -> 0.75 in 30 rollouts)
# the both-camps comparison's SGD lr (k = 2 updates per rule): at the paper's 1e-3 the second update left the local
# regime on this model (loss 230x the first's, then NaN: `tokendyn.effects.compare`), at 1e-4 every rule landed within
# 3 % of the equal norm at once, with max |dpi| 0.3 (measured on grpo_camps seed 0's first probed state)
CAMPS_LR = 1e-4
# method -> fields of TokendynGRPOConfig on top of the study's trainer settings
METHODS: dict[str, dict] = {
    "grpo": {},
    "reweight": {"advantage_reweight_alpha": 0.3},
    "lopti": {"lopti_eta": 0.5},
    "random_halves": {"random_halves": True},
    "lopti_half_lr": {"lopti_eta": 0.5, "learning_rate": LR / 2},
    "logp_reweight": {"logp_reweight_c": 0.2},
    "w_reinforce": {"advantage_estimator": "w_reinforce", "w_reinforce_lambda": 0.1},
    "dppo_tv": {"policy_loss": "dppo_tv", "num_iterations": 2},
    # GRPO again, its probed states also making every rule of both camps and the c / eta sweeps (BOTH_CAMPS): the
    # same training as grpo's (the comparisons are undone bitwise), so its accuracy is a check of that
    "grpo_camps": {},
}
# the sampler mode (`--sampler vllm`): the same budget, rollouts sampled by TRL's colocated vLLM engine (eager, one
# engine per run) in bf16 or float32 against the float32 trainer; TRL's default correction (sequence_mask, clip 3)
# unless the method switches it off
VLLM = {"use_vllm": True, "vllm_mode": "colocate", "vllm_enforce_eager": True}
SAMPLER_METHODS: dict[str, dict] = {
    "grpo_vllm_bf16": {**VLLM, "vllm_dtype": "bfloat16"},
    "grpo_vllm_bf16_raw": {**VLLM, "vllm_dtype": "bfloat16", "vllm_importance_sampling_correction": False},
    "grpo_vllm_fp32": {**VLLM, "vllm_dtype": "float32"},
    "grpo_vllm_fp16": {**VLLM, "vllm_dtype": "float16"},  # the FP16 paper's sampler dtype (arXiv 2510.26788)
    "reweight_vllm_bf16": {**VLLM, "vllm_dtype": "bfloat16", "advantage_reweight_alpha": 0.3},
    "lopti_vllm_bf16": {**VLLM, "vllm_dtype": "bfloat16", "lopti_eta": 0.5},
}
METHODS.update(SAMPLER_METHODS)
CAMP = {
    "grpo": "baseline",
    "reweight": "tames (the paper)",
    "lopti": "tames (the paper)",
    "random_halves": "control of Lopti: its two steps, no split",
    "lopti_half_lr": "control of Lopti: half the learning rate",
    "logp_reweight": "protects",
    "w_reinforce": "other (W-REINFORCE)",
    "dppo_tv": "protects",
    "grpo_camps": "baseline again: both camps swept from its states",
    "grpo_vllm_bf16": "baseline under the sampler: vLLM bf16, TRL's sequence_mask",
    "grpo_vllm_bf16_raw": "vLLM bf16, no correction",
    "grpo_vllm_fp32": "control: vLLM float32 (no mismatch to speak of)",
    "grpo_vllm_fp16": "vLLM float16 (the FP16 paper's dtype), float32 trainer, sequence_mask",
    "reweight_vllm_bf16": "tames (the paper), vLLM bf16, sequence_mask",
    "lopti_vllm_bf16": "tames (the paper), vLLM bf16, sequence_mask",
}
# the paper's remedies: their sign is the paper's claim (reproduced / reversed); the others are better / worse
PAPER_METHODS = ("reweight", "lopti")
TRAINER = dict(learning_rate=LR, per_device_train_batch_size=32, num_generations=4, steps_per_generation=1,
               max_completion_length=16)  # fmt: skip


@dataclass(frozen=True)
class LLMStudySize:
    """How much the study trains and measures."""

    methods: tuple[str, ...]
    seeds: tuple[int, ...]
    rollouts: int  # rollout batches per run (every method the same)
    eval_every: int  # held-out evaluation every this many rollouts (and at the end)
    eval_n: int  # held-out two-digit sums (the fixed split's first eval_n)
    probe_every: int  # rollouts between probed rollouts (0: no probe)
    probe_sample_sequences: int  # sequences with a signal the analyses take
    # the GRPO runs also compare every rule of both camps and sweep c and eta (off in FULL: on the real LLM one
    # probed step of it took over 7 minutes on one thread, as long as a whole run; the sweep is made from regenerated
    # GRPO states instead)
    both_camps: bool = False
    step_precision: str = "model"  # the analyses' counterfactual steps (tokendyn.config.STEP_PRECISIONS)
    # the analyses the runs make: what the mechanism table and the claim table read (shares, the counterfactual
    # correct ratios, the influence matrix); the per-token JVP shares and the real change are left out
    analyses: tuple[str, ...] = ("shares", "prob_change", "influence")
    digits: tuple[int, ...] = (1, 2)  # operand digits trained on
    eval_digits: tuple[int, ...] = (2,)
    n_boot: int = 4000


# the order runs are made in: the paper's question and Lopti's controls seed by seed first (a stop leaves whole
# seeds of them), then GRPO again for the both-camps sweep and the other camp
ORDER = (
    "grpo",
    "lopti",
    "random_halves",
    "lopti_half_lr",
    "reweight",
    "grpo_camps",
    "logp_reweight",
    "w_reinforce",
    "dppo_tv",
)
# the sampler mode's runs, seed by seed; its baseline is the first
SAMPLER_ORDER = tuple(SAMPLER_METHODS)
SAMPLER_BASELINE = "grpo_vllm_bf16"
# GRPO's own runs and the runs that retrain it for the sweep: the same training, so not a method to compare
SAME_AS_GRPO = ("grpo_camps",)
# budget (measured on one CPU thread, two runs at a time): a GRPO rollout ~57 s, a two-step rollout (Lopti, its
# controls, DPPO-TV) ~110-140 s, the analyses of a probed rollout on 8 sequences ~130 s, an evaluation of the 200
# sums ~48 s: a GRPO run ~13 min, a two-step run ~20 min, the 32 runs ~9 h of one thread (~4.5 h on two)
FULL = LLMStudySize(methods=ORDER, seeds=(0, 1, 2, 3), rollouts=8, eval_every=4, eval_n=200, probe_every=4,
                    probe_sample_sequences=8)  # fmt: skip
# a smoke-test size on the embedded default (the test suite), the same code path
QUICK = LLMStudySize(methods=("grpo", "lopti", "random_halves"), seeds=(0, 1), rollouts=1, eval_every=1, eval_n=4,
                     probe_every=1, probe_sample_sequences=4, both_camps=False, n_boot=200)  # fmt: skip
# the sampler mode at those sizes: every sampler method
SAMPLER_FULL = replace(FULL, methods=SAMPLER_ORDER)
SAMPLER_QUICK = replace(QUICK, methods=("grpo_vllm_bf16", "lopti_vllm_bf16"), seeds=(0,))


def _check(size: LLMStudySize) -> None:
    from tokendyn.tasks.arith.generator import HELDOUT_SIZE
    from tokendyn.vocab import ANALYSES, STEP_PRECISIONS

    if size.eval_every < 1:
        raise UsageError(f"eval_every: must be an integer >= 1, got {size.eval_every}")
    top = min(HELDOUT_SIZE[d] for d in size.eval_digits)
    if not 1 <= size.eval_n <= top:
        raise UsageError(f"eval_n: must be in 1..{top} (the held-out split), got {size.eval_n}")
    if not size.analyses or any(a not in ANALYSES for a in size.analyses):
        raise UsageError(f"analyses: names from {', '.join(ANALYSES)}, got {list(size.analyses)}")
    if size.step_precision not in STEP_PRECISIONS:
        raise UsageError(f"step_precision: one of {', '.join(STEP_PRECISIONS)}, got {size.step_precision!r}")


def _check_generate(size: LLMStudySize) -> None:
    """The study sampled by ``generate``: no method of the sampler mode (they would train vLLM runs into this
    study's folder)."""
    _check(size)
    vllm = [m for m in size.methods if m in SAMPLER_METHODS]
    if vllm:
        raise UsageError(
            f"methods: {', '.join(vllm)} sample with vLLM: give --use_vllm (without it: one of "
            f"{', '.join(m for m in METHODS if m not in SAMPLER_METHODS)})"
        )


def _check_sampler(size: LLMStudySize) -> None:
    """The sampler mode: its own methods only (the generate-sampled ones are its reference study's)."""
    _check(size)
    plain = [m for m in size.methods if m not in SAMPLER_METHODS]
    if plain:
        raise UsageError(
            f"methods: with --use_vllm one of {', '.join(SAMPLER_METHODS)}, got {', '.join(plain)} (a "
            "generate-sampled method: leave out --use_vllm)"
        )


def _settings(size: LLMStudySize) -> tuple[dict, dict]:
    """Sums of the trained digits, greedy held-out evaluations every ``eval_every`` rollouts, the study's trainer
    settings and the analyses' own."""
    run = {"task": "arith", "arith_digits": list(size.digits), "arith_eval_digits": list(size.eval_digits),
           "eval_n": size.eval_n}  # fmt: skip
    fields = {**TRAINER, "eval_steps": size.eval_every, "probe_step_precision": size.step_precision,
              "probe_analyses": list(size.analyses), "disable_tqdm": True}  # fmt: skip
    return run, fields


def _evaluate(trained: Path, method: str, seed: int, size: LLMStudySize, cfg):
    """The run's per-problem outcomes with the rollout each evaluation followed: (method, seed, rollout, digits,
    problem, correct)."""
    import polars as pl

    from tokendyn.trainers.runner import optimizer_steps_per_rollout

    df = pl.read_parquet(trained / "heldout.parquet")
    return df.select(
        pl.lit(method).alias("method"),
        pl.lit(seed).alias("seed"),
        (pl.col("step") // optimizer_steps_per_rollout(cfg)).alias("rollout"),
        "digits",
        "problem",
        pl.col("correct").cast(pl.Int8),
    ).sort("rollout", "digits", "problem")


def _evaluate_start(model: str | None, size: LLMStudySize, seed: int):
    """The starting policy's greedy outcomes on the held-out sums (rollout 0 of every method and seed)."""
    import polars as pl
    import torch

    from tokendyn.policy import default_policy_dir, load_policy
    from tokendyn.trainers.arith_eval import arith_outcomes

    policy, tok = load_policy(model or str(default_policy_dir()), dtype=torch.float32)
    rows = arith_outcomes(policy, tok, list(size.eval_digits), size.eval_n)
    return pl.DataFrame(
        [{"method": START, "seed": seed, "rollout": 0, "digits": r["digits"], "problem": r["problem"],
          "correct": int(r["correct"])} for r in rows]
    ).with_columns(pl.col("correct").cast(pl.Int8))  # fmt: skip


LLM = StudySpec(
    methods=METHODS,
    full=FULL,
    quick=QUICK,
    settings=_settings,
    check=_check_generate,
    evaluate=_evaluate,
    evaluate_start=_evaluate_start,
    order=(*ORDER, *SAMPLER_ORDER),
    seed_major=(*ORDER[:5], *SAMPLER_ORDER),  # the paper's question and Lopti's controls, the sampler's runs
    baselines=("grpo", SAMPLER_BASELINE, *SAME_AS_GRPO),
    sweeps=SAME_AS_GRPO,
    camps_fields={**BOTH_CAMPS, "probe_compare_lr": CAMPS_LR},
    results_only=True,
    min_probe_every=0,
    optional=("overrides",),
    model_field="--policy",
    default_out="runs/study-llm",
    default_work="runs/llm-study-work",
)
# the sampler mode: the same runs, its own sizes (every sampler method), folder and report
SAMPLER = replace(
    LLM, full=SAMPLER_FULL, quick=SAMPLER_QUICK, check=_check_sampler, default_out="runs/study-llm-vllm"
)


def llm_study(
    out_dir: str | os.PathLike,
    size: LLMStudySize = FULL,
    *,
    model: str | None = "smollm2-135m",
    work_dir: str | os.PathLike | None = None,
    say: Callable[[str], None] | None = None,
) -> Path:
    """Train every (method, seed) of ``size`` not finished yet (results into OUT/runs, weights in WORK, default
    runs/llm-study-work) and evaluate the starting policy once (OUT/start); returns OUT. The report:
    `tokendyn.commands.llm_study_report.write_llm_study`."""
    return run_study(LLM, out_dir, size, model=model, work_dir=work_dir, say=say)
