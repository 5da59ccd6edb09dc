"""What the paired comparison measures of each rule's whole distribution (`measure`, on when it sweeps,
`tokendyn.effects.axis`): for every completion token t, at the position p(t)
whose distribution predicts it,

    dH_t   = H(pi_theta_r(.|p(t))) - H(pi_theta_0(.|p(t)))                  (entropy change of the rule's update)
    KL_t   = KL(pi_theta_ref(.|p(t)) || pi_theta_r(.|p(t)))                  (to the reference rule's updated policy)
           = sum_v p_ref,v (log p_ref,v - log p_r,v)

from the temperature-scaled logits in float64, the LM head applied chunk by chunk. Cost per rule: the forward that
measures pi anyway, plus a float64 log-softmax over the vocabulary. Memory: the reference's log-softmax at every
completion position is kept in host memory, B * C * V * 8 bytes (8 sequences x 256 tokens x 32k vocabulary: 0.5 GB).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokendyn.probe.forward import _features, chunk_logits, chunk_tokens, eval_mode


@dataclass(frozen=True)
class Measured:
    """At one parameter state: pi_t (B, C) float64, H_t (B, C) float64, KL_t to the reference (B, C) float64 or
    None, and (when kept) the log-softmax at every completion position (B * C, V) float64 in host memory."""

    pi: torch.Tensor
    entropy: torch.Tensor
    kl: torch.Tensor | None
    log_softmax: torch.Tensor | None


@torch.no_grad()
def measure(
    model: nn.Module, batch, reference: torch.Tensor | None = None, *, keep: bool = False
) -> Measured:
    """pi, entropy, KL to ``reference`` (a `Measured.log_softmax`) at the current parameters, from one forward
    without grad in eval mode; pi is computed exactly as `tokendyn.effects.change.completion_probs` (exp of
    z_o - logsumexp(z) in float64), so it is the same number. ``keep``: return the log-softmax (host memory)."""
    with eval_mode(model):
        f = _features(model, batch, None)
        vocab = f.x.size(-1) if f.weight is None else f.weight.size(0)
        ids = batch.completion_ids.to(f.x.device).reshape(-1)
        n = chunk_tokens(vocab)
        logp, ent, kls, kept = [], [], [], []
        for lo in range(0, ids.numel(), n):
            z = chunk_logits(f.x[lo : lo + n], f.weight, f.bias, batch.temperature).to(torch.float64)
            lsm = z - torch.logsumexp(z, dim=-1, keepdim=True)
            logp.append(z.gather(-1, ids[lo : lo + n].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1))
            ent.append(-(lsm.exp() * lsm).sum(-1))
            if reference is not None:
                ref = reference[lo : lo + n].to(lsm.device)
                kls.append((ref.exp() * (ref - lsm)).sum(-1))
            if keep:
                kept.append(lsm.cpu())
    shape = batch.completion_ids.shape
    return Measured(
        torch.exp(torch.cat(logp)).reshape(shape),
        torch.cat(ent).reshape(shape),
        torch.cat(kls).reshape(shape) if reference is not None else None,
        torch.cat(kept) if keep else None,
    )
