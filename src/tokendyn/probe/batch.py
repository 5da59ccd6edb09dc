"""`ProbeBatch`: one batch of completions to analyse, validated once (shapes, masks, log-probabilities).

Alignment: a row is prompt + completion, the completion occupying the last C positions of input_ids (S columns,
left padding as TRL builds it). Completion token j sits at sequence index t = S - C + j; the position whose output
predicts it is p(t) = t - 1 = S - C - 1 + j (`tokendyn.probe.forward`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


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
    is_ratio: (B, C) or (B, 1) the importance-sampling correction TRL computes from them (``is_correction``), or
        verl's rollout-correction weights (``rollout_is_weights``, which `VerlObjective` hands to verl's loss).
    proxy_logp: (B, C) log pi_proxy(o_t), Lp-Reg's min-p proxy of pi_old's distribution (`forward.completion_proxy_logp`);
        needed only by the rule lp_reg.
    rewards: (B,) the sequences' rewards, needed only to build W-REINFORCE's advantages in the paired comparison.
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
    proxy_logp: torch.Tensor | None = None
    rewards: torch.Tensor | None = None

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
        if self.proxy_logp is not None:
            p = _as_2d("proxy_logp", self.proxy_logp, (b, c)).detach()
            if bool((torch.isnan(p) | (p > 1e-6))[self.completion_mask].any()):
                raise ValueError("batch: proxy_logp must be log-probabilities <= 0 on the completion tokens")
            object.__setattr__(self, "proxy_logp", p)
        if self.rewards is not None:
            r = self.rewards
            if not torch.is_tensor(r) or tuple(r.shape) != (b,):
                raise ValueError(f"batch: rewards must be a tensor of shape [{b}]")
            object.__setattr__(self, "rewards", r.detach())
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
            proxy_logp=pick(self.proxy_logp),
            rewards=pick(self.rewards),
        )


def signal_rows(advantages: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """(B,) bool: the rows that carry an update signal, some scored token with A_t != 0. A row without one (a group
    whose rewards are all equal, under GRPO) moves nothing through the policy-gradient term; an analysis of it
    measures rounding. ``advantages``: (B,) or (B, C); ``completion_mask``: (B, C)."""
    a = advantages if advantages.dim() == 2 else advantages.reshape(-1, 1).expand_as(completion_mask)
    return ((a != 0) & completion_mask.bool()).any(dim=1)


def signal_first(advantages: torch.Tensor, completion_mask: torch.Tensor, n: int) -> torch.Tensor:
    """The indices of the first ``min(n, B)`` rows once the rows with signal (`signal_rows`) are put before those
    without, each part in its own order: the analysis sample's candidates of one rank."""
    has = signal_rows(advantages, completion_mask)
    order = torch.cat([has.nonzero().squeeze(1), (~has).nonzero().squeeze(1)])
    return order[: min(int(n), has.numel())]
