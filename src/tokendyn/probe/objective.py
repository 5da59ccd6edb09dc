"""`Objective`: which per-token loss the analyses differentiate (and the trainer trains), as a frozen configuration.

The formulas are the registered rules' (`tokendyn.probe.rules`); this module holds only their selection, their
parameters and the checks on them (one-line errors naming the field and the allowed values).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from tokendyn.probe.rules import POLICY_LOSSES, SURROGATES, surrogate_name
from tokendyn.probe.rules import params as rule_params

if TYPE_CHECKING:
    from tokendyn.probe.batch import ProbeBatch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IS_LEVELS = ("token", "sequence")
# POLICY_LOSSES (imported above, from the rules' table): the surrogate: TRL's ("ppo", by loss_type), or a rule that
# replaces it (Clip-Cov, KL-Cov, DPPO-TV / -KL, ASPO, CE-GPPO, Lp-Reg)
PPO_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # loss types whose surrogate is PPO's clipped ratio


def with_rule_fields(cls):
    """Add one field per registered rule parameter (`tokendyn.probe.rules.params`: name, published default) to
    ``cls`` (before ``@dataclass``): a new rule's parameters need no line here."""
    annotations = cls.__dict__.get("__annotations__", {})
    for p in rule_params():
        annotations[p.name] = "float"
        setattr(cls, p.name, field(default=p.default))
    cls.__annotations__ = annotations
    return cls


