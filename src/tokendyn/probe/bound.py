"""The (1 - pi) bound: pure functions (docs/paper.md §2, docs/definitions.md).

Notation: z = logits / T, pi = softmax(z), o = the sampled token, w = dL/dlog pi_o (the token's effective weight,
obtained by autograd), V = vocabulary size, W = LM-head weight (V x H), h = the LM-head input.
"""

from __future__ import annotations

import math

import torch


def logits_bound_constants(vocab_size: int) -> tuple[float, float]:
    """(sqrt(V / (V - 1)), sqrt(2)): for every token, sqrt(V/(V-1)) (1 - pi_o) <= ||e_o - pi|| <= sqrt(2) (1 - pi_o)."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    return math.sqrt(vocab_size / (vocab_size - 1)), math.sqrt(2.0)


def one_minus_pi(logp: torch.Tensor) -> torch.Tensor:
    """1 - pi = -expm1(log pi), in float64: accurate also for pi close to 1."""
    return -torch.expm1(logp.detach().to(torch.float64))


def bound_ratio(norm: torch.Tensor, w: torch.Tensor, omp: torch.Tensor) -> torch.Tensor:
    """ratio = ||delta|| / (|w| (1 - pi)), float64; NaN where |w| (1 - pi) = 0 (the ratio is undefined there)."""
    den = w.to(torch.float64).abs() * omp.to(torch.float64)
    ratio = norm.to(torch.float64) / den
    return torch.where(den > 0, ratio, torch.full_like(ratio, float("nan")))


def softmax_grad_norm(pi: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(||e_o - pi||, 1 - pi_o) per row, without cancellation.

    1 - pi_o = s = sum_{k != o} pi_k and ||e_o - pi||^2 = s^2 + sum_{k != o} pi_k^2 (pi: rows of probabilities).
    """
    p = pi.to(torch.float64)
    others = p.scatter(-1, target.long().unsqueeze(-1), 0.0)
    s = others.sum(-1)
    return torch.sqrt(s * s + (others * others).sum(-1)), s


def logits_ratio(pi: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """||d l_t / d z|| / (|w| (1 - pi_o)) = ||e_o - pi|| / (1 - pi_o), since d log pi_o / d z = e_o - pi.

    Computed as sqrt(1 + sum_{k != o} r_k^2) with r_k = pi_k / (1 - pi_o) (the others renormalised), which avoids
    squaring tiny numbers; NaN where 1 - pi_o is 0 in floating point."""
    p = pi.to(torch.float64)
    others = p.scatter(-1, target.long().unsqueeze(-1), 0.0)
    s = others.sum(-1, keepdim=True)
    r = others / s
    ratio = torch.sqrt(1.0 + (r * r).sum(-1))
    return torch.where(s.squeeze(-1) > 0, ratio, torch.full_like(ratio, float("nan")))


def logits_ratio_from_logits(z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The same ratio from z = logits / T: r = softmax of z over k != o, which does not depend on z_o, so the ratio
    sqrt(1 + sum r_k^2) is defined for every token, also where pi_o rounds to 1 (float64)."""
    zo = z.to(torch.float64).scatter(-1, target.long().unsqueeze(-1), float("-inf"))
    r = torch.softmax(zo, dim=-1)
    return torch.sqrt(1.0 + (r * r).sum(-1))


def relative_error(measured: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """||measured - expected|| / ||expected|| per row (float64); NaN where ||expected|| = 0."""
    m, e = measured.to(torch.float64), expected.to(torch.float64)
    den = torch.linalg.vector_norm(e, dim=-1)
    err = torch.linalg.vector_norm(m - e, dim=-1) / den
    return torch.where(den > 0, err, torch.full_like(err, float("nan")))


def head_upper_bound(sigma_max: float, temperature: float) -> float:
    """Provable bound at the LM-head input: ||dL/dh|| / (|w| (1 - pi)) <= sigma_max(W) sqrt(2) / T."""
    return sigma_max * math.sqrt(2.0) / temperature


def rankdata(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks of a 1-D tensor, ties get their average rank (float64)."""
    values, order = torch.sort(x)
    _, inverse, counts = torch.unique_consecutive(values, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).to(torch.float64)
    avg = ends - (counts.to(torch.float64) - 1) / 2
    ranks = torch.empty(x.shape[0], dtype=torch.float64, device=x.device)
    ranks[order] = avg[inverse]
    return ranks


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman rank correlation = Pearson correlation of the (tie-averaged) ranks; NaN if n < 3 or a constant."""
    if x.numel() < 3:
        return float("nan")
    rx, ry = rankdata(x.reshape(-1)), rankdata(y.reshape(-1))
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = torch.sqrt((rx * rx).sum() * (ry * ry).sum())
    if float(den) == 0.0:
        return float("nan")
    return float((rx * ry).sum() / den)
