"""One loss: the analyses differentiate exactly the loss TRL's training step optimises, option by option.

The reference is TRL's own ``GRPOTrainer._compute_loss`` and backward in the real loop (one micro-batch per optimizer
step, so its gradient is the micro-batch's): the gradient it leaves on the parameters right before the optimizer
step is compared with the gradient of `tokendyn.probe.tokenloss.token_loss` (``Objective.from_config``) on the very
same inputs at the very same parameters. pi_old and pi_ref are perturbed (the same for both) so that ratios, clipping
and the KL term are all active.
"""

from __future__ import annotations

import pytest
import torch
from test_trainer import _config, _trainer
from transformers import TrainerCallback

from tokendyn.probe.tokenloss import Objective, ProbeBatch, token_loss
from tokendyn.trainers.grpo import TokendynGRPOTrainer

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
}


class Capturing(TokendynGRPOTrainer):
    """Perturbs pi_old / pi_ref of the first micro-batch (seeded), keeps those inputs and the parameters before
    the step; a callback keeps the gradient right before the optimizer step."""

    captured: dict = {}

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
                inputs["ref_per_token_logps"] = (logps + noise()).clamp(max=0.0)
            self.captured["inputs"] = {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()}
            self.captured["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        return super()._compute_loss(model, inputs)


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
    )
    objective = Objective.from_config(args)
    token_loss(model, batch, objective).loss.backward()
    num = sum(float((p.grad - want[n]).double().pow(2).sum()) for n, p in model.named_parameters())
    den = sum(float(g.double().pow(2).sum()) for g in want.values())
    assert den > 0
    assert (num / den) ** 0.5 < 1e-5, f"{name}: relative gradient error {(num / den) ** 0.5:.2e}"


def test_a_loss_the_analyses_cannot_reproduce_fails_at_start(tmp_path):
    """At config time (before any model loads), naming the option; without analyses the same loss trains."""
    with pytest.raises(ValueError, match="loss_type='vespo'"):
        _config(tmp_path, loss_type="vespo", probe_every=1, probe_sample_sequences=2)
    with pytest.raises(ValueError, match="use_adaptive_entropy"):
        _config(tmp_path, use_adaptive_entropy=True, probe_every=1, probe_sample_sequences=2)
    _config(tmp_path, loss_type="vespo", probe_every=1, probe_sample_sequences=0)
