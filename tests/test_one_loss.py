"""One loss: the analyses differentiate exactly the loss TRL's training step optimises, option by option.

The reference is TRL's own ``GRPOTrainer._compute_loss`` and backward in the real loop (one micro-batch per optimizer
step, so its gradient is the micro-batch's): the gradient it leaves on the parameters right before the optimizer
step is compared with the gradient of `tokendyn.probe.tokenloss.token_loss` (``Objective.from_config``) on the very
same inputs at the very same parameters. pi_old and pi_ref are perturbed (the same for both) so that ratios, clipping
and the KL term are all active.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_trainer import _config, _trainer
from transformers import TrainerCallback

from tokendyn.hooks.trainer import step_objective
from tokendyn.probe.tokenloss import Objective, ProbeBatch, token_loss
from tokendyn.trainers.grpo import TokendynGRPOTrainer, kl_clamp_binds
from tokendyn.trainers.presets import PRESETS

torch.set_num_threads(1)

OPTIONS = {
    "dapo clip": dict(loss_type="dapo"),
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "sequence IS (GSPO)": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "delta cap": dict(loss_type="dapo", delta=1.3),
    "beta, k3": dict(loss_type="dapo", beta=0.05, use_bias_correction_kl=False),
    "beta, bias-corrected": dict(loss_type="dapo", beta=0.05, use_bias_correction_kl=True),
    "top entropy 0.5": dict(loss_type="dapo", top_entropy_quantile=0.5),
    "entropy bonus": dict(loss_type="bnpo", entropy_coef=0.05),
    "cispo": dict(loss_type="cispo", epsilon_high=1.1),  # the clamp binds on the ratios above 1.1
    "cispo, beta": dict(loss_type="cispo", epsilon_high=1.1, beta=0.05),
    "sapo": dict(loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05),
    "sapo, other temperatures": dict(loss_type="sapo", sapo_temperature_pos=3.0, sapo_temperature_neg=0.5),
    "luspo, sequence IS": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "luspo, token IS": dict(loss_type="luspo"),
    "vespo": dict(loss_type="vespo"),
    "vespo, other k and lambda": dict(
        loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=4.0, vespo_lambda_neg=6.0
    ),
    "off-policy mask": dict(loss_type="dapo", off_policy_mask_threshold=0.0),
    "off-policy mask, grpo, beta": dict(loss_type="grpo", off_policy_mask_threshold=0.02, beta=0.05),
    "adaptive entropy, applied": dict(
        loss_type="bnpo", use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=100.0
    ),
    "adaptive entropy, not applied": dict(
        loss_type="bnpo", use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=1e-3
    ),
    # tokendyn's trainer: the paper's KL clamp (far-off pi_ref, so that it binds) and the remedies' presets
    "KL clamp": dict(loss_type="bnpo", beta=0.05, kl_clamp=True, use_bias_correction_kl=False),
    "preset baseline (official base loss)": {
        **{k: v for k, v in PRESETS["baseline"].items() if k != "max_grad_norm"},
        "beta": 0.05,
    },
    "preset gspo": dict(PRESETS["gspo"]),
    "preset 80_20": dict(PRESETS["80_20"]),
    "preset clip_cov": dict(PRESETS["clip_cov"], clip_cov_ratio=0.05, clip_cov_lb=0.0, clip_cov_ub=50.0),
    "preset kl_cov": dict(PRESETS["kl_cov"], kl_cov_ratio=0.05, beta=0.05),
    # the camp that protects low-pi tokens (test_both_camps.py checks each rule against its reference)
    "preset dppo_tv": dict(PRESETS["dppo_tv"], dppo_tv_delta=0.05, dppo_is_cap=1.2),
    "preset dppo_kl": dict(PRESETS["dppo_kl"], dppo_kl_delta=0.01),
    "preset aspo": dict(PRESETS["aspo"]),
    "preset ce_gppo": dict(PRESETS["ce_gppo"], ce_gppo_dual_clip=1.3),
    "preset lp_reg": dict(PRESETS["lp_reg"], epsilon=0.1, epsilon_high=0.15, lp_reg_rho=0.5),
    "preset logp_reweight": dict(PRESETS["logp_reweight"]),
}
# vLLM's importance-sampling correction: TRL's own step with the sampler's log-probs in the batch (as its
# generation puts them there with use_vllm; no vLLM needed to run the loss), every correction mode
VLLM = {
    "vLLM IS, token_truncate": dict(mode="token_truncate", clip_min=0.9, clip_max=1.1),
    "vLLM IS, token_mask": dict(mode="token_mask", clip_min=0.9, clip_max=1.1),
    "vLLM IS, sequence_truncate": dict(mode="sequence_truncate", clip_min=None, clip_max=1.5),
    "vLLM IS, sequence_mask, off-policy mask": dict(
        mode="sequence_mask", clip_min=0.5, clip_max=2.0, off_policy_mask_threshold=0.0
    ),
    "vLLM IS, vespo token_truncate": dict(
        mode="token_truncate", clip_min=0.9, clip_max=1.1, loss_type="vespo"
    ),
}
OPTIONS.update(
    {
        name: {k: v for k, v in o.items() if k not in ("mode", "clip_min", "clip_max")}
        for name, o in VLLM.items()
    }
)
FAR_REF = {"KL clamp", "preset baseline (official base loss)"}  # pi_ref 3 nats off: the clamp binds


def vllm_ratio(
    old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, mode: str, lo, hi
) -> torch.Tensor:
    """TRL 1.16's importance_sampling_ratio from pi_old and the sampler's log-probs (its generation step)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=lo, max=hi)
    lo = -math.inf if lo is None else lo
    hi = math.inf if hi is None else hi
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