@dataclass(frozen=True)
@with_rule_fields
class Objective:
    """The per-token loss l_t, TRL's GRPO loss (trl 1.16 ``GRPOTrainer._compute_loss``) written per token.

    With w_t = log pi_t - log pi_old,t (``importance_sampling_level="token"``) or the sequence's masked mean of it
    (``"sequence"``, GSPO), r_t = exp(w_t), m_t the completion mask, A_t the advantage::

        pg_t = -min(min(r_t, delta) A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)    (eps set; delta optional)
        pg_t = -r_t A_t                                                              (eps None: plain surrogate)
        pg_t = -sg[min(r_t, eps_high)] A_t log pi_t                                  (cispo; sg: stop-gradient)
        pg_t = -(4 / tau_t) sigmoid(tau_t (r_t - 1)) A_t,  tau_t = tau_+ if A_t > 0 else tau_-          (sapo)
        pg_t = -phi_i A_t log pi_t,  phi_i = exp(lam + k log W_i - lam W_i) (k, lam by the sign of A)    (vespo)
                 log W_i = clamp(sum_t m_t clamp(log r_t, -20, 20) + sum_t log rho_t, log 1e-8, 20), detached
        pg_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)) c_t     (policy_loss clip_cov, c_t in {0, 1})
        pg_t = -A_t r_t + s_t ppo_kl_coef |log r_t|                              (policy_loss kl_cov, s_t in {0, 1})
        pg_t = -A_t sg(min(r_t, C)) log pi_t M_t    (dppo_tv / dppo_kl: M_t the trust-region mask on pi - pi_old)
        pg_t = ASPO's flipped IS weight 1/r for A > 0 (aspo), CE-GPPO's bounded clipped gradient (ce_gppo),
               Lp-Reg's proxy KL on the lowest-pi negative tokens (lp_reg)
        pg_t = pg_t * o_i        o_i = 1 if A_i >= 0 or mean_t m_t (log pi_sampler - sg[log pi_t]) <= threshold
        pg_t = pg_t * e_t        e_t = 1 if H_t >= the (1 - top_entropy_quantile)-quantile of the batch's H
        pg_t = pg_t * rho_t      rho_t: vLLM's importance-sampling correction (batch.is_ratio), not for vespo
        kl_t = exp(ref_t - log pi_t) - (ref_t - log pi_t) - 1  (k3),  kl_t *= r_t if bias_correction_kl
        kl_t = clamp(k3(clamp(ref_t - log pi_t, -5, 5)), -10, 10)                   (kl_clamp: the paper's code)
        p_t  = m_t (pg_t + beta kl_t)

    c_t and s_t are Clip-Cov's and KL-Cov's token choices (`tokendyn.remedies.clip_cov_keep`, `kl_cov_select`, over
    the analysed batch; Clip-Cov's random draw on a generator seeded with ``cov_seed``); o_i is TRL's off-policy
    sequence mask (``off_policy_mask_threshold``; pi_sampler = batch.sampling_logp, else pi_old); rho_t (B, C) or
    rho_i (B, 1) is the ratio TRL computes from vLLM's sampling log-probs (``importance_sampling_ratio`` in its
    batch) when ``is_correction``. The aggregation of ``loss_type`` over the analysed batch (B rows, n_i tokens in
    row i, N tokens in all):
    grpo, sapo  l_t = p_t / (n_i B);   bnpo  l_t = p_t / N;   dr_grpo  l_t = p_t / (B max_completion_length);
    dapo, cispo, vespo  l_t = p_t / N (N = batch.normalizer when given);   luspo  l_t = p_t / B. An entropy bonus
    (``entropy_coef`` c, H_t the entropy of pi at position p(t), at the temperature; with adaptive entropy the
    coefficient TRL applies at that step) adds  -c m_t e_t H_t / sum_u m_u e_u.  L = sum_t l_t.

    The batch is taken as one micro-batch on one process: TRL's 1/gradient_accumulation_steps (and DAPO's
    accumulation-window normalizer) is a constant factor and left out, so with gradient_accumulation_steps = 1
    the gradient of L is the training step's own (tests/test_one_loss.py). Zeroing A_t (and the KL term) outside a
    token set makes p_t = 0 there: the loss restricted to a set of tokens is the sum of their l_t, and the
    normalizers still count all tokens. `Objective.from_config` builds it from a `GRPOConfig`.

    Each pg_t is a registered rule (`tokendyn.probe.rules.SURROGATES`, formulas in each rule's docstring), chosen by
    ``policy_loss`` (or ``loss_type`` for TRL's cispo, sapo, vespo); every rule's parameters are fields here too
    (added from that table, with their published defaults: e.g. ``dppo_tv_delta``, ``aspo_eps``, ``lp_reg_rho``).
    """

    eps_low: float | None = None
    eps_high: float | None = None
    delta: float | None = None
    beta: float = 0.0
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    bias_correction_kl: bool = False
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    max_completion_length: int | None = None
    off_policy_mask_threshold: float | None = None
    is_correction: bool = False
    kl_clamp: bool = False
    policy_loss: str = "ppo"
    cov_seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("eps_low", "eps_high"):
            v = getattr(self, name)
            if v is not None and not 0.0 <= float(v) < 1e6:
                raise ValueError(f"objective: {name} must be None or a number >= 0, got {v!r}")
        if (self.eps_low is None) != (self.eps_high is None):
            raise ValueError(
                f"objective: give both eps_low and eps_high (clipping) or neither, got "
                f"eps_low={self.eps_low!r}, eps_high={self.eps_high!r}"
            )
        if self.delta is not None and not float(self.delta) > 1.0:
            raise ValueError(f"objective: delta (ratio cap) must be None or > 1, got {self.delta!r}")
        if not float(self.beta) >= 0.0:
            raise ValueError(f"objective: beta must be >= 0, got {self.beta!r}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(
                f"objective: loss_type must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}"
            )
        if self.importance_sampling_level not in IS_LEVELS:
            raise ValueError(
                f"objective: importance_sampling_level must be one of {', '.join(IS_LEVELS)}, "
                f"got {self.importance_sampling_level!r}"
            )
        for p in rule_params():
            problem = p.problem(getattr(self, p.name))
            if problem:
                raise ValueError(f"objective: {problem}")
        if not 0.0 < float(self.top_entropy_quantile) <= 1.0:
            raise ValueError(
                f"objective: top_entropy_quantile must be in (0, 1], got {self.top_entropy_quantile!r}"
            )
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            raise ValueError("objective: loss_type vespo needs importance_sampling_level 'token' (as TRL)")
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(
                f"objective: policy_loss must be one of {', '.join(POLICY_LOSSES)}, got {self.policy_loss!r}"
            )
        problem = surrogate_problem(
            self.policy_loss, self.loss_type, self.importance_sampling_level, self.delta
        )
        if problem:
            raise ValueError(f"objective: {problem}")
        if SURROGATES[surrogate_name(self)].needs_clip and self.eps_low is None:
            raise ValueError(
                f"objective: policy_loss {self.policy_loss} needs eps_low and eps_high (PPO's clip)"
            )
        if not float(self.clip_cov_lb) < float(self.clip_cov_ub):
            raise ValueError(
                f"objective: clip_cov_lb must be < clip_cov_ub, got {self.clip_cov_lb!r}, {self.clip_cov_ub!r}"
            )
        if self.off_policy_mask_threshold is not None and not float(self.off_policy_mask_threshold) >= 0.0:
            raise ValueError(
                f"objective: off_policy_mask_threshold must be None or >= 0, got {self.off_policy_mask_threshold!r}"
            )
        if self.loss_type == "dr_grpo" and not (
            isinstance(self.max_completion_length, int) and self.max_completion_length > 0
        ):
            raise ValueError(
                f"objective: loss_type dr_grpo needs max_completion_length > 0, got {self.max_completion_length!r}"
            )

    @property
    def rule(self):
        """The registered rule of pg_t (`tokendyn.probe.rules.SurrogateRule`)."""
        return SURROGATES[surrogate_name(self)]

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef != 0.0 or self.top_entropy_quantile < 1.0 or self.rule.needs_entropy

    @property
    def needs_proxy(self) -> bool:
        """Whether pg_t reads Lp-Reg's min-p proxy (batch.proxy_logp)."""
        return self.rule.needs_proxy

    @classmethod
    def from_config(cls, args) -> Objective:
        """The objective a TRL `GRPOConfig` (or `TokendynGRPOConfig`) trains: every TRL 1.16 loss option, and
        tokendyn's ``policy_loss`` (every registered rule, its parameters by name) and ``kl_clamp``. A loss type it does not know raises
        ValueError naming it (checked when a trainer with analyses starts). With ``use_adaptive_entropy`` the
        coefficient is the configured start; the trainer's probe sets the one TRL applies at each analysed step."""
        loss_type = getattr(args, "loss_type", "dapo")
        if loss_type not in LOSS_TYPES:
            raise ValueError(
                f"probe analyses: loss_type={loss_type!r} is not reproduced by the analyses' loss (supported: "
                f"{', '.join(LOSS_TYPES)}); switch it or run with probe_analyses='none'"
            )
        eps = args.epsilon
        eps_high = args.epsilon_high if getattr(args, "epsilon_high", None) is not None else eps  # as TRL
        policy_loss = getattr(args, "policy_loss", "ppo")
        values = {
            p.name: float(getattr(args, p.name))
            for p in rule_params()
            if getattr(args, p.name, None) is not None
        }
        return cls(
            eps_low=eps,
            eps_high=eps_high,
            delta=getattr(args, "delta", None),
            beta=float(getattr(args, "beta", 0.0)),
            loss_type=loss_type,
            importance_sampling_level=getattr(args, "importance_sampling_level", "token"),
            bias_correction_kl=bool(getattr(args, "use_bias_correction_kl", False)),
            top_entropy_quantile=float(getattr(args, "top_entropy_quantile", 1.0)),
            entropy_coef=float(getattr(args, "entropy_coef", 0.0) or 0.0),
            max_completion_length=getattr(args, "max_completion_length", None),
            off_policy_mask_threshold=getattr(args, "off_policy_mask_threshold", None),
            is_correction=bool(
                getattr(args, "use_vllm", False)
                and getattr(args, "vllm_importance_sampling_correction", False)
            ),
            kl_clamp=bool(getattr(args, "kl_clamp", False)),
            policy_loss=policy_loss,
            **values,
        )


