"""What one probed micro-batch hands to `tokendyn.probe.reduce.reduce_step` (`StepData`, with the head checks'
`HeadCheckData`) and what it returns (`StepResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokendyn.probe.bins import BinSpec, ReduceFn
from tokendyn.probe.stats import LogHistogram

Columns = dict[str, list]


@dataclass
class HeadCheckData:
    """What the exact checks need on the check tokens (the first Kc of the sample), taken at the forward (before
    any optimizer step; `tokendyn.probe.head`): u = W^T (e_o - pi) / T, the logits-level ratio, sigma_max(W) and
    the step it was computed at, and what the training backward measured: the gradient rows at the LM-head input,
    and (visible logits only) the logits-level identity error, computed in the backward itself (nothing Kc x V is
    kept)."""

    vocab_size: int
    sigma_max: float
    direction: torch.Tensor  # u = d log pi_o / dh, [Kc, H] float64
    logits_ratio: torch.Tensor  # ||e_o - pi|| / (1 - pi_o), [Kc] float64
    sigma_step: int = -1  # the step at which sigma_max was computed by power iteration
    delta: torch.Tensor | None = None  # measured dL/dh rows [Kc, H]
    logits_identity_err: torch.Tensor | None = (
        None  # ||T dL/dz - w (e_o - pi)|| / ||w (e_o - pi)||, [Kc] float64
    )
    grad_dtype: torch.dtype = torch.float32
    head_dtype: torch.dtype = torch.float32  # the dtype the LM head's product ran in (autocast included)
    rounded: torch.Tensor | None = (
        None  # a 16-bit head: δ predicted with its rounding [Kc, H] (`rounding.py`)
    )
    entropy_direction: torch.Tensor | None = (
        None  # an entropy bonus: v = dH/dh [Kc, H] float64 (`head_entropy`)
    )
    entropy_weight: torch.Tensor | None = None  # e = dL/dH of the check tokens [Kc] float64


@dataclass
class StepData:
    step: int
    stage: str
    rank: int
    micro: int
    points: list[str]
    norms: torch.Tensor  # [P, B, C] total ||dL/dh_l[p(t)]||, float32
    valid: torch.Tensor  # [B, C] bool
    w: torch.Tensor  # [B, C] dL/dlog pi_t
    logp: torch.Tensor  # [B, C] current log pi_t
    pi_old: torch.Tensor | None
    advantages: torch.Tensor | None
    completion_ids: torch.Tensor | None
    temperature: float
    bins: BinSpec
    sample_idx: torch.Tensor  # [K] flat indices into B*C
    sample_valid: torch.Tensor  # [K] bool
    n_record: int  # tokens written to the `tokens` kind (first n of the sample)
    direct: torch.Tensor | None = None  # [P, Kd] ||d log pi / d h||, first Kd of the sample
    check: HeadCheckData | None = None
    final_index: int | None = None
    reached: list[bool] | None = None  # per point: did the backward deliver its gradient (None: all did)
    reduce_fn: ReduceFn | None = None
    hist: LogHistogram = field(default_factory=LogHistogram)


@dataclass
class StepResult:
    """Records of one probed micro-batch, plus the per-token tensors for programmatic use."""

    records: dict[str, Columns]
    edges: list[float]
    bins: torch.Tensor
    norms: torch.Tensor
    w: torch.Tensor
    pi: torch.Tensor
    pi_old: torch.Tensor
