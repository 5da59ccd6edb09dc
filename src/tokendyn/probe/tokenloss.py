"""Per-token log-probabilities and per-token loss terms of a GRPO-style objective, for one batch of completions.

Every rebalancing analysis (shares, probability change, influence) takes the same inputs, a `ProbeBatch`, and
differentiates the same per-token terms l_t computed here, so sum_t l_t is exactly the loss L whose gradient
they decompose.

Alignment: a row is prompt + completion, the completion occupying the last C positions of input_ids (S columns,
left padding as TRL builds it). Completion token j sits at sequence index t = S - C + j; the position whose output
predicts it is p(t) = t - 1 = S - C - 1 + j. Only the logits of positions S-C-1 .. S-2 are computed, through the
model's own unfused LM head.

Memory: the backbone runs once; its final hidden states of those positions go through the LM head in chunks of at
most `chunk_tokens(V)` tokens (their float64 logits within `CHUNK_BYTES`), each reduced to log pi (and H) before the
next, so no [B, C, V] tensor in float32 or float64 exists; under autograd each chunk is recomputed in the backward
(``torch.utils.checkpoint``), so the graph holds the hidden states, not the logits. A model whose logits are not a
plain affine map of its backbone's output (soft-capping, scaling) is called whole (``logits_to_keep = C + 1``): one
[B, C + 1, V] tensor in the model's dtype, as TRL's training forward holds, and the same chunked log-softmax.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch
import torch.utils.checkpoint
from torch import nn

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IS_LEVELS = ("token", "sequence")
POLICY_LOSSES = (
    "ppo",
    "clip_cov",
    "kl_cov",
)  # the surrogate: TRL's, or a covariance remedy (verl's loss modes)
PPO_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # loss types whose surrogate is PPO's clipped ratio


@dataclass(frozen=True)
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
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None
    is_correction: bool = False
    kl_clamp: bool = False
    policy_loss: str = "ppo"
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    ppo_kl_coef: float = 0.1
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
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if not float(getattr(self, name)) > 0.0:
                raise ValueError(f"objective: {name} must be > 0, got {getattr(self, name)!r}")
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
        if self.policy_loss != "ppo":
            if self.policy_loss == "clip_cov" and self.eps_low is None:
                raise ValueError("objective: policy_loss clip_cov needs eps_low and eps_high (PPO's clip)")
            for name in ("clip_cov_ratio", "kl_cov_ratio"):
                if not 0.0 < float(getattr(self, name)) <= 1.0:
                    raise ValueError(f"objective: {name} must be in (0, 1], got {getattr(self, name)!r}")
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
    def needs_entropy(self) -> bool:
        return self.entropy_coef != 0.0 or self.top_entropy_quantile < 1.0

    @classmethod
    def from_config(cls, args) -> Objective:
        """The objective a TRL `GRPOConfig` (or `TokendynGRPOConfig`) trains: every TRL 1.16 loss option, and
        tokendyn's ``policy_loss`` (Clip-Cov, KL-Cov) and ``kl_clamp``. A loss type it does not know raises
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
        cov = {k: float(getattr(args, k)) for k in COV_FIELDS if getattr(args, k, None) is not None}
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
            sapo_temperature_pos=float(getattr(args, "sapo_temperature_pos", 1.0)),
            sapo_temperature_neg=float(getattr(args, "sapo_temperature_neg", 1.05)),
            vespo_k_pos=float(getattr(args, "vespo_k_pos", 2.0)),
            vespo_lambda_pos=float(getattr(args, "vespo_lambda_pos", 3.0)),
            vespo_k_neg=float(getattr(args, "vespo_k_neg", 3.0)),
            vespo_lambda_neg=float(getattr(args, "vespo_lambda_neg", 2.0)),
            off_policy_mask_threshold=getattr(args, "off_policy_mask_threshold", None),
            is_correction=bool(
                getattr(args, "use_vllm", False)
                and getattr(args, "vllm_importance_sampling_correction", False)
            ),
            kl_clamp=bool(getattr(args, "kl_clamp", False)),
            policy_loss=policy_loss,
            **cov,
        )


COV_FIELDS = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")


def surrogate_problem(policy_loss: str, loss_type: str, importance_sampling_level: str, delta) -> str | None:
    """Why a covariance remedy cannot replace this loss's surrogate (None: it can, or policy_loss is "ppo"):
    Clip-Cov and KL-Cov are PPO-family token-ratio rules without a ratio cap."""
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


