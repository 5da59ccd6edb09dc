"""`TokendynGRPOConfig`: TRL's `GRPOConfig` plus the paper's two remedies and the advantage estimator.

Every field is a `HfArgumentParser` flag (TRL-style CLI/YAML parity). Invalid values fail at construction with a
message naming the field and the accepted values.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from trl import GRPOConfig

from tokendyn.config import ProbeConfig, ProbeConfigError
from tokendyn.integrations.vllm_cpu import SAMPLER_DTYPES
from tokendyn.probe.rules import params as rule_params
from tokendyn.probe.tokenloss import POLICY_LOSSES, Objective, surrogate_problem
from tokendyn.remedies import LOPTI_ORDERS
from tokendyn.trainers.config_fields import PROBE_PREFIX, is_number, with_probe_fields, with_rule_fields
from tokendyn.trainers.presets import preset_values

ADVANTAGE_ESTIMATORS = ("grpo", "reinforce_pp", "w_reinforce")


@dataclass
@with_probe_fields
@with_rule_fields
class TokendynGRPOConfig(GRPOConfig):
    r"""
    Configuration of [`TokendynGRPOTrainer`]: all of [`trl.GRPOConfig`] and the fields below.

    Parameters:
        advantage_reweight_alpha (`float`, *optional*, defaults to `0.0`):
            Advantage Reweighting: A_t <- (alpha * pi_old(o_t) + 1 - alpha) * A_t. `0.0` is plain GRPO. Range [0, 1].
        lopti_eta (`float` or `None`, *optional*, defaults to `None`):
            Lopti threshold: tokens with pi_old < eta form the low group. `None` = off. Range (0, 1).
        lopti_quantile (`float` or `None`, *optional*, defaults to `None`):
            Lopti with a data-dependent threshold: the quantile of pi_old over the batch's valid tokens. `None` = off.
            Range (0, 1). Exclusive with `lopti_eta`.
        lopti_order (`str`, *optional*, defaults to `"low_first"`):
            `"low_first"` (the method) or `"high_first"` (the paper's ablation).
        advantage_estimator (`str`, *optional*, defaults to `"grpo"`):
            `"grpo"` (TRL's group-normalised advantages) or `"reinforce_pp"` (batch-whitened returns, no group
            baseline).

        policy_loss (`str`, *optional*, defaults to `"ppo"`):
            `"ppo"` (TRL's surrogate of `loss_type`), `"clip_cov"` or `"kl_cov"` (the covariance remedies of Cui et
            al. 2025 as verl defines them; `tokendyn.remedies.clip_cov_keep`, `kl_cov_select`), with
            `clip_cov_ratio` (2e-4), `clip_cov_lb` (1.0), `clip_cov_ub` (5.0), `kl_cov_ratio` (2e-4), `ppo_kl_coef`
            (0.1), verl's defaults (`PolicyLossConfig`).
        kl_clamp (`bool`, *optional*, defaults to `False`):
            The paper's code's KL: log-ratio clamped to [-5, 5], k3 to [-10, 10].
        advantage_std_eps (`float` or `None`, *optional*, defaults to `None`):
            Group-normalised advantages (r - mean) / (std + eps) with this eps and the unbiased std (the paper's
            code: 1e-6); `None` keeps TRL's (1e-4).

    The paper's K&K setting (docs/paper.md §1.2) is `PRESETS["ar_lopti"]` (`tokendyn train --preset ar_lopti`,
    `TokendynGRPOConfig.from_preset("ar_lopti", ...)`): `loss_type="bnpo"` (the token mean of each micro-batch),
    `advantage_std_eps=1e-6`, `delta=10.0` (TRL's ratio cap on the unclipped branch equals the official dual clip
    min(., -10 A) for A < 0 and never binds for A > 0, where the clipped branch is at most 1 + eps_high),
    `kl_clamp=True`, `beta=0.001` with `use_bias_correction_kl=False` (plain k3), `epsilon=0.2`,
    `epsilon_high=0.24`, `temperature=0.7`, AdamW with `weight_decay=0.01` on every parameter (`weight_decay_all`), `lr_scheduler_type="constant"`,
    `max_grad_norm=1.0`, `advantage_reweight_alpha=0.3`, `lopti_eta=0.5`, low first. Without a preset the fields
    keep TRL's defaults (and `tokendyn train` the embedded defaults of `runner.EMBEDDED_DEFAULTS`: no dual clip, no
    KL clamp, weight decay 0.0, TRL's token mean over the generation batch).
    """

    advantage_reweight_alpha: float = field(
        default=0.0,
        metadata={
            "help": "Advantage Reweighting coefficient alpha: each token's advantage is multiplied by "
            "alpha * pi_old(token) + 1 - alpha, with pi_old the sampling policy's probability at the sampling "
            "temperature (detached). 0.0 (default) is plain GRPO; the paper uses 0.3 on K&K, 0.1 on math. "
            "Range [0, 1]."
        },
    )
    lopti_eta: float | None = field(
        default=None,
        metadata={
            "help": "Lopti (Low-Probability Token Isolation) threshold eta: tokens with pi_old < eta are updated in "
            "a first full update stage, the others in a second one over the same rollout batch. None (default) "
            "disables Lopti; the paper uses 0.5. Range (0, 1). Exclusive with `lopti_quantile`."
        },
    )
    lopti_quantile: float | None = field(
        default=None,
        metadata={
            "help": "Lopti with a quantile threshold: eta is the given quantile of pi_old over the valid tokens of "
            "the rollout batch. None (default) disables it. Range (0, 1). Exclusive with `lopti_eta`."
        },
    )
    lopti_order: str = field(
        default="low_first",
        metadata={
            "help": "Order of the two Lopti stages: 'low_first' (the method) or 'high_first' (the paper's "
            "reversed-order ablation: pi_old >= eta first).",
            "choices": list(LOPTI_ORDERS),
        },
    )
    random_halves: bool = field(
        default=False,
        metadata={
            "help": "Lopti's step-count control: two update stages per rollout batch as Lopti's (same optimizer "
            "steps, same masking of the advantages and the KL term, every token still counted in the loss's "
            "denominator), each valid token's stage a random half (`tokendyn.remedies.random_halves_masks`), not "
            "pi_old < eta. Tells a Lopti effect of the split from one of its two steps. Exclusive with Lopti."
        },
    )
    logp_reweight_c: float = field(
        default=0.0,
        metadata={
            "help": "Delta-log-p direction reweight (Huang et al. 2026, 'Beyond Magnitude'): each token's advantage is "
            "multiplied by 1 + c - c * pi_old(token), up-weighting low-probability tokens (the mirror image of "
            "advantage_reweight_alpha). 0.0 (default) is off; the authors use 0.2 (Qwen2.5-Math-7B) and 0.1 "
            "(Qwen3-8B). >= 0; exclusive with advantage_reweight_alpha."
        },
    )
    w_reinforce_lambda: float = field(
        default=0.1,
        metadata={
            "help": "W-REINFORCE (advantage_estimator 'w_reinforce'): advantage lambda on responses with reward 1, "
            "-1 on reward 0, the reward itself otherwise (no baseline); the authors recommend 0.1. >= 0."
        },
    )
    advantage_estimator: str = field(
        default="grpo",
        metadata={
            "help": "Advantage estimator: 'grpo' (TRL's group-normalised rewards), 'reinforce_pp' (REINFORCE++: "
            "returns whitened over all valid tokens of the rollout batch, no group baseline) or 'w_reinforce' "
            "(W-REINFORCE: lambda on correct, -1 on incorrect responses, `w_reinforce_lambda`).",
            "choices": list(ADVANTAGE_ESTIMATORS),
        },
    )

    policy_loss: str = field(
        default="ppo",
        metadata={
            "help": "The surrogate: 'ppo' (TRL's, by loss_type), 'clip_cov' (Clip-Cov: detach the gradient of a few "
            "random tokens of high advantage/log-prob covariance) or 'kl_cov' (KL-Cov: an |log ratio| penalty on "
            "the tokens of largest covariance; Cui et al. 2025, as verl's policy loss modes), 'dppo_tv' / 'dppo_kl' "
            "(DPPO's trust-region mask on pi - pi_old, as verl's modes), 'aspo' (ASPO: IS weight 1/r for A > 0), "
            "'ce_gppo' (CE-GPPO: bounded gradient on clipped tokens) or 'lp_reg' (Lp-Reg: a KL pull to a min-p "
            "proxy on the lowest-pi negative tokens). Each rule's parameters are the fields named after it.",
            "choices": list(POLICY_LOSSES),
        },
    )
    kl_clamp: bool = field(
        default=False,
        metadata={
            "help": "Clamp the KL term as the paper's code does: log(pi_ref / pi) to [-5, 5], k3 to [-10, 10] "
            "(no gradient where a clamp binds). Default False (TRL's unclamped k3)."
        },
    )
    weight_decay_all: bool = field(
        default=False,
        metadata={
            "help": "Apply weight_decay to every parameter, biases and norm weights included, as the paper's code "
            "(torch AdamW over all parameters). Default False: transformers' groups (no decay on biases and norms)."
        },
    )
    advantage_std_eps: float | None = field(
        default=None,
        metadata={
            "help": "Epsilon of the group-normalised advantages (r - mean) / (std + eps), unbiased std; the paper's "
            "code uses 1e-6. None (default): TRL's own advantages (eps 1e-4). Needs advantage_estimator grpo, "
            "scale_rewards group and multi_objective_aggregation sum_then_normalize."
        },
    )

    vllm_dtype: str = field(
        default="auto",
        metadata={
            "help": "With use_vllm (colocate): the dtype vLLM samples in. auto (default, TRL's): the checkpoint's, "
            "except that vLLM samples a float32 checkpoint in bfloat16; float32, bfloat16 or float16 force it. "
            "run.json's `sampler` says what sampled.",
            "choices": ["auto", "float32", "bfloat16", "float16"],
        },
    )

    vllm_enforce_eager: bool = field(
        default=False,
        metadata={
            "help": "With use_vllm (colocate): build vLLM's engine without torch.compile (vLLM's enforce_eager). On "
            "the CPU it starts in 2-9 s instead of 45-65 s (SmolLM2-135M) and generates 5-50 % slower (bench/vllm_generation.py)."
        },
    )

    probe_every: int = field(
        default=0,
        metadata={
            "help": "Record per-token activation-gradient statistics (binned by pi_old) from the real training "
            "backward into OUTPUT_DIR/records on every K-th rollout (K = this value; it counts rollout batches, "
            "not optimizer steps): rollouts 0, K, 2K, ... are probed in every optimizer step of their update, both "
            "Lopti stages included, and the rebalancing analyses run once on each, at its start; 0 (default) = "
            "off. The probe's "
            "options are the probe_<field> flags, one per `tokendyn.ProbeConfig` field."
        },
    )
    probe_dump_rollouts: bool = field(
        default=False,
        metadata={
            "help": "Also write the first micro-batch of every probed rollout as a rollouts file "
            "(OUTPUT_DIR/rollouts/step-NNNNNN.parquet) that `tokendyn probe` reads."
        },
    )

    probe_floor: bool = field(
        default=True,
        metadata={
            "help": "At each probed step's first micro-batch also recompute the trainer's log-probs of its first 4 "
            "rows' tokens in two halves (same parameters, another kernel shape; one no-grad forward of 4 rows): the "
            "`floor` records, the mismatch the trainer has with itself, beside the sampler's."
        },
    )

    @classmethod
    def from_preset(cls, name: str, **overrides) -> TokendynGRPOConfig:
        """A config with `PRESETS` [name]'s values, ``overrides`` winning (learning rate, sizes, output_dir: the
        user's)."""
        return cls(**{**preset_values(name), **overrides})

    def __post_init__(self):
        self._validate_tokendyn_fields()
        super().__post_init__()
        self._validate_lopti_schedule()

    def probe_config(self) -> ProbeConfig:
        """The `ProbeConfig` of the probe_<field> fields (validated; an error names the probe_ field)."""
        values = {f.name: getattr(self, PROBE_PREFIX + f.name) for f in fields(ProbeConfig)}
        try:
            return ProbeConfig(**values)
        except ProbeConfigError as exc:
            raise ValueError(f"{PROBE_PREFIX}{exc.field}: {exc.message}") from None

    @property
    def lopti_enabled(self) -> bool:
        """Whether Lopti's two-stage update is on."""
        return self.lopti_eta is not None or self.lopti_quantile is not None

    @property
    def two_stages(self) -> bool:
        """Whether each rollout batch is updated in two stages (Lopti, or its random-halves control)."""
        return self.lopti_enabled or bool(self.random_halves)

    def _validate_tokendyn_fields(self) -> None:
        alpha = self.advantage_reweight_alpha
        if not is_number(alpha) or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"advantage_reweight_alpha must be a number in [0, 1] (0 = off), got {alpha!r}")
        for name in ("lopti_eta", "lopti_quantile"):
            value = getattr(self, name)
            if value is not None and (not is_number(value) or not 0.0 < value < 1.0):
                raise ValueError(
                    f"{name} must be None (off) or a number in the open interval (0, 1), got {value!r}"
                )
        if self.lopti_eta is not None and self.lopti_quantile is not None:
            raise ValueError(
                "lopti_eta and lopti_quantile are mutually exclusive: set one of them (or neither to disable Lopti), "
                f"got lopti_eta={self.lopti_eta!r}, lopti_quantile={self.lopti_quantile!r}"
            )
        if not isinstance(self.random_halves, bool):
            raise ValueError(f"random_halves must be true or false, got {self.random_halves!r}")
        if self.random_halves and self.lopti_enabled:
            raise ValueError(
                "random_halves is Lopti's control (random stages instead of pi_old < eta): set it or Lopti, got "
                f"random_halves=True with lopti_eta={self.lopti_eta!r}, lopti_quantile={self.lopti_quantile!r}"
            )
        if self.vllm_dtype not in SAMPLER_DTYPES:
            raise ValueError(
                f"vllm_dtype must be one of {', '.join(SAMPLER_DTYPES)}; got {self.vllm_dtype!r}"
            )
        colocated = self.use_vllm and self.vllm_mode == "colocate"
        for name, unset in (("vllm_dtype", "auto"), ("vllm_enforce_eager", False)):
            if getattr(self, name) != unset and not colocated:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} sets the colocated vLLM engine: it needs use_vllm=True and "
                    f"vllm_mode='colocate' (got use_vllm={self.use_vllm!r}, vllm_mode={self.vllm_mode!r})"
                )
        corrected = self.use_vllm and self.vllm_importance_sampling_correction
        if "no_correction" in (self.probe_compare_rules or ()) and not corrected:
            raise ValueError(
                "probe_compare_rules: no_correction compares the loss without the sampler's importance weights: it "
                f"needs use_vllm=True with vllm_importance_sampling_correction=True (got use_vllm={self.use_vllm!r}, "
                f"vllm_importance_sampling_correction={self.vllm_importance_sampling_correction!r})"
            )
        if self.lopti_order not in LOPTI_ORDERS:
            raise ValueError(
                f"lopti_order must be one of {', '.join(LOPTI_ORDERS)}; got {self.lopti_order!r}"
            )
        if (
            not isinstance(self.probe_every, int)
            or isinstance(self.probe_every, bool)
            or self.probe_every < 0
        ):
            raise ValueError(f"probe_every must be an integer >= 0, got {self.probe_every!r}")
        probe = self.probe_config()
        if not is_number(self.temperature) or self.temperature <= 0:
            raise ValueError(
                f"temperature must be a number > 0 (the sampling temperature), got {self.temperature!r}"
            )
        if self.probe_every and probe.active_analyses:
            Objective.from_config(
                self
            )  # the analyses must reproduce the trained loss: else fail now, naming it
        self._validate_objective_fields()
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"advantage_estimator must be one of {', '.join(ADVANTAGE_ESTIMATORS)}; got {self.advantage_estimator!r}"
            )

    def _validate_objective_fields(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(
                f"policy_loss must be one of {', '.join(POLICY_LOSSES)}; got {self.policy_loss!r}"
            )
        for p in rule_params():
            problem = p.problem(getattr(self, p.name))
            if problem:
                raise ValueError(problem)
        for name in ("logp_reweight_c", "w_reinforce_lambda"):
            value = getattr(self, name)
            if not is_number(value) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.logp_reweight_c and self.advantage_reweight_alpha:
            raise ValueError(
                "advantage_reweight_alpha and logp_reweight_c are mirror images (low-pi tokens tamed vs protected): "
                f"set one of them, got advantage_reweight_alpha={self.advantage_reweight_alpha!r}, "
                f"logp_reweight_c={self.logp_reweight_c!r}"
            )
        if not (
            is_number(self.clip_cov_lb)
            and is_number(self.clip_cov_ub)
            and self.clip_cov_lb < self.clip_cov_ub
        ):
            raise ValueError(
                f"clip_cov_lb, clip_cov_ub: two numbers with lb < ub, got {self.clip_cov_lb!r}, {self.clip_cov_ub!r}"
            )
        problem = surrogate_problem(
            self.policy_loss, self.loss_type, self.importance_sampling_level, self.delta
        )
        if problem:
            raise ValueError(problem)
        if self.policy_loss != "ppo":
            if (
                self.entropy_coef != 0.0
                or self.use_adaptive_entropy
                or self.off_policy_mask_threshold is not None
            ):
                raise ValueError(
                    f"policy_loss {self.policy_loss} takes no entropy bonus and no off-policy mask: set "
                    f"entropy_coef=0.0, use_adaptive_entropy=False, off_policy_mask_threshold=None"
                )
        eps = self.advantage_std_eps
        if eps is not None:
            if not is_number(eps) or eps < 0:
                raise ValueError(f"advantage_std_eps must be None (TRL's) or a number >= 0, got {eps!r}")
            if (
                self.advantage_estimator != "grpo"
                or self.scale_rewards != "group"
                or self.multi_objective_aggregation != "sum_then_normalize"
            ):
                raise ValueError(
                    "advantage_std_eps needs advantage_estimator grpo, scale_rewards group and "
                    "multi_objective_aggregation sum_then_normalize; got "
                    f"{self.advantage_estimator!r}, {self.scale_rewards!r}, {self.multi_objective_aggregation!r}"
                )

    def _validate_lopti_schedule(self) -> None:
        if not self.two_stages:
            return
        passes = self.steps_per_generation * self.num_iterations
        if passes % self.gradient_accumulation_steps != 0:
            raise ValueError(
                "Lopti needs each stage to span whole optimizer steps: steps_per_generation * num_iterations "
                f"({self.steps_per_generation} * {self.num_iterations}) must be a multiple of "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps})"
            )
        if self.entropy_coef != 0.0 or self.use_adaptive_entropy:
            raise ValueError(
                "Lopti does not support the entropy bonus (it would not be masked per stage): set entropy_coef=0.0 "
                f"and use_adaptive_entropy=False, got entropy_coef={self.entropy_coef!r}, "
                f"use_adaptive_entropy={self.use_adaptive_entropy!r}"
            )
