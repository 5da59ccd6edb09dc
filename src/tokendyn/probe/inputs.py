"""The per-step inputs of a probe, validated before any work (clear errors naming the field and accepted range)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepInputs:
    """One probed micro-batch. Shapes: B completions, C completion positions (completion at the end of each row)."""

    step: int
    stage: str
    completion_mask: torch.Tensor  # [B, C] bool
    advantages: torch.Tensor | None  # [B, C] float (a per-completion [B] advantage is broadcast)
    pi_old: torch.Tensor | None  # [B, C] float64 exp(old_logp) in [0, 1]; None: on-policy (pi, detached)
    completion_ids: torch.Tensor | None  # [B, C] sampled ids o_t (needed for the exact checks and "direct")
    temperature: float
    token_positions: torch.Tensor | None  # [B, C] sequence index of o_t; default: the last C positions
    token_rows: torch.Tensor | None  # [B, C] the forward's row holding o_t (a packed layout); default: row b
    logps: torch.Tensor | None  # [B, C] the per-token log pi_t the loss is computed from (w_t = dL/d logps)
    entropy: torch.Tensor | None = (
        None  # [B, C] the entropies H_t of an entropy bonus in the loss (e_t = dL/dH_t)
    )


def _tensor(name: str, value, shape: tuple[int, int] | None = None, device=None) -> torch.Tensor:
    if not torch.is_tensor(value):
        raise TypeError(f"probe: {name} must be a torch.Tensor, got {type(value).__name__}")
    if shape is not None and tuple(value.shape) != shape:
        raise ValueError(
            f"probe: {name} must have shape {list(shape)} (like completion_mask), got {list(value.shape)}"
        )
    return value if device is None else value.detach().to(device)


def _bad(x: torch.Tensor, valid: torch.Tensor) -> bool:
    return bool(x[valid].any())


def validate_inputs(
    *,
    step: int,
    stage: str,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    completion_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    token_positions: torch.Tensor | None = None,
    token_rows: torch.Tensor | None = None,
    logps: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> StepInputs:
    """Check every field; returns detached, normalised tensors (the mask as bool, pi_old as float64)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"probe: step must be an integer >= 0, got {step!r}")
    if not isinstance(stage, str) or not stage:
        raise ValueError(f"probe: stage must be a non-empty string, got {stage!r}")
    mask = _tensor("completion_mask", completion_mask)
    if mask.dim() != 2:
        raise ValueError(
            f"probe: completion_mask must be 2-D [batch, completion_len], got shape {list(mask.shape)}"
        )
    if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("probe: completion_mask must hold only 0 and 1 (or booleans)")
    shape = (int(mask.shape[0]), int(mask.shape[1]))
    valid = mask.detach().bool()
    try:
        temperature = float(temperature)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"probe: temperature must be a number > 0, got {temperature!r}") from exc
    if not temperature > 0:
        raise ValueError(f"probe: temperature must be > 0, got {temperature}")

    adv = None
    if advantages is not None:
        adv = _tensor("advantages", advantages, device=valid.device).detach()
        if adv.dim() == 1 and adv.shape[0] == shape[0]:
            adv = adv.unsqueeze(1).expand(shape)
        elif tuple(adv.shape) != shape:
            raise ValueError(
                f"probe: advantages must have shape [{shape[0]}] or {list(shape)}, got {list(adv.shape)}"
            )
        adv = adv.to(torch.float64)

    p_old = None
    if old_logp is not None:
        lp = _tensor("old_logp", old_logp, shape, valid.device).detach().to(torch.float64)
        if _bad(torch.isnan(lp) | (lp > 1e-6), valid):
            raise ValueError(
                "probe: old_logp must be log-probabilities <= 0 (not NaN) on the completion tokens"
            )
        p_old = torch.exp(lp).clamp(0.0, 1.0)

    ids = None
    if completion_ids is not None:
        ids = _tensor("completion_ids", completion_ids, shape, valid.device).detach()
        if ids.is_floating_point() or ids.is_complex():
            raise ValueError("probe: completion_ids must be an integer tensor of token ids")
        ids = ids.long()

    positions = None
    if token_positions is not None:
        positions = _tensor("token_positions", token_positions, shape, valid.device).detach().long()
        if _bad(positions < 1, valid):
            raise ValueError(
                "probe: token_positions must be >= 1 (a token at position 0 has no predicting position)"
            )

    rows = None
    if token_rows is not None:
        if positions is None:
            raise ValueError(
                "probe: token_rows needs token_positions (the tokens' positions within those rows)"
            )
        rows = _tensor("token_rows", token_rows, shape, valid.device).detach()
        if rows.is_floating_point() or rows.is_complex() or _bad(rows < 0, valid):
            raise ValueError("probe: token_rows must be integer row indices >= 0 of the forward's batch")
        rows = rows.long()

    for name, value, what, grad in (
        ("logps", logps, "per-token log-probability tensor the loss is computed from", "w = dL/dlogps"),
        ("entropy", entropy, "per-token entropy tensor of the loss's entropy bonus", "e = dL/dH"),
    ):
        if value is not None:
            _tensor(name, value, shape)
            if not value.is_floating_point() or not value.requires_grad:
                raise ValueError(
                    f"probe: {name} must be the floating {what} (it must require grad, so that {grad} is read "
                    "during backward)"
                )
    return StepInputs(step, stage, valid, adv, p_old, ids, temperature, positions, rows, logps, entropy)