def _as_2d(name: str, value: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    if not torch.is_tensor(value):
        raise TypeError(f"batch: {name} must be a torch.Tensor, got {type(value).__name__}")
    if tuple(value.shape) != shape:
        raise ValueError(f"batch: {name} must have shape {list(shape)}, got {list(value.shape)}")
    return value


@dataclass(frozen=True)
class ProbeBatch:
    """One batch of completions to analyse. B rows, S = prompt + completion columns, C completion columns.

    input_ids, attention_mask: (B, S), the completion in the last C columns (left padding).
    completion_mask: (B, C), 1 on scored completion tokens (stored as bool).
    advantages: (B,) one per completion (broadcast) or (B, C) per token (stored as (B, C) float64).
    old_logp: (B, C) log pi_old at the temperature, or None: on-policy, pi_old = the current pi (detached).
    ref_logp: (B, C) log pi_ref, needed only for an objective with beta > 0.
    temperature: T > 0, the logits are divided by T.
    normalizer: N of the token mean; None: the number of completion tokens in this batch.
    sampling_logp: (B, C) log pi of the sampling engine (vLLM's), for the off-policy mask; None: pi_old's.
    is_ratio: (B, C) or (B, 1) the importance-sampling correction TRL computes from them (``is_correction``).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    temperature: float = 1.0
    normalizer: float | None = None
    sampling_logp: torch.Tensor | None = None
    is_ratio: torch.Tensor | None = None

    def __post_init__(self) -> None:
        ids = self.input_ids
        if not torch.is_tensor(ids) or ids.dim() != 2 or ids.is_floating_point():
            raise ValueError("batch: input_ids must be an integer tensor of shape (B, S)")
        b, s = ids.shape
        _as_2d("attention_mask", self.attention_mask, (b, s))
        cm = self.completion_mask
        if not torch.is_tensor(cm) or cm.dim() != 2 or cm.size(0) != b:
            raise ValueError(
                f"batch: completion_mask must have shape (B={b}, C), got {list(getattr(cm, 'shape', []))}"
            )
        c = cm.size(1)
        if not 1 <= c < s:
            raise ValueError(f"batch: completion length C must be in 1..S-1 = {s - 1}, got C = {c}")
        if cm.dtype != torch.bool:
            if bool(((cm != 0) & (cm != 1)).any()):
                raise ValueError("batch: completion_mask must hold only 0 and 1 (or booleans)")
            object.__setattr__(self, "completion_mask", cm.bool())
        if bool((self.completion_mask & (self.attention_mask[:, -c:] == 0)).any()):
            raise ValueError(
                "batch: every scored completion token must be attended (attention_mask = 1 there)"
            )
        adv = self.advantages
        if not torch.is_tensor(adv):
            raise TypeError(f"batch: advantages must be a torch.Tensor, got {type(adv).__name__}")
        if adv.dim() == 1 and adv.size(0) == b:
            adv = adv.unsqueeze(1).expand(b, c)
        _as_2d("advantages (or shape (B,))", adv, (b, c))
        adv = adv.detach().to(torch.float64)
        if not bool(torch.isfinite(adv[self.completion_mask]).all()):
            raise ValueError("batch: advantages must be finite on the completion tokens")
        object.__setattr__(self, "advantages", adv)
        for name in ("old_logp", "ref_logp", "sampling_logp"):
            v = getattr(self, name)
            if v is not None:
                v = _as_2d(name, v, (b, c)).detach()
                bad = (
                    v > 1e-6 if name == "sampling_logp" else torch.isnan(v) | (v > 1e-6)
                )  # vLLM: NaN unscored
                if bool(bad[self.completion_mask].any()):
                    raise ValueError(f"batch: {name} must be log-probabilities <= 0 on the completion tokens")
                object.__setattr__(self, name, v)
        if self.is_ratio is not None:
            r = self.is_ratio
            if not torch.is_tensor(r) or tuple(r.shape) not in ((b, c), (b, 1)):
                raise ValueError(f"batch: is_ratio must have shape [{b}, {c}] or [{b}, 1]")
            r = r.detach()
            if not bool((torch.isfinite(r) & (r >= 0)).all()):
                raise ValueError("batch: is_ratio must hold finite numbers >= 0")
            object.__setattr__(self, "is_ratio", r)
        try:
            t = float(self.temperature)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"batch: temperature must be a number > 0, got {self.temperature!r}") from exc
        if not t > 0:
            raise ValueError(f"batch: temperature must be > 0, got {t}")
        object.__setattr__(self, "temperature", t)
        if self.normalizer is not None and not float(self.normalizer) > 0:
            raise ValueError(f"batch: normalizer must be None or > 0, got {self.normalizer!r}")

    @property
    def n_completion(self) -> int:
        return int(self.completion_mask.size(1))

    @property
    def completion_ids(self) -> torch.Tensor:
        """o_t: the sampled ids, the last C columns of input_ids, (B, C)."""
        return self.input_ids[:, -self.n_completion :]

    @property
    def n_tokens(self) -> int:
        return int(self.completion_mask.sum())

    @property
    def norm(self) -> float:
        """N of the token mean: `normalizer`, or the number of completion tokens (at least 1)."""
        return float(self.normalizer) if self.normalizer is not None else float(max(self.n_tokens, 1))

    def with_old_logp(self, old_logp: torch.Tensor) -> ProbeBatch:
        return replace(self, old_logp=old_logp.detach())

    def select(self, rows: torch.Tensor | slice) -> ProbeBatch:
        """A sub-batch of rows (e.g. the sample a trainer probes); the normalizer is kept as given (None: the
        sub-batch's own token count)."""

        def pick(x):
            return None if x is None else x[rows]

        return replace(
            self,
            input_ids=self.input_ids[rows],
            attention_mask=self.attention_mask[rows],
            completion_mask=self.completion_mask[rows],
            advantages=self.advantages[rows],
            old_logp=pick(self.old_logp),
            ref_logp=pick(self.ref_logp),
            sampling_logp=pick(self.sampling_logp),
            is_ratio=pick(self.is_ratio),
        )


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The layers Hugging Face's gradient checkpointing is switched on for (``gradient_checkpointing_enable``): the
    modules whose ``gradient_checkpointing`` flag is set, each checkpointing its own forward."""
    return [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]


@contextmanager
def eval_mode(model: nn.Module, checkpoint: bool = True) -> Iterator[nn.Module]:
    """Every submodule in eval mode (no dropout), each one's flag restored on exit.

    Memory: where training checkpoints its layers (``model.gradient_checkpointing_enable()``) and ``checkpoint``,
    those layers keep checkpointing in the analyses' gradient passes, non-reentrant whatever training uses (the
    analyses differentiate with ``torch.autograd.grad``, which reentrant checkpointing refuses): an analysis then holds
    each layer's input and one layer's recomputation, as the checkpointed training step does, instead of every
    layer's activations. The layer itself is flagged training (Hugging Face checkpoints only in training mode); its
    submodules stay in eval mode, so dropout stays off and the numbers are those of an unchecked forward."""
    flags = [(m, m.training) for m in model.modules()]
    layers = checkpointed_layers(model) if checkpoint else []
    funcs = [(m, m.__dict__.get("_gradient_checkpointing_func")) for m in layers]
    model.eval()
    for m in layers:
        m.training = True
        m._gradient_checkpointing_func = _checkpoint
    try:
        yield model
    finally:
        for m, flag in flags:
            m.training = flag
        for m, func in funcs:
            if func is None:
                m.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                m._gradient_checkpointing_func = func


def _checkpoint(function, *args, **kwargs):
    """Non-reentrant ``torch.utils.checkpoint``; a forward under `tokendyn.probe.float64.exact_float64` is
    recomputed under it too (the backward's recomputation does not see the mode of the forward)."""
    from tokendyn.probe.float64 import same_mode

    return torch.utils.checkpoint.checkpoint(same_mode(function), *args, use_reentrant=False, **kwargs)


def trainable_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> parameter, for every parameter that requires grad (tied weights appear once)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


# Logits are never held for every completion token at once: the LM head is applied to chunks of at most
# `chunk_tokens(V)` tokens, whose float64 logits [n, V] take at most CHUNK_BYTES (Qwen2.5's V = 152,064: 220 tokens).
CHUNK_BYTES = 1 << 28
_SPLIT_OK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HEAD_OK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # the same check with the soft cap modelled
_ANALYSIS = contextvars.ContextVar("tokendyn_analysis_forward", default=False)


def analysis_forward(fn):
    """Decorator of the analyses' entry points: inside them the model's forward may stop at the backbone even when
    hooks sit on the model itself (a `GradientProbe`'s, which the analyses' forwards must not feed: they are not
    training passes). Outside, a model with such hooks is called whole, so that they see the forward."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        token = _ANALYSIS.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _ANALYSIS.reset(token)

    return wrapped


def chunk_tokens(vocab: int, budget: int | None = None) -> int:
    """n = max(1, floor(budget / (8 V))): the tokens per chunk whose float64 logits [n, V] fit in ``budget`` bytes
    (default `CHUNK_BYTES`)."""
    return max(1, int(CHUNK_BYTES if budget is None else budget) // (8 * max(int(vocab), 1)))


@dataclass
class _Features:
    """What the LM head is applied to, one row per completion token (N = B * C, row-major over (B, C)): the final
    hidden states h (N, H) with the head's weight and bias, or, for a model whose head is not a plain affine map
    of a backbone's output, its logits (N, V) in the model's dtype (weight None)."""

    x: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None


class _Parts(nn.Module):
    """Backbone and head of a causal LM, called apart (under ``functional_call`` the swapped tensors are used)."""

    def __init__(self, lm: nn.Module, backbone: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.lm = lm
        object.__setattr__(self, "_backbone", backbone)  # submodules of lm: not registered twice
        object.__setattr__(self, "_head", head)

    def forward(self, input_ids, attention_mask):
        out = self._backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return h, self._head.weight, self._head.bias


def _peft_base(model: nn.Module) -> nn.Module | None:
    """The Hugging Face causal LM inside PEFT's wrappers (PeftModel or PeftMixedModel -> its tuner, e.g. LoraModel ->
    the model, whose layers hold the adapters), the model itself when it is not wrapped, None for a prompt-learning
    adapter (prefix / prompt tuning: the wrapper's forward adds virtual tokens, so the inner model's backbone alone
    is not the model's forward). A model can only be wrapped by PEFT once PEFT is imported (``sys.modules``)."""
    peft = sys.modules.get("peft")
    if peft is None:
        return model
    wrappers = tuple(
        c for c in (getattr(peft, "PeftModel", None), getattr(peft, "PeftMixedModel", None)) if c
    )
    if wrappers and isinstance(model, wrappers):
        config = getattr(model, "active_peft_config", None)
        if getattr(config, "is_prompt_learning", False):
            return None
        model = model.base_model
    tuner = getattr(sys.modules.get("peft.tuners.tuners_utils"), "BaseTuner", None)
    if tuner is not None and isinstance(model, tuner):
        model = model.model
    return model


def _split(model: nn.Module, softcap: bool = False) -> tuple[nn.Module, nn.Linear] | None:
    """(backbone, head) when logits = head(backbone(ids).last_hidden_state) with a plain `nn.Linear` head (a Hugging
    Face causal LM, also inside a PEFT wrapper (`_peft_base`): its ``base_model_prefix`` names the backbone), else
    None. Both are submodules of ``model``, so parameters substituted by their names in ``model`` reach them."""
    from tokendyn.probe.points import head_transform_supported

    lm = _peft_base(model)
    if lm is None:
        return None
    prefix = getattr(lm, "base_model_prefix", None)
    backbone = getattr(lm, prefix, None) if isinstance(prefix, str) and prefix else None
    get_head = getattr(lm, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(backbone, nn.Module) or backbone is lm or type(head) is not nn.Linear:
        return None
    return (backbone, head) if head_transform_supported(lm, softcap=softcap) else None


def _split_checked(
    model: nn.Module, batch: ProbeBatch, softcap: bool = False
) -> tuple[nn.Module, nn.Linear] | None:
    """`_split`, confirmed once per model on the batch's first row: the head applied to the backbone's last hidden
    state (and, with ``softcap``, the model's soft cap c tanh(z / c) after it) reproduces the model's own last logit
    within float rounding (a model that scales its hidden state or logits in its forward, e.g. MiniCPM, falls back
    to the model's full forward, and so does a split whose "backbone" output is not as wide as the head's input)."""
    from tokendyn.probe.points import logit_softcap

    parts = _split(model, softcap=softcap)
    if parts is None:
        return None
    cache = _HEAD_OK if softcap else _SPLIT_OK
    ok = cache.get(model)
    if ok is None:
        ids, mask = batch.input_ids[:1], batch.attention_mask[:1]
        with torch.no_grad(), eval_mode(model):
            kwargs = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
            if _accepts_logits_to_keep(model):
                kwargs["logits_to_keep"] = 1
            out = model(**kwargs)
            want = (out.logits if hasattr(out, "logits") else out[0])[:, -1].float()
            h = _Parts(model, *parts)(ids, mask)[0]
            # a "backbone" whose output is not the head's input (e.g. a wrapper's whole model) is no split
            ok = h.dim() == 3 and h.size(-1) == parts[1].weight.size(1)
            if ok:
                got = torch.nn.functional.linear(h[:, -1], parts[1].weight, parts[1].bias).float()
                cap = logit_softcap(model) if softcap else None
                if cap is not None:
                    got = cap * torch.tanh(got / cap)
                # the same logits to the rounding of the head's dtype (bf16: its soft cap applied in bf16 by the
                # model, in float32 here, differs by ~2^-8 of |z|); a wrong split is off by O(|z|)
                tol = max(1e-3, 8 * torch.finfo(parts[1].weight.dtype).eps)
                ok = bool(((got - want).abs().max() <= tol * want.abs().max() + 1e-6).item())
        cache[model] = ok
    return parts if ok else None


def _splittable(model: nn.Module) -> bool:
    """Whether an analysis forward may stop at the backbone: not for a model with hooks on its own forward outside
    `analysis_forward`, one sharded by FSDP2 (the root's hooks gather the embeddings, final norm and head: it is
    called whole) or one dispatched by accelerate's hooks."""
    from tokendyn.probe.parallel import fsdp_modules

    hooked = bool(model._forward_hooks or model._forward_pre_hooks) and not _ANALYSIS.get()
    return not (hooked or fsdp_modules(model) or hasattr(model, "_hf_hook"))


def _features(model: nn.Module, batch: ProbeBatch, params: dict[str, torch.Tensor] | None) -> _Features:
    """One forward of the model (through ``torch.func.functional_call`` with ``params`` when given), stopping
    before the LM head where it can (`_split_checked`; not for a model with hooks on its own forward outside
    `analysis_forward`, nor one dispatched by accelerate's hooks)."""
    from tokendyn.probe.parallel import fsdp_modules, reshard

    c = batch.n_completion
    sharded = bool(fsdp_modules(model))
    parts = _split_checked(model, batch) if _splittable(model) else None
    if parts is not None:
        call = _Parts(model, *parts)
        args = (batch.input_ids, batch.attention_mask)
        if params is None:
            h, w, b = call(*args)
        else:
            h, w, b = torch.func.functional_call(call, {f"lm.{n}": p for n, p in params.items()}, args)
        h = h[:, -(c + 1) : -1, :]
        return _Features(h.reshape(-1, h.size(-1)), w, b)
    kwargs: dict = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "use_cache": False}
    if _accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = c + 1
    if sharded and params is not None:
        raise ValueError("probe: a model sharded with FSDP2 cannot be called with substituted parameters")
    out = model(**kwargs) if params is None else torch.func.functional_call(model, params, (), kwargs)
    if sharded and not torch.is_grad_enabled():
        reshard(model)  # no backward follows: drop the gathered copy FSDP2 keeps (`parallel.reshard`)
    logits = out.logits if hasattr(out, "logits") else out[0]
    logits = logits[:, -(c + 1) : -1, :]
    return _Features(logits.reshape(-1, logits.size(-1)), None, None)


def head_inputs(
    model: nn.Module, batch: ProbeBatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(h, W, b): the LM head's input for every completion token (B * C, H), row-major over (B, C), with the head's
    weight and bias, from one forward of the backbone (a soft-capped head included: the caller models the cap,
    `tokendyn.probe.points.logit_softcap`); None where the head is not a plain affine map of the backbone's output
    (`_split_checked`), or the forward may not stop there (`_splittable`)."""
    parts = _split_checked(model, batch, softcap=True) if _splittable(model) else None
    if parts is None:
        return None
    h, w, b = _Parts(model, *parts)(batch.input_ids, batch.attention_mask)
    c = batch.n_completion
    h = h[:, -(c + 1) : -1, :]
    return h.reshape(-1, h.size(-1)), w, b


def chunk_logits(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """z = (x W^T + b) / T (x: final hidden states) or z = x / T (x: logits), in float32 or wider, (n, V)."""
    z = x if weight is None else torch.nn.functional.linear(x, weight, bias)
    return z.to(torch.promote_types(z.dtype, torch.float32)) / temperature


def logp_and_entropy(z: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(o), H) per row of z (n, V): log pi = log_softmax(z)[o], H = -sum_k pi_k log pi_k."""
    lsm = torch.log_softmax(z, dim=-1)
    return lsm.gather(-1, ids.unsqueeze(-1)).squeeze(-1), -(lsm.exp() * lsm).sum(-1)


def logp_float64(z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log pi(o) = z_o - logsumexp(z) per row of z (n, V), with z cast to float64 first (`completion_logp`)."""
    z = z.to(torch.float64)
    return z.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def _chunk_values(
    x, weight, bias, ids, temperature: float, kinds: tuple[str, ...]
) -> tuple[torch.Tensor, ...]:
    z = chunk_logits(x, weight, bias, temperature)
    out = []
    if "logp" in kinds or "entropy" in kinds:
        if "entropy" in kinds:
            out.extend(logp_and_entropy(z, ids))
        else:
            out.append(torch.log_softmax(z, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1))
    if "logp64" in kinds:
        out.append(logp_float64(z, ids))
    return tuple(out)


def _token_values(
    model: nn.Module,
    batch: ProbeBatch,
    params: dict[str, torch.Tensor] | None,
    kinds: tuple[str, ...],
) -> tuple[torch.Tensor, ...]:
    """Per-token values of every completion token, (B, C) each, in the order of ``kinds`` (from "logp", "entropy":
    float32 or wider, "logp64": float64), from one forward and the LM head applied chunk by chunk (`chunk_tokens`
    tokens at a time): no [B, C, V] float32 or float64 tensor exists. Under autograd each chunk is recomputed in
    the backward (``torch.utils.checkpoint``): the graph keeps the hidden states, never the logits."""
    f = _features(model, batch, params)
    vocab = f.x.size(-1) if f.weight is None else f.weight.size(0)
    ids = batch.completion_ids.to(f.x.device).reshape(-1)
    n = chunk_tokens(vocab)
    track = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (f.x, f.weight, f.bias)
    )
    pieces = []
    for lo in range(0, ids.numel(), n):
        args = (f.x[lo : lo + n], f.weight, f.bias, ids[lo : lo + n], batch.temperature, kinds)
        if track and "logp64" not in kinds:
            pieces.append(_checkpoint(_chunk_values, *args))
        else:
            pieces.append(_chunk_values(*args))
    shape = batch.completion_ids.shape
    return tuple(torch.cat([p[i] for p in pieces]).reshape(shape) for i in range(len(kinds)))


def completion_logp(
    model: nn.Module,
    batch: ProbeBatch,
    params: dict[str, torch.Tensor] | None = None,
    *,
    float64: bool = False,
) -> torch.Tensor:
    """log pi_t(o_t) at temperature T for every completion token, (B, C), differentiable.

    z = logits[p(t)] / T with p(t) = t - 1 (see the module docstring), log pi_t = log_softmax(z)[o_t]; computed in
    float32 or wider. With ``params`` the model is called through ``torch.func.functional_call`` with those
    tensors in place of its parameters (the module itself is not modified). The LM head is applied to chunks of
    tokens (`chunk_tokens`), so the full [B, C, V] logits are never materialised (`_token_values`).

    ``float64=True`` (for measuring probability changes, `tokendyn.probe.change`): log pi_t = z_o - logsumexp(z)
    with the model's logits cast to float64 first, chunk by chunk. In float32, log pi_t = z_o - logsumexp(z) is a
    difference of two numbers of size |z| ~ 10-30 whose rounding (~1e-6) swamps 1 - pi below ~1e-6: a near-certain
    token has log pi = 0.0 exactly and no change of it is visible. In float64 the same difference resolves log pi to
    ~1e-14, so a change of pi of 1e-12 still has its sign. What remains is the model's own forward precision: a
    change of the logits below their rounding (float32: ~1e-7 of |z|) is noise.
    """
    return _token_values(model, batch, params, ("logp64",) if float64 else ("logp",))[0]


def loss_and_measured_logp(model: nn.Module, batch: ProbeBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi_t as the loss computes it, log pi_t in float64 for measuring changes), from one forward without
    grad in eval mode: the same values as `completion_logp` without and with ``float64``."""
    with torch.no_grad(), eval_mode(model):
        return _token_values(model, batch, None, ("logp", "logp64"))


def completion_logp_entropy(
    model: nn.Module, batch: ProbeBatch, params: dict[str, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi_t(o_t), H_t) for every completion token, (B, C) each, differentiable: H_t = -sum_k pi_k log pi_k,
    the entropy of the temperature-scaled distribution at p(t) (what TRL's entropy bonus and entropy mask use)."""
    return _token_values(model, batch, params, ("logp", "entropy"))


def loss_terms(
    logp: torch.Tensor,
    batch: ProbeBatch,
    objective: Objective | TokenObjective | None = None,
    entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """The per-token terms l_t, (B, C), zero on padding, sum = L (formula: `Objective`; a `TokenObjective`, another
    stack's loss, computes its own).

    ``logp`` is log pi_t (B, C); pi_old is batch.old_logp, or logp.detach() when None (ratio 1, gradient of the
    plain surrogate -A_t log pi_t). ``entropy``: H_t (B, C), needed when the objective has an entropy bonus or an
    entropy mask (`completion_logp_entropy`)."""
    objective = objective or Objective()
    if objective.needs_entropy and entropy is None:
        raise ValueError("objective: an entropy bonus or top_entropy_quantile < 1 needs the entropies H_t")
    if not isinstance(objective, Objective):
        return objective.terms(logp, batch, entropy)
    mask = batch.completion_mask.to(logp.device)
    m = mask.to(logp.dtype)
    zero = torch.zeros_like(logp)
    adv = batch.advantages.to(device=logp.device, dtype=logp.dtype)
    old = logp.detach() if batch.old_logp is None else batch.old_logp.to(device=logp.device, dtype=logp.dtype)
    token_log_ratio = torch.where(mask, logp - old, zero)
    log_ratio = token_log_ratio
    if objective.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    is_ratio = None
    if objective.is_correction:
        if batch.is_ratio is None:
            raise ValueError(
                "objective: is_correction needs batch.is_ratio (TRL's importance_sampling_ratio)"
            )
        is_ratio = batch.is_ratio.to(device=logp.device, dtype=logp.dtype)
    pg = _surrogate(objective, logp, ratio, token_log_ratio, adv, mask, is_ratio)
    if objective.off_policy_mask_threshold is not None:
        pg = pg * _off_policy_mask(objective, logp, old, batch, adv, mask)
    keep = m
    if objective.top_entropy_quantile < 1.0:
        keep = m * _high_entropy_mask(entropy.detach(), mask, objective.top_entropy_quantile).to(m.dtype)
        pg = pg * keep
    if is_ratio is not None and objective.loss_type != "vespo":
        pg = pg * is_ratio
    if objective.beta > 0:
        if batch.ref_logp is None:
            raise ValueError("objective: beta > 0 needs batch.ref_logp (log pi_ref of the completion tokens)")
        ref = batch.ref_logp.to(device=logp.device, dtype=logp.dtype)
        d = torch.where(mask, ref - logp, zero)
        if objective.kl_clamp:
            d = torch.clamp(d, -5.0, 5.0)
            kl = torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)
        else:
            kl = torch.exp(d) - d - 1.0
        pg = pg + objective.beta * (kl * ratio if objective.bias_correction_kl else kl)
    per_token = torch.where(mask, pg, zero)
    b = logp.size(0)
    if objective.loss_type in ("grpo", "sapo"):
        terms = per_token / (m.sum(-1, keepdim=True).clamp(min=1.0) * b)
    elif objective.loss_type == "luspo":
        terms = per_token / b
    elif objective.loss_type == "bnpo":
        terms = per_token / m.sum().clamp(min=1.0)
    elif objective.loss_type == "dr_grpo":
        terms = per_token / (b * objective.max_completion_length)
    else:  # dapo, cispo, vespo
        terms = per_token / batch.norm
    if objective.entropy_coef:
        terms = terms - objective.entropy_coef * keep * entropy / keep.sum().clamp(min=1.0)
    return terms


def _surrogate(objective, logp, ratio, token_log_ratio, adv, mask, is_ratio) -> torch.Tensor:
    """pg_t before the masks, by ``loss_type`` and ``policy_loss`` (formulas: `Objective`)."""
    from tokendyn.remedies import clip_cov_keep, kl_cov_select

    masked_logp = torch.where(mask, logp, torch.zeros_like(logp))
    if objective.policy_loss == "clip_cov":
        generator = None
        if objective.cov_seed is not None:
            generator = torch.Generator().manual_seed(int(objective.cov_seed))
        keep = clip_cov_keep(
            adv,
            logp,
            ratio,
            mask,
            objective.eps_low,
            objective.eps_high,
            objective.clip_cov_ratio,
            objective.clip_cov_lb,
            objective.clip_cov_ub,
            generator=generator,
        )
        clipped = torch.clamp(ratio, 1.0 - objective.eps_low, 1.0 + objective.eps_high)
        return torch.maximum(-adv * ratio, -adv * clipped) * keep
    if objective.policy_loss == "kl_cov":
        chosen = kl_cov_select(adv, logp, mask, objective.kl_cov_ratio)
        penalty = objective.ppo_kl_coef * torch.where(chosen, token_log_ratio.abs(), torch.zeros_like(logp))
        return -adv * ratio + penalty
    if objective.loss_type == "cispo":
        weight = ratio if objective.eps_high is None else torch.clamp(ratio, max=objective.eps_high)
        return -weight.detach() * adv * masked_logp
    if objective.loss_type == "sapo":
        tau = torch.where(
            adv > 0,
            torch.full_like(adv, objective.sapo_temperature_pos),
            torch.full_like(adv, objective.sapo_temperature_neg),
        )
        return -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv
    if objective.loss_type == "vespo":
        return -_vespo_weights(objective, token_log_ratio, adv, mask, is_ratio) * adv * masked_logp
    capped = ratio if objective.delta is None else torch.clamp(ratio, max=objective.delta)
    if objective.eps_low is None:
        return -capped * adv
    clipped = torch.clamp(ratio, 1.0 - objective.eps_low, 1.0 + objective.eps_high)
    return -torch.minimum(capped * adv, clipped * adv)


def _vespo_weights(objective, token_log_ratio, adv, mask, is_ratio) -> torch.Tensor:
    """phi_i = exp(lam + k log W_i - lam W_i), detached (B, 1), with (k, lam) = (k_+, lam_+) where A >= 0 else
    (k_-, lam_-), and log W_i = clamp(sum_t m_t clamp(log r_t, -20, 20) + sum_t clamp(log rho_t, log 1e-8, 20),
    log 1e-8, 20) (VESPO's gamma weight, normalised so phi(1) = 1; a non-finite phi is 0); (B, C)."""
    import math

    m = mask.to(token_log_ratio.dtype)
    lower = math.log(1e-8)
    log_w = (torch.clamp(token_log_ratio.detach(), -20.0, 20.0) * m).sum(-1, keepdim=True)
    if is_ratio is not None:
        log_w = log_w + torch.clamp(torch.log(is_ratio), lower, 20.0).sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, lower, 20.0)
    nonneg = adv >= 0  # per token, as TRL's where() on (B, 1) or per-token (B, T) advantages
    k = torch.where(nonneg, objective.vespo_k_pos, objective.vespo_k_neg).to(log_w.dtype)
    lam = (
        torch.where(nonneg, objective.vespo_lambda_pos, objective.vespo_lambda_neg)
        .to(log_w.dtype)
        .clamp(min=1e-4)
    )
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _off_policy_mask(objective, logp, old, batch, adv, mask) -> torch.Tensor:
    """o_t = 1 where A_t >= 0 or the sequence's mean of (log pi_sampler - sg[log pi_t]) over its tokens is <= the
    threshold (TRL's get_off_policy_mask, DeepSeek-V3.2; NaN sampler log-probs count 0), else 0. (B, C)."""
    sampler = (
        old if batch.sampling_logp is None else batch.sampling_logp.to(device=logp.device, dtype=logp.dtype)
    )
    m = mask.to(logp.dtype)
    kl = torch.nan_to_num(sampler - logp.detach(), nan=0.0)
    mean_kl = (kl * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    return ((adv >= 0) | (mean_kl <= objective.off_policy_mask_threshold)).to(logp.dtype)


def _high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, top: float) -> torch.Tensor:
    """e_t = H_t >= the (1 - top)-quantile of H over the batch's completion tokens (TRL's get_high_entropy_mask on
    one process), and 0 on padding."""
    valid = entropy[mask].float()
    if valid.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(valid, 1.0 - top)
    return ((entropy * mask) >= threshold) & mask


@dataclass
class TokenLoss:
    """logp: log pi_t (B, C); terms: l_t (B, C); loss: L = sum_t l_t (0-d)."""

    logp: torch.Tensor
    terms: torch.Tensor
    loss: torch.Tensor


def token_loss(
    model: nn.Module,
    batch: ProbeBatch,
    objective: Objective | None = None,
    params: dict[str, torch.Tensor] | None = None,
) -> TokenLoss:
    """Forward the batch and return log pi_t, the per-token loss terms l_t and L = sum_t l_t
    (`completion_logp` or `completion_logp_entropy`, then `loss_terms`): the one loss every analysis uses."""
    objective = objective or Objective()
    if objective.needs_entropy:
        logp, entropy = completion_logp_entropy(model, batch, params)
    else:
        logp, entropy = completion_logp(model, batch, params), None
    terms = loss_terms(logp, batch, objective, entropy)
    return TokenLoss(logp, terms, terms.sum())


def bin_index(pi: torch.Tensor, mask: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Bin of every token by probability (`tokendyn.probe.bins.assign_bins`: [e_b, e_b+1), last bin closed);
    -1 on padding. (B, C) long."""
    from tokendyn.probe.bins import assign_bins

    idx = assign_bins(pi.detach(), edges.to(pi.device))
    return torch.where(mask.to(pi.device), idx, torch.full_like(idx, -1))


def pi_old(model: nn.Module, batch: ProbeBatch) -> torch.Tensor:
    """pi_old of every completion token as float64 (B, C): exp(batch.old_logp), or the current pi (eval mode,
    no grad) when the batch is on-policy."""
    if batch.old_logp is not None:
        return torch.exp(batch.old_logp.to(torch.float64))
    with torch.no_grad(), eval_mode(model):
        return torch.exp(completion_logp(model, batch, float64=True))
