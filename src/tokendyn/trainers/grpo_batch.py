"""The rollout-batch helpers of `tokendyn.trainers.grpo.TokendynGRPOTrainer`, as a mixin the trainer inherits
before TRL's `GRPOTrainer`: pi_old and Lp-Reg's proxy when TRL skipped them (one forward without grad each), the
gathered rewards' local rows, REINFORCE++ / GRPO advantages from them, Lopti's stage masks (the quantile over the
whole batch) and the global means logged. None of them overrides a TRL method (those stay on the trainer class,
named in `tokendyn.integrations.trl_internals`); they read the trainer's attributes (``self.accelerator``,
``self.model``, ``self._last_rewards_per_func``, ...)."""

from __future__ import annotations

import torch
from trl.models.utils import disable_gradient_checkpointing

from ..probe.forward import completion_proxy_logp
from ..probe.tokenloss import ProbeBatch
from ..remedies import grpo_advantages, lopti_masks, reinforce_pp_advantages


class RolloutBatchMixin:
    """`TokendynGRPOTrainer`'s helpers for the rollout batch (``_generate_and_score_completions``); see the module
    docstring."""

    def _sampling_logps(self, output: dict) -> torch.Tensor:
        """pi_old of the sampled tokens (log, at the sampling temperature) under the policy that generated them,
        for when TRL skipped it (it does when the generation and optimizer steps are aligned)."""
        if "pixel_values" in output:
            raise ValueError("Reweight/Lopti: multimodal inputs (pixel_values) are not supported")
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        with (
            torch.no_grad(),
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
        ):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model,
                input_ids,
                attention_mask,
                output["completion_ids"].size(1),
                batch_size=self.args.per_device_train_batch_size,
            )
        return logps

    def _proxy_logps(self, output: dict) -> torch.Tensor:
        """Lp-Reg's log pi_proxy(o_t) (B, C) at the sampling policy (`tokendyn.probe.forward.completion_proxy_logp`,
        min-p with ``lp_reg_kappa``, at the sampling temperature): one forward without grad per rollout batch."""
        if "pixel_values" in output:
            raise ValueError("Lp-Reg: multimodal inputs (pixel_values) are not supported")
        batch = ProbeBatch(
            input_ids=torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1),
            attention_mask=torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1),
            completion_mask=output["completion_mask"],
            advantages=torch.zeros(output["completion_ids"].size(0)),
            temperature=self.temperature,
        )
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            proxy = completion_proxy_logp(self.model, batch, self._objective.lp_reg_kappa)
        return proxy.to(output["completion_ids"].device)

    def _rewards_local(self, like: torch.Tensor) -> torch.Tensor:
        """This process's rows of the gathered rewards (weighted sum over the reward functions; NaN where every
        function returned None), (B_local,)."""
        rewards_per_func = self._last_rewards_per_func
        weights = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        start = self.accelerator.process_index * like.size(0)
        return rewards[start : start + like.size(0)].to(like.device)

    def _gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """(B, T_local) on every process -> (B * num_processes, T_max), right-padded with 0."""
        if self.accelerator.num_processes == 1:
            return tensor
        return self.accelerator.gather(self.accelerator.pad_across_processes(tensor, dim=1, pad_index=0))

    def _local_rows(self, tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        rows = like.size(0)
        start = self.accelerator.process_index * rows
        return tensor[start : start + rows, : like.size(1)]

    def _reinforce_pp_local(self, mask: torch.Tensor) -> torch.Tensor:
        """REINFORCE++ advantages (B_local, T), whitened over the valid tokens of the whole (all-process) batch."""
        rewards_per_func = self._last_rewards_per_func
        weights = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        rewards = (rewards_per_func * weights).nansum(dim=1)
        # unscorable completions (every reward function returned None) get advantage 0, as in TRL
        scorable = ~torch.isnan(rewards_per_func).all(dim=1)
        global_mask = self._gather_rows(mask.to(rewards.dtype)) * scorable.unsqueeze(1).to(rewards.dtype)
        advantages = reinforce_pp_advantages(rewards, global_mask)
        return self._local_rows(advantages, like=mask)

    def _grpo_local(self, like: torch.Tensor) -> torch.Tensor:
        """Group-normalised advantages (B_local,) with ``advantage_std_eps`` (unbiased std), from the gathered
        rewards; an unscorable completion (NaN rewards) gets 0, as in TRL."""
        rewards_per_func = self._last_rewards_per_func
        weights = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        advantages = torch.nan_to_num(grpo_advantages(rewards, self.num_generations, self.advantage_std_eps))
        start = self.accelerator.process_index * like.size(0)
        return advantages[start : start + like.size(0)].to(like.dtype)

    def _stage_masks(self, old_logp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.lopti_quantile is None:  # fixed eta: a per-token rule, no communication needed
            return lopti_masks(old_logp, mask, eta=self.lopti_eta, order=self.lopti_order)
        # quantile: the threshold is taken over the valid tokens of the whole (all-process) rollout batch
        stage1, stage2 = lopti_masks(
            self._gather_rows(old_logp),
            self._gather_rows(mask),
            quantile=self.lopti_quantile,
            order=self.lopti_order,
        )
        return self._local_rows(stage1, like=mask), self._local_rows(stage2, like=mask)

    def _log_global_mean(self, name: str, numerator: torch.Tensor, denominator: torch.Tensor) -> None:
        local = torch.stack([numerator.detach().float(), denominator.detach().float()])
        total, count = self.accelerator.gather(local).view(-1, 2).sum(dim=0).tolist()
        self._metrics["train"][name].append(total / count if count > 0 else float("nan"))
