"""The schema of every record kind (polars only): kind -> column -> dtype. `tokendyn.records` writes and reads the
files; a leaf, so the readers and the writers share one definition."""

from __future__ import annotations

import polars as pl

_KEY = {"step": pl.Int64, "stage": pl.Utf8, "rank": pl.Int32, "micro": pl.Int32}


_REBALANCE_KEY = {"step": pl.Int64, "stage": pl.Utf8}


_CORRECT = {
    "n_pos": pl.Int64,
    "n_neg": pl.Int64,
    "tie_pos": pl.Int64,
    "tie_neg": pl.Int64,
    "correct_pos": pl.Float64,
    "correct_neg": pl.Float64,
    "correct_pooled": pl.Float64,
}


# the distribution of delta pi over a set of tokens (tokendyn.effects.change.delta_summary), then the correct ratios
_DELTA = {
    "count": pl.Int64,
    "mean": pl.Float64,
    "std": pl.Float64,
    "mean_abs": pl.Float64,
    "min": pl.Float64,
    **{f"q{q:02d}": pl.Float64 for q in (1, 5, 25, 50, 75, 95, 99)},
    "max": pl.Float64,
    **_CORRECT,
}


# how finely a counterfactual step was resolved (tokendyn.effects.resolution.Resolution): ||dtheta||, the dtype the
# parameters held during the step, the largest fraction of the step their rounding could take, and whether that is
# within STEP_ROUNDING_LIMIT; no_update: the step carried no policy-gradient signal (its measurements null); all
# null for a real update (and no_update for records written before it was recorded)
_RESOLUTION = {
    "step_norm": pl.Float64,
    "step_dtype": pl.Utf8,
    "step_rounding": pl.Float64,
    "step_resolved": pl.Boolean,
    "no_update": pl.Boolean,
}


# the sampler's columns, per token of a probed micro-batch (the `sampler` and `floor` kinds)
_SAMPLER_COLUMNS = {
    **_KEY,
    "row": pl.Int32,
    "pos": pl.Int32,
    "logp_old": pl.Float64,
    "logp_sampler": pl.Float64,
    "log_rho": pl.Float64,
    "is_weight": pl.Float64,
    "seq_masked": pl.Boolean,
    # a truncated / penalised sampler (TRL + vLLM's processed log-probs): log S, the kept mass under the trainer's
    # distribution, and log rho with the processing's shift removed (`tokendyn.hooks.kept_mass`); null without
    # processing, in the floor, and where no trainer logits were at hand (verl, the offline probe)
    "log_kept": pl.Float64,
    "log_rho_precision": pl.Float64,
}


