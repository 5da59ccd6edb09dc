"""Every threshold the diagnosis judges against, with where it comes from: one table, no number elsewhere.

A `Threshold` reads a measured value x with its interval [lo, hi] (`tokendyn.analysis.diagnosis.finding.judge`):
with ``higher_is_worse``, act when lo >= act (resolved beyond it; x >= act without an interval), watch when x >= watch,
else fine; the other direction mirrors it. ``act`` None: the finding never asks to act.

The flags of `TRY` are each stack's own spelling of what to try: TRL (`tokendyn train`), verl (`main_ppo` overrides
with the tokendyn plugin), and an offline `tokendyn probe` run (which trains nothing: what to change in the stack that
produced the rollouts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Threshold:
    """watch / act levels of one measured quantity, its unit, and the source of each level."""

    name: str
    unit: str
    watch: float | None
    act: float | None
    higher_is_worse: bool
    source: str


# the sampler's mismatch: the float32 engine's level and the field's alarm
FLOAT32_ENGINE = 1e-4  # nats
NEMO_ALARM = math.log(1.05)  # nats: token_mult_prob_error 1.05
FLOOR_FACTOR = 100.0

THRESHOLDS: dict[str, Threshold] = {
    t.name: t
    for t in (
        Threshold(
            "dominance",
            "update share / token share of the [0, .25) bin",
            1.5,
            3.0,
            True,
            "paper Fig. 1(a, d): the [0, .25) bin holds 19.2 % of the tokens and ||g_low|| / ||g|| = 0.71 / 0.82 = "
            "0.87 of the update, 4.5x its share: the state the paper's remedies are built for. act at 3x (two "
            "thirds of it, resolved), watch at 1.5x (tool's choice: half again a token's fair share)",
        ),
        Threshold(
            "mismatch",
            "mean |log rho| (nats)",
            FLOAT32_ENGINE,
            NEMO_ALARM,
            True,
            "act: NeMo-RL#1767, token_mult_prob_error > 1.05 means investigate (log 1.05 = 0.049 nats); watch: "
            "docs/results.md, the float32 vLLM engine's mean |log rho| <= 7.9e-6 in every pi_old bin over the "
            "study's 8 seeds, 1e-4 is 10x that (or 100x the run's own floor where it is larger: the float32 engine "
            "sat at 7-16x the trainer's floor)",
        ),
        Threshold(
            "slope",
            "least-squares slope of |log rho| on 1 - pi_old (nats)",
            FLOAT32_ENGINE,
            NEMO_ALARM,
            True,
            "the slope is |log rho| at 1 - pi = 1 (the (1 - pi) law, DVP arXiv 2512.23087), judged as the mismatch: "
            "docs/results.md measured 0.124 [0.100, 0.163] for a bf16 vLLM engine, 9.5e-6 for a float32 one",
        ),
        Threshold(
            "masked",
            "share of tokens whose importance weight the correction zeroed",
            0.01,
            0.10,
            True,
            "watch: docs/results.md, TRL's sequence_mask zeroed 0.1 % [0, 0.4 %] of GRPO's tokens in the vLLM "
            "study (Lopti's 0.3 %): 1 % is above that range; act: tool's choice, a tenth of the batch trains on "
            "nothing",
        ),
        Threshold(
            "masked_update",
            "share of the uncorrected update that the correction's mask removes",
            0.01,
            0.10,
            True,
            "docs/results.md measured 0 in every bin (the masked sequences carried no signal); the levels are the "
            "token share's (tool's choice)",
        ),
        Threshold(
            "truncation",
            "sampling filters switched on (top_p < 1, top_k > 0, min_p > 0, repetition_penalty != 1)",
            1.0,
            None,
            True,
            "the engine renormalises its log-prob over the kept tokens: log S (the kept mass) enters log rho "
            "(docs/definitions.md, the sampler); the records do not hold log S apart, so it is watched, not judged",
        ),
        Threshold(
            "bound_violations",
            "tokens outside the exact (1 - pi) bound",
            None,
            1.0,
            True,
            "the bound is exact (docs/definitions.md): sqrt(V/(V-1)) <= ||dl/dz|| / (|w| (1 - pi)) <= sqrt(2) at the "
            "logits, <= sqrt(2) sigma_max(W) / T at the LM head's input; one violation beyond float tolerance is a "
            "wrong gradient or a wrong recording",
        ),
        Threshold(
            "envelope",
            "largest measured ratio over its bound (1 = at the bound)",
            None,
            None,
            True,
            "the bound itself: the ratio reaches sqrt(2) only for a token whose rest of the distribution sits on "
            "one other token; informational",
        ),
        Threshold(
            "top_bin_tokens",
            "share of tokens in [.75, 1] at the last probed steps",
            0.90,
            0.97,
            True,
            "paper Fig. 1(a): 60.5 % of the tokens lie in [.75, 1] at the start of training (Qwen2.5-7B); at 90 % "
            "(tool's choice) nearly every token's gradient is scaled by 1 - pi <= .25 and the few low tokens carry "
            "the update; 97 %: the sampled tokens are nearly deterministic",
        ),
        Threshold(
            "entropy_ratio",
            "mean entropy of the last quarter of logged steps / of the first quarter",
            0.5,
            0.2,
            False,
            "entropy collapse (Cui et al., arXiv 2505.22617: performance saturates as the policy's entropy is "
            "spent); the levels, half and a fifth of the start, are the tool's choice",
        ),
        Threshold(
            "remedy",
            "change of the [0, .25) bin's update share under the rule, minus the base rule's (from the same states)",
            None,
            None,
            False,
            "the paired comparison (docs/definitions.md): resolved when its interval excludes 0; act when it "
            "lowers a dominance that says act; docs/results.md found neither remedy resolvable on SmolLM2-135M",
        ),
        Threshold(
            "unreached",
            "scored tokens whose backward never reached a probed point, plus non-finite norms",
            None,
            1.0,
            True,
            "the probe's own invariant (docs/records.md, `bound.unreached`: an error)",
        ),
        Threshold(
            "unresolved",
            "counterfactual steps not resolved in their dtype, diverged paired rules, disagreeing precision checks",
            1.0,
            None,
            True,
            "docs/records.md: step_resolved is false when rounding could take more than 1e-3 of the step; such a "
            "step's Δpi is not a measurement of the update",
        ),
        Threshold(
            "checks_off",
            "conditions that switched a check off for the run (`notes`)",
            1.0,
            None,
            True,
            "docs/records.md, `notes`: each condition (a scaled or unrecognised LM head, an entropy bonus on a "
            "sharded head, final_norm.out not probed) turns a check off; a check not made is not a check passed",
        ),
        Threshold(
            "skipped",
            "share of probed steps whose analyses were skipped (no signal in the sample)",
            0.25,
            1.0,
            True,
            "tool's choice: a quarter of the probed steps without analyses thins every interval; all of them "
            "leaves the shares unmeasured",
        ),
        Threshold(
            "checked",
            "share of micro-batches whose exact checks ran (the rest skipped by the check budget)",
            None,
            None,
            False,
            "the check budget (--probe_check_budget) skips micro-batches by design; none checked at all is "
            "reported as not measured",
        ),
        Threshold(
            "spikes",
            "probed steps whose gradient norm, max |log rho| or importance weight exceeded k x its running median",
            1.0,
            None,
            True,
            "tool's choice: one spiking step is worth a look at its tokens (a gradient-norm spike is what GradLoc "
            "searches culprit tokens for); a spike alone never asks to act",
        ),
    )
}

# what to try, per stack: {key: {"trl": flag, "verl": override, "probe": hint}}
TRY: dict[str, dict[str, str]] = {
    "dominance": {
        "trl": "--advantage_reweight_alpha 0.3 (or --lopti_eta 0.5)",
        "verl": "+actor_rollout_ref.actor.policy_loss.reweight_alpha=0.3",
        "probe": "tokendyn probe ... --compare_rules base reweight lopti (what each would do from these states)",
    },
    "sampler_dtype": {
        "trl": "--vllm_dtype float32",
        "verl": "actor_rollout_ref.rollout.dtype=float32",
        "probe": "sample the rollouts with a float32 engine",
    },
    "correction": {
        "trl": "--vllm_importance_sampling_mode token_truncate (a token-level correction masks less)",
        "verl": "algorithm.rollout_correction.rollout_is=token",
        "probe": "a token-level importance correction in the training stack",
    },
    "truncation": {
        "trl": "--top_p 1.0 --top_k 0 --min_p 0 --repetition_penalty 1.0",
        "verl": "actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.top_k=-1",
        "probe": "sample without top-p / top-k / min-p / repetition penalty",
    },
    "entropy": {
        "trl": "--lopti_eta 0.5 (or a smaller --learning_rate)",
        "verl": "+actor_rollout_ref.actor.policy_loss.lopti_eta=0.5",
        "probe": "a smaller learning rate in the training stack",
    },
    "remedy_reweight": {
        "trl": "--advantage_reweight_alpha 0.3",
        "verl": "+actor_rollout_ref.actor.policy_loss.reweight_alpha=0.3",
        "probe": "Reweight (alpha 0.3) in the training stack",
    },
    "remedy_lopti": {
        "trl": "--lopti_eta 0.5",
        "verl": "+actor_rollout_ref.actor.policy_loss.lopti_eta=0.5",
        "probe": "Lopti (eta 0.5) in the training stack",
    },
    "measure_remedies": {
        "trl": "--probe_compare_rules base reweight lopti",
        "verl": "+actor_rollout_ref.actor.policy_loss.probe_options.compare_rules=[base,reweight,lopti]",
        "probe": "tokendyn probe ... --compare_rules base reweight lopti",
    },
    "smaller_step": {
        "trl": "--probe_step_precision float64",
        "verl": "+actor_rollout_ref.actor.policy_loss.probe_options.step_precision=float64",
        "probe": "tokendyn probe ... --step_precision float64",
    },
    "more_signal": {
        "trl": "--probe_sample_sequences 16 (more sequences in the analysis sample)",
        "verl": "+actor_rollout_ref.actor.policy_loss.probe_options.sample_sequences=16",
        "probe": "more rows with a non-zero advantage in the rollouts file",
    },
}


def try_flag(key: str, stack: str) -> str:
    """The flag of ``TRY[key]`` in ``stack``'s spelling (TRL's when the stack is not one of TRY's)."""
    flags = TRY[key]
    return flags.get(stack, flags["trl"])
