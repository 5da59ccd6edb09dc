"""The LM-head identity when the head computes in 16 bits: the prediction rounded as the head rounds.

In float32 the identity δ = w W^T (e_o - π) / T holds to float32 rounding, and the checks compare the recorded δ
with its float64 value (`head.py`). A head that computes in bfloat16 or float16 (autocast, or 16-bit weights; TRL's
fused head in its autocast dtype) rounds its inputs, its logits and the logits gradient, each to a relative 2^-8
(bfloat16): the recorded δ then differs from the exact float64 value by about 2 % (the forward's rounded logits move π),
far above any float32 tolerance, and a tolerance that wide would hide a wrong gradient of 1 %. So the prediction
rounds where the head rounds (r: to the head's dtype; float32 accumulation inside the products, as the GEMMs do):

    z = r(r(h) r(W)^T + r(b)) / T        (the forward's logits, from the recorded h)
    π = softmax(z)                        (float64)
    g = r(r32(w (e_o - π) / T            (the logits gradient, float32 in the loss, rounded into the head's dtype;
              - e π (z - E[z]) / T))      with an entropy bonus's part, e = dL/dH: `head_entropy.py`)
    δ = r(W)^T g                          (accumulated in float64)

and what remains is the rounding of δ itself (unfused: to the head's dtype, at most 2^-8 of each entry) and, rarely,
a product that rounds to the neighbouring 16-bit value: `tolerance` = eps of the head's dtype (2^-7 for bfloat16) on
the relative error, so that a gradient wrong by 1 % is still reported. Two float64 passes over the head, on the
checked tokens only, and only for a 16-bit head.
"""

from __future__ import annotations

import math

import torch

from tokendyn.probe.head import HeadShard, vocab_chunk_rows

LOW_PRECISION = (torch.bfloat16, torch.float16)


def head_compute_dtype(
    weight_dtype: torch.dtype, hidden_dtype: torch.dtype, autocast: tuple[bool, torch.dtype]
):
    """The dtype the LM head's product ran in: the autocast dtype where autocast was on at its forward, else the
    promotion of its weight's and its input's dtypes."""
    enabled, dtype = autocast
    return dtype if enabled else torch.promote_types(weight_dtype, hidden_dtype)


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).to(torch.float64)


def rounded_head_gradient(
    h: torch.Tensor,
    shard: HeadShard,
    targets: torch.Tensor,
    w: torch.Tensor,
    temperature: float,
    dtype: torch.dtype,
    rows: int | None = None,
    e: torch.Tensor | None = None,
) -> torch.Tensor:
    """[K, H] float64: δ_k for l = w_k log π_k (+ e_k H_k) as a head computing in ``dtype`` produces it (module
    docstring), for the K rows of h [K, H] with targets [K], loss weights w [K] and entropy weights e [K] (None: no
    entropy bonus); the whole head (``shard.group`` None), a chunk of `vocab_chunk_rows` rows of W at a time."""
    hr = _round(h.detach(), dtype)
    k, dev = hr.shape[0], hr.device
    rows = rows or vocab_chunk_rows(k, shard.hidden)
    tgt = targets.to(dev).long()
    w64 = w.to(dev, torch.float64).unsqueeze(-1)

    def logits():
        for start, wc, b in shard.chunks(rows):
            wr = _round(wc, dtype)
            z = hr @ wr.T
            if b is not None:
                z = z + _round(b, dtype)
            cols = torch.arange(start + shard.offset, start + shard.offset + wc.shape[0], device=dev)
            yield wr, _round(z, dtype) / temperature, tgt.unsqueeze(1) == cols.unsqueeze(0)

    m = torch.full((k,), -math.inf, dtype=torch.float64, device=dev)
    s, sz = (torch.zeros(k, dtype=torch.float64, device=dev) for _ in range(2))
    for _, z, _ in logits():
        new = torch.maximum(m, z.amax(-1))
        scale, ez = torch.exp(m - new), torch.exp(z - new.unsqueeze(-1))
        s, sz = s * scale + ez.sum(-1), sz * scale + (ez * z).sum(-1)
        m = new
    lse, mean_z = (m + torch.log(s)).unsqueeze(-1), (sz / s).unsqueeze(-1)
    delta = torch.zeros(k, shard.hidden, dtype=torch.float64, device=dev)
    for wr, z, is_o in logits():
        pi = torch.exp(z - lse)
        g = w64 * (is_o.to(torch.float64) - pi)
        if e is not None:
            g = g - e.to(dev, torch.float64).unsqueeze(-1) * pi * (z - mean_z)
        delta += _round((g / temperature).to(torch.float32), dtype) @ wr
    return delta


def tolerance(dtype: torch.dtype) -> float:
    """The relative error allowed between the recorded and the rounded prediction of δ: eps of ``dtype``."""
    return float(torch.finfo(dtype).eps)
