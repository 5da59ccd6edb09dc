"""An entropy bonus in the LM-head identity: dH/dh of the sampled tokens, streamed over the head in float64.

An objective with an entropy term (TRL's ``entropy_coef``: L = ... - c sum_t m_t H_t / N) sends each position a
second logits gradient beside the policy-gradient one, e_t dH_t/dz with e_t = dL/dH_t. With z = (h W^T + b) / T,
pi = softmax(z) and H = -sum_k pi_k log pi_k:

    dH/dz_k = -pi_k (log pi_k + H) = -pi_k (z_k - E[z])          (E: the mean under pi)
    v = dH/dh = -W^T (pi * (z - E[z])) / T = -(E[z W] - E[z] E[W]) / T
    (a soft-capped head: W_k weighted by its slope s_k = 1 - tanh^2, `head.HeadShard.capped`)

so the gradient at the LM-head input is w u + e v (u = d log pi_o / dh, `head.py`): the identity the checks verify,
and delta - e v the policy-gradient part the (1 - pi) bound is about. One pass over the head (online sums relative
to the running maximum of z, as `head.head_partial`).
"""

from __future__ import annotations

import math

import torch

from tokendyn.probe.head import HeadShard, vocab_chunk_rows


def entropy_direction(
    h: torch.Tensor, shard: HeadShard, temperature: float, rows: int | None = None
) -> torch.Tensor:
    """[K, H] float64 v = dH/dh for the K rows of h [K, H] (module docstring); the whole head (``shard.group``
    None)."""
    h64 = h.detach().to(torch.float64)
    k, dev = h64.shape[0], h64.device
    m = torch.full((k,), -math.inf, dtype=torch.float64, device=dev)
    s1, sz = (torch.zeros(k, dtype=torch.float64, device=dev) for _ in range(2))
    acc, accz = (torch.zeros(k, shard.hidden, dtype=torch.float64, device=dev) for _ in range(2))
    for _, w, b in shard.chunks(rows or vocab_chunk_rows(k, shard.hidden)):
        z, slope = shard.capped(h64, w, b, temperature)
        new = torch.maximum(m, z.amax(-1))
        scale = torch.exp(m - new)
        e = torch.exp(z - new.unsqueeze(-1))
        s1 = s1 * scale + e.sum(-1)
        sz = sz * scale + (e * z).sum(-1)
        es = e if slope is None else e * slope  # a soft cap weights row k by its slope (`head.py`)
        acc = acc * scale.unsqueeze(-1) + es @ w
        accz = accz * scale.unsqueeze(-1) + (es * z) @ w
        m = new
    mean_z = (sz / s1).unsqueeze(-1)
    return -(accz / s1.unsqueeze(-1) - mean_z * acc / s1.unsqueeze(-1)) / temperature
