"""The log-probabilities of a chunk of logits (pure functions of z (n, V) and the sampled ids): log pi and the
entropy, log pi in float64, and Lp-Reg's min-p proxy (`tokendyn.probe.forward`)."""

from __future__ import annotations

import math

import torch
import torch.utils.checkpoint


def logp_and_entropy(z: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(o), H) per row of z (n, V): log pi = log_softmax(z)[o], H = -sum_k pi_k log pi_k."""
    lsm = torch.log_softmax(z, dim=-1)
    return lsm.gather(-1, ids.unsqueeze(-1)).squeeze(-1), -(lsm.exp() * lsm).sum(-1)


def logp_float64(z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log pi(o) = z_o - logsumexp(z) per row of z (n, V), with z cast to float64 first (`completion_logp`)."""
    z = z.to(torch.float64)
    return z.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def minp_proxy_logp(z: torch.Tensor, ids: torch.Tensor, temperature: float, kappa: float) -> torch.Tensor:
    """log pi_proxy(o) per row of z = logits / T (n, V), Lp-Reg's min-p proxy (``apply_min_p``, regular_type "minp";
    Huang et al. 2025, arXiv 2510.03222)::

        keep_v = pi_raw(v) >= kappa max_u pi_raw(u)      (raw logits, before the temperature: z_v T - max z T >= log kappa)
        pi_proxy = softmax(where(keep, z T, -1e4) / T)

    so a filtered ("noise") token gets pi_proxy ~ 0."""
    raw = z * temperature
    keep = raw - raw.max(dim=-1, keepdim=True).values >= math.log(kappa)
    masked = torch.where(keep, raw, torch.full_like(raw, -1e4)) / temperature
    return torch.log_softmax(masked, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