class Capturing(TokendynGRPOTrainer):
    """Perturbs pi_old / pi_ref of the first micro-batch (seeded), keeps those inputs and the parameters before
    the step; a callback keeps the gradient right before the optimizer step."""

    captured: dict = {}
    ref_noise = 0.3
    vllm: dict | None = None

    def _compute_loss(self, model, inputs):
        if "inputs" not in self.captured:
            inputs = dict(inputs)
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            with torch.no_grad():
                logps, _, _ = self._get_per_token_logps_and_entropies(
                    model, ids, attn, inputs["completion_ids"].size(1)
                )
            g = torch.Generator().manual_seed(0)
            noise = lambda: 0.3 * torch.randn(logps.shape, generator=g)  # noqa: E731
            inputs["old_per_token_logps"] = (logps + noise()).clamp(max=0.0)
            if self.beta != 0.0:
                ref = logps + noise() * (self.ref_noise / 0.3)
                inputs["ref_per_token_logps"] = ref.clamp(max=0.0)
            if self.vllm is not None:
                v = self.vllm
                sampling = (inputs["old_per_token_logps"] + noise()).clamp(max=0.0)
                inputs["sampling_per_token_logps"] = sampling
                mask = inputs["completion_mask"]
                ratio = vllm_ratio(
                    inputs["old_per_token_logps"], sampling, mask, v["mode"], v["clip_min"], v["clip_max"]
                )
                inputs["importance_sampling_ratio"] = ratio
            if self.use_adaptive_entropy and self.args.entropy_target > 1.0:
                self._last_world_entropy = (
                    0.0  # as after a window below the target: TRL applies the coefficient
                )
            self.captured["inputs"] = {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()}
            self.captured["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
            self.captured["objective"] = step_objective(Objective.from_config(self._config_seen()), self)
        if self.vllm is not None:  # TRL's loss reads these two; generation ran without vLLM
            self.use_vllm, self.vllm_importance_sampling_correction = True, True
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self.use_vllm = False

    def _config_seen(self):
        """The config as a vLLM run would hold it (use_vllm True) when the test runs the vLLM correction."""
        if self.vllm is None:
            return self.args
        args = copy.copy(self.args)
        args.use_vllm, args.vllm_importance_sampling_correction = True, True
        return args


class GradAtStep(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        Capturing.captured.setdefault(
            "grads", {n: p.grad.detach().clone() for n, p in self.trainer.model.named_parameters()}
        )


@pytest.mark.parametrize("name", list(OPTIONS))
def test_the_analysis_loss_has_the_training_steps_gradient(tiny_model_dir, tmp_path, name):
    Capturing.captured = {}
    Capturing.ref_noise = 3.0 if name in FAR_REF else 0.3
    Capturing.vllm = VLLM.get(name)
    args = _config(
        tmp_path,
        max_steps=1,
        gradient_accumulation_steps=1,
        max_grad_norm=0.0,  # the raw gradient (no clipping before the optimizer step)
        **{"epsilon": 0.1, "epsilon_high": 0.15, **OPTIONS[name]},
    )
    trainer = _trainer(tiny_model_dir, args, cls=Capturing)
    trainer.add_callback(GradAtStep(trainer))
    trainer.train()
    # every loss logs the sampled tokens' entropy, as TRL's own does (the rule losses did not: a study's
    # entropy column was empty for DPPO-TV)
    logged = [h["entropy"] for h in trainer.state.log_history if "entropy" in h]
    assert logged and all(0 < e < math.log(trainer.model.config.vocab_size) for e in logged), name
    cap = Capturing.captured
    inputs, want = cap["inputs"], cap["grads"]

    model = trainer.model
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(cap["params"][n])
    model.zero_grad(set_to_none=True)
    batch = ProbeBatch(
        input_ids=torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
        attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
        completion_mask=inputs["completion_mask"],
        advantages=inputs["advantages"],
        old_logp=inputs["old_per_token_logps"],
        ref_logp=inputs.get("ref_per_token_logps"),
        temperature=args.temperature,
        sampling_logp=inputs.get("sampling_per_token_logps"),
        is_ratio=inputs.get("importance_sampling_ratio"),
        proxy_logp=inputs.get("lp_reg_proxy_logp"),
    )
    objective = cap["objective"]
    if name in FAR_REF:  # the clamp binds on some tokens, not all (else the test would not discriminate)
        with torch.no_grad():
            d = batch.ref_logp - token_loss(model, batch, Objective()).logp
        binds = kl_clamp_binds(d)[batch.completion_mask]
        assert 0 < int(binds.sum()) < binds.numel()
    if "adaptive" in name:
        assert objective.entropy_coef == (0.05 if "not" not in name else 0.0)
    token_loss(model, batch, objective).loss.backward()
    num = sum(float((p.grad - want[n]).double().pow(2).sum()) for n, p in model.named_parameters())
    den = sum(float(g.double().pow(2).sum()) for g in want.values())
    assert den > 0
    print(f"{name}: relative gradient error {(num / den) ** 0.5:.2e}")  # pytest -s: the figures
    assert (num / den) ** 0.5 < 1e-5, f"{name}: relative gradient error {(num / den) ** 0.5:.2e}"


def test_every_trl_loss_type_is_reproduced():
    """Every loss_type TRL trains is one the analyses know: the list is TRL's own, read from its config's help."""
    import re
    from dataclasses import fields

    from trl import GRPOConfig

    from tokendyn.probe.tokenloss import LOSS_TYPES

    help_text = next(f for f in fields(GRPOConfig) if f.name == "loss_type").metadata["help"]
    supported = help_text.split("Supported values are", 1)[1].split(".", 1)[0]
    trl_types = set(re.findall(r"'(\w+)'", supported))
    assert len(trl_types) >= 8 and trl_types <= set(LOSS_TYPES), trl_types - set(LOSS_TYPES)


def test_a_loss_the_analyses_cannot_reproduce_fails_at_start(tmp_path):
    """A remedy on a surrogate it cannot replace fails at config time (before any model loads), naming the fields."""
    with pytest.raises(ValueError, match="policy_loss clip_cov replaces PPO's surrogate"):
        _config(tmp_path, policy_loss="clip_cov", loss_type="sapo")
    with pytest.raises(ValueError, match="entropy_coef"):
        _config(tmp_path, policy_loss="kl_cov", entropy_coef=0.1)