COV_FIELDS = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")


def surrogate_problem(policy_loss: str, loss_type: str, importance_sampling_level: str, delta) -> str | None:
    """Why a rule cannot replace this loss's surrogate (None: it can, or policy_loss is "ppo"): the rules of
    ``policy_loss`` (Clip-Cov, KL-Cov, DPPO, ASPO, CE-GPPO, Lp-Reg) are PPO-family token-ratio rules without a ratio
    cap."""
    if policy_loss == "ppo" or (
        loss_type in PPO_FAMILY and importance_sampling_level == "token" and delta is None
    ):
        return None
    return (
        f"policy_loss {policy_loss} replaces PPO's surrogate: it needs loss_type one of {', '.join(PPO_FAMILY)}, "
        f"importance_sampling_level token and delta None; got loss_type={loss_type!r}, "
        f"importance_sampling_level={importance_sampling_level!r}, delta={delta!r}"
    )


@runtime_checkable
class TokenObjective(Protocol):
    """Another stack's loss as the analyses' objective (e.g. `tokendyn.integrations.verl.objective.VerlObjective`):
    ``terms(logp, batch, entropy)`` returns per-token terms l_t, (B, C), zero on padding, whose gradient sums to the
    loss's and whose values sum to L; ``needs_entropy``: the terms also take H_t."""

    needs_entropy: bool

    def terms(
        self, logp: torch.Tensor, batch: ProbeBatch, entropy: torch.Tensor | None = None
    ) -> torch.Tensor: ...
