"""The trainer's presets (`tokendyn train --preset NAME`, `TokendynGRPOConfig.from_preset`): the paper's training
scripts and the other remedies by their authors' settings, as field values of `TokendynGRPOConfig`."""

from __future__ import annotations

from tokendyn.probe.rules import SURROGATES
from tokendyn.remedies import CLIP_COV_DEFAULTS, KL_COV_DEFAULTS

# The paper's training scripts (docs/paper.md §1.2; the official train_kklogic_{baseline,AR,Lopti,AR-Lopti}_4x80GB.sh) in this
# trainer's fields: the official base loss and optimizer; learning rate, batch sizes and lengths stay the user's.
PAPER_BASE = dict(
    loss_type="bnpo",  # token-mean of each micro-batch (core_algos.py:213-214), divided by the accumulation steps
    advantage_std_eps=1e-6,  # (s - mean) / (std + 1e-6), unbiased std (core_algos.py:111-155)
    delta=10.0,  # dual clip: min(clip_pg, -10 A) for A < 0 (core_algos.py:259-324)
    kl_clamp=True,  # log-ratio in [-5, 5], k3 in [-10, 10] (core_algos.py:393-398)
    beta=0.001,
    use_bias_correction_kl=False,  # plain k3 (low_var_kl)
    epsilon=0.2,
    epsilon_high=0.24,
    temperature=0.7,
    top_p=1.0,
    top_k=0,
    optim="adamw_torch",
    adam_beta1=0.9,
    adam_beta2=0.999,
    weight_decay=0.01,
    weight_decay_all=True,  # AdamW over actor_module.parameters() (fsdp_workers.py:237-263): no exempt groups
    lr_scheduler_type="constant",
    warmup_steps=0,
    max_grad_norm=1.0,
    num_iterations=1,
)
PRESETS = {
    "baseline": dict(PAPER_BASE),
    "ar": dict(PAPER_BASE, advantage_reweight_alpha=0.3),
    "lopti": dict(PAPER_BASE, lopti_eta=0.5, lopti_order="low_first"),
    "ar_lopti": dict(PAPER_BASE, advantage_reweight_alpha=0.3, lopti_eta=0.5, lopti_order="low_first"),
    # other remedies by their authors' settings, on top of the run's own base loss
    "gspo": dict(
        importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4, beta=0.0
    ),
    "80_20": dict(
        top_entropy_quantile=0.2
    ),  # "Beyond the 80/20 rule" (Wang et al. 2025): top-20 % entropy tokens
    "clip_cov": dict(policy_loss="clip_cov", **CLIP_COV_DEFAULTS),
    "kl_cov": dict(policy_loss="kl_cov", **KL_COV_DEFAULTS),
    # the camp that protects low-probability tokens (docs/remedies.md), by their authors' settings; the
    # ratio-based ones (DPPO, ASPO, CE-GPPO) act only with more than one update per rollout (num_iterations > 1)
    **{
        name: dict(policy_loss=name, **{p.name: p.default for p in SURROGATES[name].params})
        for name in ("dppo_tv", "dppo_kl", "aspo")
    },
    "ce_gppo": dict(
        policy_loss="ce_gppo", epsilon=0.2, epsilon_high=0.2, ce_gppo_beta1=0.5, ce_gppo_beta2=1.0
    ),
    "lp_reg": dict(
        policy_loss="lp_reg", epsilon=1.0, epsilon_high=9.0, beta=0.0, lp_reg_kappa=0.02, lp_reg_rho=0.01
    ),
    "logp_reweight": dict(logp_reweight_c=0.1),
    "w_reinforce": dict(advantage_estimator="w_reinforce", w_reinforce_lambda=0.1, epsilon=0.2),
}


def preset_values(name: str) -> dict:
    """The field values of preset ``name`` (a copy); an unknown name raises ValueError listing the presets."""
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}; got {name!r}")
    return dict(PRESETS[name])