SCHEMAS: dict[str, dict[str, pl.DataType]] = {
    # per (step, stage, rank, micro, point, bin, quantity); quantity in norm | norm_per_w | ratio
    "binstats": {
        **_KEY,
        "point": pl.Utf8,
        "point_index": pl.Int32,
        "bin": pl.Int32,
        "bin_lo": pl.Float64,
        "bin_hi": pl.Float64,
        "quantity": pl.Utf8,
        "count": pl.Int64,
        "sum": pl.Float64,
        "sumsq": pl.Float64,
        "min": pl.Float64,
        "max": pl.Float64,
        "nonfinite": pl.Int64,
    },
    # non-empty cells of the log-spaced histogram of each quantity
    "hist": {
        **_KEY,
        "point": pl.Utf8,
        "bin": pl.Int32,
        "quantity": pl.Utf8,
        "cell": pl.Int32,
        "lo": pl.Float64,
        "hi": pl.Float64,
        "count": pl.Int64,
    },
    # per point: envelope of ratio = ||delta|| / (|w| (1 - pi)) and spearman(||delta|| / |w|, 1 - pi);
    # unreached = the scored tokens of a micro-batch whose backward never delivered this point's gradient (an error)
    "bound": {
        **_KEY,
        "point": pl.Utf8,
        "point_index": pl.Int32,
        "n": pl.Int64,
        "ratio_min": pl.Float64,
        "ratio_max": pl.Float64,
        "spearman": pl.Float64,
        "nonfinite": pl.Int64,
        "unreached": pl.Int64,
        "direct_n": pl.Int64,
        "direct_ratio_min": pl.Float64,
        "direct_ratio_max": pl.Float64,
        "direct_spearman": pl.Float64,
    },
    # the exact checks at the LM head and the logits
    "checks": {
        **_KEY,
        "vocab_size": pl.Int64,
        "temperature": pl.Float64,
        "grad_dtype": pl.Utf8,
        "head_dtype": pl.Utf8,
        "identity_rounded": pl.Boolean,
        "entropy_term": pl.Boolean,
        "n_checked": pl.Int64,
        "identity_n": pl.Int64,
        "identity_max_rel_err": pl.Float64,
        "identity_mean_rel_err": pl.Float64,
        "identity_max_scaled_err": pl.Float64,
        "identity_violations": pl.Int64,
        "identity_logits_max_rel_err": pl.Float64,
        "logits_lo": pl.Float64,
        "logits_hi": pl.Float64,
        "logits_ratio_min": pl.Float64,
        "logits_ratio_max": pl.Float64,
        "logits_violations": pl.Int64,
        "head_sigma_max": pl.Float64,
        "head_sigma_step": pl.Int64,
        "head_bound": pl.Float64,
        "head_ratio_max": pl.Float64,
        "head_n": pl.Int64,
        "head_violations": pl.Int64,
        "tolerance": pl.Float64,
        "tolerance_rel": pl.Float64,
        "bound_tolerance": pl.Float64,
    },
    # the bounded token sample: one row per (sampled token, point)
    "tokens": {
        **_KEY,
        "row": pl.Int32,
        "pos": pl.Int32,
        "token_id": pl.Int64,
        "bin": pl.Int32,
        "pi_old": pl.Float64,
        "pi": pl.Float64,
        "advantage": pl.Float64,
        "w": pl.Float64,
        "point": pl.Utf8,
        "norm": pl.Float64,
        "ratio": pl.Float64,
        "direct_norm": pl.Float64,
        "direct_ratio": pl.Float64,
        "identity_rel_err": pl.Float64,
        "logits_ratio": pl.Float64,
    },
    # the sampler against the trainer: one row per completion token of a probed micro-batch whose rollout carries
    # the engine's log-probs (TRL + vLLM: `tokendyn.hooks.sampler`); log_rho = logp_old - logp_sampler; is_weight and
    # seq_masked null where no weight was applied or read (the offline probe: a rollouts file carries none)
    "sampler": _SAMPLER_COLUMNS,
    # the trainer against itself, the noise floor of any mismatch: the same tokens' log-probs recomputed in two
    # halves of the micro-batch at the same parameters (`tokendyn.hooks.sampler.split_logps`); the sampler's columns,
    # logp_old = the loss's forward, logp_sampler = the recomputation, is_weight 1, seq_masked false
    "floor": _SAMPLER_COLUMNS,
    # conditions that switched a check off (GradientProbe.note): one row per condition and rank; step null when
    # the condition holds for the whole run (found when the probe was built)
    "notes": {"step": pl.Int64, "rank": pl.Int32, "code": pl.Utf8, "message": pl.Utf8},
    # ---- rebalancing analyses (tokendyn.effects.shares / change / influence); bin -1 = all tokens
    # per (bin, parameter group): ||g_b||, <g_b, g>, ||g||, s_b = <g_b, g>/||g||^2; group "all" = every parameter,
    # else embeddings | layers.{i} | final_norm | lm_head | other (tokendyn.vocab); jvp_share = sum of the per-token
    # JVP shares of the bin (group "all" only); loss = L of the batch; share null where g = 0. stage "train": the
    # whole loss; a Lopti run's stages "low" / "high": the stage's loss at the stage start (step = the global step
    # then: stage 2 later than the rollout's other records)
    "shares": {
        **_REBALANCE_KEY,
        "bin": pl.Int32,
        "bin_lo": pl.Float64,
        "bin_hi": pl.Float64,
        "group": pl.Utf8,
        "count": pl.Int64,
        "grad_norm": pl.Float64,
        "dot": pl.Float64,
        "total_norm": pl.Float64,
        "share": pl.Float64,
        "jvp_share": pl.Float64,
        "loss": pl.Float64,
    },
    # sampled tokens: s_t = <grad l_t, g>/||g||^2; pos = completion index j (sequence index S - C + j);
    # delta_pi = the token's change under the counterfactual all-token update (null if not run)
    "token_shares": {
        **_REBALANCE_KEY,
        "row": pl.Int32,
        "pos": pl.Int32,
        "token_id": pl.Int64,
        "bin": pl.Int32,
        "bin_lo": pl.Float64,
        "bin_hi": pl.Float64,
        "pi_old": pl.Float64,
        "advantage": pl.Float64,
        "share": pl.Float64,
        "delta_pi": pl.Float64,
    },
    # distribution of delta pi per bin of pi_old after one update; update: counterfactual | sweep | real;
    # update_stage: train | low | high | lopti (tokendyn.vocab); source_bin: the bin the update used (-1 all tokens);
    # limit: the sweep's lr -> 0 point (lr 0), whose delta pi columns are d pi / d lr at lr = 0 (null before it was
    # recorded: no such rows)
    "prob_change": {
        **_REBALANCE_KEY,
        "update": pl.Utf8,
        "update_stage": pl.Utf8,
        "source_bin": pl.Int32,
        "bin": pl.Int32,
        "bin_lo": pl.Float64,
        "bin_hi": pl.Float64,
        "lr": pl.Float64,
        "param_step": pl.Float64,
        **_RESOLUTION,
        "limit": pl.Boolean,
        **_DELTA,
    },
    # M[source, target]: mean |delta pi| (and the distribution of delta pi, correct ratios) over target-bin tokens after an update with only
    # the source bin's tokens; update_stage train | low | high (Lopti)
    "influence": {
        **_REBALANCE_KEY,
        "update_stage": pl.Utf8,
        "source_bin": pl.Int32,
        "source_lo": pl.Float64,
        "source_hi": pl.Float64,
        "source_count": pl.Int64,
        "target_bin": pl.Int32,
        "target_lo": pl.Float64,
        "target_hi": pl.Float64,
        "lr": pl.Float64,
        **_RESOLUTION,
        **_DELTA,
    },
    # the measured step-precision check (tokendyn.effects.precision): one analysed batch's analyses with float64 steps
    # and in the model's dtype, one row per counterfactual update; rel_diff = the largest |difference| of its dpi
    # statistics / its largest |dpi| in float64 (scale); ratio_diff = the largest correct-ratio difference
    # (ratio_tokens: in tokens); agreed: within tol, ratios within one token, signs and nulls equal
    "precision_check": {
        **_REBALANCE_KEY,
        "analysis": pl.Utf8,
        "update": pl.Utf8,
        "model_dtype": pl.Utf8,
        "tol": pl.Float64,
        "scale": pl.Float64,
        "max_abs_diff": pl.Float64,
        "rel_diff": pl.Float64,
        "ratio_diff": pl.Float64,
        "ratio_tokens": pl.Float64,
        "signs_equal": pl.Boolean,
        "nulls_equal": pl.Boolean,
        "agreed": pl.Boolean,
        "seconds_float64": pl.Float64,
        "seconds_model": pl.Float64,
    },
    # paired counterfactual comparison (tokendyn.effects.compare): sums over one sequence's tokens of one bin of pi_old
    # after each rule's update from the same state; rule base | reweight | lopti | ...; mode equal_norm | optimizer
    "paired": {
        "step": pl.Int64,
        "rule": pl.Utf8,
        "mode": pl.Utf8,
        "seq": pl.Int32,
        "bin": pl.Int32,
        "bin_lo": pl.Float64,
        "bin_hi": pl.Float64,
        "count": pl.Int64,
        "n_pos": pl.Int64,
        "n_neg": pl.Int64,
        "up_pos": pl.Int64,
        "down_neg": pl.Int64,
        "tie_pos": pl.Int64,
        "tie_neg": pl.Int64,
        "sum_dpi": pl.Float64,
        "sum_dpi_ref": pl.Float64,
        "sum_diff": pl.Float64,
        "sum_diff2": pl.Float64,
        "sum_share": pl.Float64,
        "sum_dentropy": pl.Float64,
        "sum_kl_ref": pl.Float64,
        "lr": pl.Float64,
        "param_step": pl.Float64,
        "norm_ratio": pl.Float64,
        "inner_steps": pl.Int32,
        "sweep": pl.Utf8,
        "sweep_value": pl.Float64,
        "diverged": pl.Boolean,
        **_RESOLUTION,
    },
    # per-token records of the view's sequences (tokendyn.effects.token_view): one row per scored token
    "token_view": {
        **_REBALANCE_KEY,
        "seq": pl.Int32,
        "pos": pl.Int32,
        "token_id": pl.Int64,
        "text": pl.Utf8,
        "special": pl.Boolean,
        "bin": pl.Int32,
        "pi_old": pl.Float64,
        "advantage": pl.Float64,
        "group": pl.Utf8,
        "share": pl.Float64,
        "dpi_cf": pl.Float64,
        "dpi_real": pl.Float64,
        "head_ratio": pl.Float64,
        # the sampler at the token (null where the rollout has no sampler log-probs): log pi_old - log mu, and the
        # importance weight the loss applied
        "log_rho": pl.Float64,
        "is_weight": pl.Float64,
    },
    # the paired comparison's rules at the view's tokens: one row per (token, rule, mode)
    "token_view_rules": {
        **_REBALANCE_KEY,
        "seq": pl.Int32,
        "pos": pl.Int32,
        "rule": pl.Utf8,
        "mode": pl.Utf8,
        "delta_pi": pl.Float64,
        "share": pl.Float64,
    },
    # a spiking probed step's top tokens by update share, one row per (step, stage, rank) (`tokendyn.effects.spike`)
    "spikes": {
        **_REBALANCE_KEY,
        "trigger": pl.Utf8,
        "trigger_value": pl.Float64,
        "trigger_median": pl.Float64,
        "trigger_ratio": pl.Float64,
        "k": pl.Float64,
        "rank": pl.Int32,
        "seq": pl.Int32,
        "pos": pl.Int32,
        "token_id": pl.Int64,
        "text": pl.Utf8,
        "context": pl.Utf8,
        "bin": pl.Int32,
        "bin_lo": pl.Float64,
        "bin_hi": pl.Float64,
        "pi_old": pl.Float64,
        "advantage": pl.Float64,
        "log_rho": pl.Float64,
        "is_weight": pl.Float64,
        "share": pl.Float64,
        "grad_norm": pl.Float64,
        "loss": pl.Float64,
    },
}


KINDS = tuple(SCHEMAS)
