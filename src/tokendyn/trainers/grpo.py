"""`TokendynGRPOTrainer`: TRL's `GRPOTrainer` with Advantage Reweighting, Lopti and REINFORCE++ advantages.

This module plugs the remedies into TRL's loop (trl 1.16; every TRL internal it and the rest of tokendyn lean on is
named in `tokendyn.integrations.trl_internals`, whose ``check()`` runs before the first trainer is built). The math
is in `functional.py`; here is only where it plugs in:

* ``__init__``: TRL's colocated vLLM engine (``use_vllm``, ``vllm_mode="colocate"``) is built inside
  `tokendyn.trainers.sampler.sampling_engine` (on vLLM's CPU build: weights the sync reaches; ``vllm_dtype``,
  ``vllm_enforce_eager``); ``sampler_info`` says what samples the rollouts (run.json's ``sampler``).
* ``_generate_and_score_completions`` (once per rollout batch, train mode only): makes sure ``old_per_token_logps``
  (pi_old at the sampling temperature) is present whenever Reweight or Lopti is on, swaps in REINFORCE++
  advantages, applies Reweight (advantages become (B, T)), and stores both Lopti stage masks in the batch. These are
  then shuffled and split with the batch by TRL and fixed for every pass over it, both stages included. With the
  probe on, the batch is handed to it there (``TrainerProbe.rollout``: the rebalancing analyses' sample).
* Lopti runs as TRL's generation buffer with twice the passes: ``num_iterations`` is doubled internally, so the
  sampler's repeat count and ``_prepare_inputs``' regeneration period agree; passes 0..mu-1 are stage 1 and
  mu..2mu-1 stage 2 (``current_stage``). The optimizer and its state are simply TRL's, carried over.
* ``random_halves`` (Lopti's step-count control): the same two-stage schedule, each stage's tokens a random half
  (`tokendyn.remedies.random_halves_masks`, seeded per run, rollout and rank) under keys of their own; it is not
  Lopti (``current_stage()`` is 0, the probe records plain "train" steps).
* ``_compute_loss``: in a Lopti stage (or a random half), masks the advantages to that stage's tokens; the loss mask (and so every
  denominator) is left alone, so all completion tokens are still counted. The KL term is masked per stage by
  replacing pi_ref with the (detached) current pi on the other stage's tokens, right after the forward pass
  (``_get_per_token_logps_and_entropies``): k3(x, x) = 0 with zero gradient, exactly.
* The KL clamp of the paper's code (``kl_clamp``): where it binds (log-ratio outside [-5, 5] or k3 above 10) the
  clamped KL term is a constant, so pi_ref is replaced there by the detached current pi, in the same place: the
  gradient is the clamped loss's exactly; the loss value TRL logs lacks those constants.
* ``advantage_std_eps``: the group-normalised advantages recomputed from TRL's gathered rewards with that epsilon
  (`tokendyn.remedies.grpo_advantages`, the official code's unbiased std; TRL's own is 1e-4).
* ``policy_loss`` other than "ppo" (Clip-Cov, KL-Cov, DPPO-TV / -KL, ASPO, CE-GPPO, Lp-Reg: `tokendyn.probe.rules`):
  the loss of the micro-batch is `tokendyn.probe.tokenloss.loss_terms` with TRL's aggregation (``_rule_loss``), on
  TRL's forward (with its entropies for ASPO); Clip-Cov draws on a generator seeded per micro-step (``cov_seed``).
  Lp-Reg's min-p proxy of pi_old is computed once per rollout batch, at the sampling policy (one forward without
  grad, ``lp_reg_proxy_logp`` in the batch, split and shuffled with it by TRL).
* The advantage rules: ``logp_reweight_c`` (the Delta-log-p reweight, Reweight's mirror) where Reweight is applied;
  ``advantage_estimator="w_reinforce"`` (lambda / -1 from the gathered rewards) where REINFORCE++ is swapped in.
* ``_issue_warnings_after_load`` (resuming): the keys tied to a key the checkpoint held (a tied LM head) are not
  reported as missing.

With ``advantage_reweight_alpha=0``, Lopti off and ``advantage_estimator="grpo"`` every override is a pass-through.

Note: with Lopti, one rollout batch takes twice as many optimizer steps, so a fixed ``max_steps`` sees half as many
rollouts as plain GRPO; give the training length in epochs (or double ``max_steps``) to compare at equal rollouts.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from trl import GRPOTrainer

from ..integrations import trl_internals
from ..probe.tokenloss import Objective, ProbeBatch, loss_terms
from ..remedies import (
    logp_reweight_advantages,
    random_halves_masks,
    reweight_advantages,
    w_reinforce_advantages,
)
from .grpo_batch import RolloutBatchMixin
from .sampler import sampler_info, sampling_engine

STAGE_MASK_KEYS = {1: "lopti_stage1_mask", 2: "lopti_stage2_mask"}
# Lopti's step-count control (``random_halves``): its two stages under keys of their own, so that nothing reads them
# as Lopti's low / high groups (the probe records its steps as ordinary "train" updates)
HALVES_MASK_KEYS = {1: "halves_stage1_mask", 2: "halves_stage2_mask"}


class TokendynGRPOTrainer(RolloutBatchMixin, GRPOTrainer):
    """`trl.GRPOTrainer` plus the paper's remedies; takes a `TokendynGRPOConfig` (a plain `GRPOConfig` runs TRL's
    GRPO unchanged). Same constructor as `GRPOTrainer`.

    Hooks for probes: ``current_stage()`` (0 = no Lopti, 1 or 2), ``_last_loss_inputs`` (the dict handed to TRL's loss
    for the latest micro-step: advantages after REINFORCE++/Reweight and the stage mask; ``raw_advantages`` before
    Reweight) and ``_last_loss_stage``. With ``probe_every > 0`` the trainer drives a `GradientProbe`
    (`tokendyn.hooks.trainer.TrainerProbe`) from the real training backward.
    """

    def __init__(self, *args, **kwargs):
        trl_internals.check_once()  # one line when a TRL name tokendyn leans on moved
        with sampling_engine(kwargs["args"] if "args" in kwargs else args[2] if len(args) > 2 else None):
            super().__init__(*args, **kwargs)
        cfg = self.args
        # what sampled the rollouts (run.json's `sampler`): vLLM's engine as built, or the trainer's own generate
        self.sampler_info = sampler_info(self)
        self.advantage_reweight_alpha = float(getattr(cfg, "advantage_reweight_alpha", 0.0))
        self.logp_reweight_c = float(getattr(cfg, "logp_reweight_c", 0.0))
        self.w_reinforce_lambda = float(getattr(cfg, "w_reinforce_lambda", 0.1))
        self.lopti_eta = getattr(cfg, "lopti_eta", None)
        self.lopti_quantile = getattr(cfg, "lopti_quantile", None)
        self.lopti_order = getattr(cfg, "lopti_order", "low_first")
        self.advantage_estimator = getattr(cfg, "advantage_estimator", "grpo")
        self.lopti_enabled = self.lopti_eta is not None or self.lopti_quantile is not None
        self.random_halves = bool(getattr(cfg, "random_halves", False))
        self.passes_per_stage = self.num_iterations  # mu: passes over one rollout batch in one stage
        if self.lopti_enabled or self.random_halves:
            self.num_iterations = 2 * self.passes_per_stage  # read by _get_train_sampler and _prepare_inputs
        self._last_loss_inputs: dict | None = None
        self._last_loss_stage = 0
        self._last_rewards_per_func: torch.Tensor | None = None
        self._kl_stage_pending: tuple[torch.Tensor | None, dict] | None = None
        self.kl_clamp = bool(getattr(cfg, "kl_clamp", False))
        self.advantage_std_eps = getattr(cfg, "advantage_std_eps", None)
        self.policy_loss = getattr(cfg, "policy_loss", "ppo")
        self._objective = Objective.from_config(cfg) if self.policy_loss != "ppo" else None
        self._needs_proxy = self._objective is not None and self._objective.needs_proxy
        # the sequences' rewards kept in the batch for the probe's paired comparison of W-REINFORCE
        self._keep_rewards = bool(getattr(cfg, "probe_every", 0)) and "w_reinforce" in (
            getattr(cfg, "probe_compare_rules", None) or ()
        )
        self.probe = None
        if getattr(cfg, "probe_every", 0):
            from tokendyn.hooks.trainer import TrainerProbe

            self.probe = TrainerProbe(self, cfg.output_dir)
            self.add_callback(self.probe)
            from tokendyn.trainers.doctor_log import DoctorLogCallback

            # after the probe's callback, which writes its last records at the same event
            self.add_callback(DoctorLogCallback(cfg.output_dir))

    @property
    def _modifies_batch(self) -> bool:
        return (
            self.advantage_reweight_alpha > 0
            or self.logp_reweight_c > 0
            or self._needs_proxy
            or self.lopti_enabled
            or self.random_halves
            or self.advantage_estimator != "grpo"
            or self.advantage_std_eps is not None
        )

    def cov_seed(self) -> int:
        """Seed of Clip-Cov's random draw in micro-step ``_step`` (a function of the run's seed and the micro-step,
        so a resumed run draws as an uninterrupted one)."""
        return int(self.args.seed) * 1_000_003 + int(self._step)

    def current_stage(self, step: int | None = None) -> int:
        """Lopti stage of micro-step ``step`` (default: the one about to run or running, ``self._step``):
        0 without Lopti or outside training, else 1 for the first ``steps_per_generation * mu`` micro-steps of each
        rollout batch and 2 for the next as many."""
        if not self.lopti_enabled:
            return 0
        return self._two_stage_index(step)

    def _two_stage_index(self, step: int | None = None) -> int:
        """0 outside training or without two stages (Lopti or ``random_halves``), else the stage (1, 2) of
        micro-step ``step`` (default ``self._step``) in the rollout batch's schedule."""
        if not (self.lopti_enabled or self.random_halves) or not self.model.training:
            return 0
        step = self._step if step is None else step
        per_stage = self.args.steps_per_generation * self.passes_per_stage
        return 1 if step % (2 * per_stage) < per_stage else 2

    # ----------------------------------------------------------------------------------------- rollout batch
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._last_rewards_per_func = rewards_per_func  # gathered over processes, (B_global, n_funcs)
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self._keep_rewards and self.model.training:
            output["sequence_rewards"] = self._rewards_local(output["advantages"])
        if not self.model.training or not self._modifies_batch:
            if self.probe is not None and self.model.training:
                self.probe.rollout(output)
            return output
        mask = output["completion_mask"]
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]
        advantages = output["advantages"]
        if self.advantage_estimator == "reinforce_pp":
            advantages = self._reinforce_pp_local(mask)
        elif self.advantage_estimator == "w_reinforce":
            rewards = self._rewards_local(advantages)
            advantages = w_reinforce_advantages(rewards, self.w_reinforce_lambda).to(advantages.dtype)
        elif self.advantage_std_eps is not None:
            advantages = self._grpo_local(advantages)
        output["raw_advantages"] = advantages
        needs_pi_old = self.advantage_reweight_alpha > 0 or self.logp_reweight_c > 0 or self.lopti_enabled
        if needs_pi_old and output.get("old_per_token_logps") is None:
            output["old_per_token_logps"] = self._sampling_logps(output)
        old_logp = output.get("old_per_token_logps")
        if self.advantage_reweight_alpha > 0:
            advantages = reweight_advantages(advantages, old_logp, self.advantage_reweight_alpha)
            weight = self.advantage_reweight_alpha * torch.exp(old_logp) + 1 - self.advantage_reweight_alpha
            self._log_global_mean("reweight/mean_weight", (weight * mask).sum(), mask.sum())
        if self.logp_reweight_c > 0:
            advantages = logp_reweight_advantages(advantages, old_logp, self.logp_reweight_c)
            weight = 1 + self.logp_reweight_c - self.logp_reweight_c * torch.exp(old_logp)
            self._log_global_mean("logp_reweight/mean_weight", (weight * mask).sum(), mask.sum())
        output["advantages"] = advantages
        if self._needs_proxy:
            output["lp_reg_proxy_logp"] = self._proxy_logps(output)
        if self.lopti_enabled:
            stage1, stage2 = self._stage_masks(old_logp, mask)
            output[STAGE_MASK_KEYS[1]], output[STAGE_MASK_KEYS[2]] = stage1, stage2
            self._log_global_mean("lopti/stage1_fraction", stage1.sum(), mask.sum())
            self._log_global_mean("lopti/stage2_fraction", stage2.sum(), mask.sum())
        if self.random_halves:  # a seed per (run, rollout, rank): a resumed run draws as an uninterrupted one
            seed = (int(self.args.seed) * 1_000_003 + int(self.state.global_step)) * 1024
            first, second = random_halves_masks(mask, seed + self.accelerator.process_index)
            output[HALVES_MASK_KEYS[1]], output[HALVES_MASK_KEYS[2]] = first, second
            self._log_global_mean("random_halves/stage1_fraction", first.sum(), mask.sum())
        if self.probe is not None:
            self.probe.rollout(output)
        return output

    # ------------------------------------------------------------------------------------------------- loss
    def _issue_warnings_after_load(self, load_result) -> None:
        """transformers' warnings after loading a checkpoint into the model, without the missing keys tied to a key
        the checkpoint held (`tokendyn.trainers.resume.untied_missing_keys`: a tied LM head is stored once)."""
        from types import SimpleNamespace

        from .resume import untied_missing_keys

        missing = untied_missing_keys(self.model, load_result.missing_keys)
        super()._issue_warnings_after_load(
            SimpleNamespace(missing_keys=missing, unexpected_keys=list(load_result.unexpected_keys))
        )

    def get_decay_parameter_names(self, model) -> list[str]:
        """transformers' decayed parameters (not biases, not norms), or every parameter with ``weight_decay_all``."""
        if getattr(self.args, "weight_decay_all", False):
            return [name for name, _ in model.named_parameters()]
        return super().get_decay_parameter_names(model)

    def training_step(self, *args, **kwargs):
        """TRL's micro-step (forward, loss, backward); the probe then reduces that micro-batch at once, so the last
        one of a run (or of a Lopti stage) is recorded like every other."""
        loss = super().training_step(*args, **kwargs)
        if self.probe is not None:
            self.probe.end()
        return loss

    def _compute_loss(self, model, inputs):
        stage = self.current_stage()
        if self.probe is not None:  # rebalancing analyses see the batch before any stage masking
            self.probe.analyze(inputs)
        split = self._two_stage_index()  # Lopti's stage, or the random half of its control
        if split:
            keys = STAGE_MASK_KEYS if self.lopti_enabled else HALVES_MASK_KEYS
            keep = inputs[keys[split]]
            inputs = dict(inputs)  # the buffered batch is reused by later passes: never modify it
            advantages = inputs["advantages"]
            if advantages.dim() == 1:
                advantages = advantages.unsqueeze(1)
            inputs["advantages"] = advantages * keep
            if self.beta != 0.0:
                self._kl_stage_pending = (keep, inputs)
        if self.beta != 0.0 and self.kl_clamp and self._kl_stage_pending is None:
            inputs = dict(inputs)
            self._kl_stage_pending = (None, inputs)
        self._last_loss_inputs = inputs
        self._last_loss_stage = stage
        if self.probe is not None:
            self.probe.begin(inputs, stage)
        try:
            if self.policy_loss != "ppo":
                return self._rule_loss(model, inputs)
            return super()._compute_loss(model, inputs)
        finally:
            self._kl_stage_pending = None

    def _rule_loss(self, model, inputs):
        """The micro-batch's loss of a registered rule (``policy_loss``: Clip-Cov, KL-Cov, DPPO, ASPO, CE-GPPO,
        Lp-Reg): TRL's forward and its entropies (logged as TRL's loss logs them; read where the rule reads H_t), the
        per-token terms of `loss_terms` (the rule the analyses differentiate), TRL's aggregation: dapo's normalizer
        spans the accumulation window, the other loss types are divided by the accumulation steps."""
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        objective = replace(self._objective, cov_seed=self.cov_seed())
        logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True
        )
        train = self.model.training  # in eval TRL neither accumulates nor splits the batch
        # the sampled tokens' entropy, logged as TRL's own loss logs it (masked mean over every process's tokens)
        totals = torch.stack([(entropies.detach() * mask).sum(), mask.sum().float()])
        totals = self.accelerator.reduce(totals, reduction="sum")
        self._metrics["train" if train else "eval"]["entropy"].append(
            float(totals[0] / totals[1].clamp(min=1.0))
        )
        accumulation = self.current_gradient_accumulation_steps if train else 1
        normalizer = None
        if objective.loss_type == "dapo":
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if train:
                normalizer = normalizer * accumulation / self.args.steps_per_generation
            normalizer = float(normalizer)
        batch = ProbeBatch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            completion_mask=mask,
            advantages=inputs["advantages"],
            old_logp=inputs.get("old_per_token_logps"),
            ref_logp=inputs.get("ref_per_token_logps") if objective.beta else None,
            normalizer=normalizer,
            sampling_logp=inputs.get("sampling_per_token_logps"),
            is_ratio=inputs.get("importance_sampling_ratio") if objective.is_correction else None,
            proxy_logp=inputs.get("lp_reg_proxy_logp") if objective.needs_proxy else None,
        )
        loss = loss_terms(logps, batch, objective, entropies if objective.needs_entropy else None).sum()
        if objective.loss_type != "dapo":
            loss = loss / accumulation
        self._metrics["train" if train else "eval"]["policy_loss"].append(
            float(loss.detach()) * (1 if normalizer else accumulation)
        )
        return loss

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
    ):
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        # the policy forward of a loss with beta != 0 in a Lopti stage or with the KL clamp
        if self._kl_stage_pending is not None:
            keep, inputs = self._kl_stage_pending
            self._kl_stage_pending = None
            ref, current = inputs["ref_per_token_logps"], logps.detach()
            if keep is not None:
                ref = torch.where(keep.bool(), ref, current)
            if self.kl_clamp:
                ref = torch.where(kl_clamp_binds(ref - current), current, ref)
            inputs["ref_per_token_logps"] = ref
        return logps, entropies, aux_loss


def kl_clamp_binds(d: torch.Tensor) -> torch.Tensor:
    """Where the official KL clamp makes the KL term constant (zero gradient): d = log pi_ref - log pi outside
    [-5, 5], or k3 = exp(d) - d - 1 above 10 (kld = clamp(k3(clamp(d, -5, 5)), -10, 10); k3 >= 0, so the lower
    bound never binds). Bool, d's shape."""
    c = torch.clamp(d, -5.0, 5.0)
    return (d != c) | (torch.exp(c) - c - 1.0 > 10.0)
