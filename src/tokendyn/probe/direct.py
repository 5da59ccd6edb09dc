"""The pieces of the "direct" per-token gradient that `replay.py` puts together.

direct_l(t) = ||d log pi_t / d h_l[p(t)]||: token t's own term only (the "total" gradient of one ordinary backward
also carries later tokens' losses through attention). For l_t = w_t log pi_t, ||d l_t / d h_l|| = |w_t| direct_l(t).
The backward starts at the final hidden state h from the cotangent u_k = d log pi_k / dh, computed exactly by
`head.py` at the forward (`head_seed`), so the LM head itself is never touched (it works also when the model's own
head is TRL's fused kernel); K tokens are differentiated at once with `torch.autograd.grad(..., is_grads_batched=True)`
(`batched_grads`), tokens of distinct rows sharing one seed slot (`row_slots`).
"""

from __future__ import annotations

import torch


class DirectMemoryError(RuntimeError):
    """Replaying one row of one layer for one token needs more than the memory cap (`direct_memory_mb`)."""


def head_seed(h_rows: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """s_k = <h_rows[k], u_k> with u_k = d log pi_k / dh at the forward (`head.head_quantities`), float32 outside
    autocast: ds_k / dh = u_k, so its gradient through the network below h is log pi_k's (the same chain rule from
    the same cotangent), with no logits, no softmax and no weight of the LM head in the graph."""
    with torch.autocast(device_type=h_rows.device.type, enabled=False):
        return (h_rows.float() * direction.to(h_rows.device, torch.float32)).sum(-1)


def row_slots(rows: torch.Tensor) -> torch.Tensor:
    """slot[k] = the number of earlier tokens j < k in the same row: tokens sharing a slot sit in distinct rows."""
    same = rows.unsqueeze(0) == rows.unsqueeze(1)  # [k, j]
    earlier = torch.ones_like(same).tril(diagonal=-1)
    return (same & earlier).sum(1)


def batched_grads(
    outputs: torch.Tensor, inputs: list[torch.Tensor], seeds: torch.Tensor
) -> list[torch.Tensor | None]:
    """d (seeds[s] . outputs) / d inputs[j] as [S, *inputs[j].shape] per j: one batched backward when possible,
    else one backward per seed (e.g. an op without a batching rule)."""
    try:
        return list(
            torch.autograd.grad(
                outputs,
                inputs,
                grad_outputs=seeds,
                retain_graph=True,
                allow_unused=True,
                is_grads_batched=True,
            )
        )
    except (RuntimeError, NotImplementedError):
        per = [
            torch.autograd.grad(outputs, inputs, grad_outputs=v, retain_graph=True, allow_unused=True)
            for v in seeds
        ]
        return [None if per[0][j] is None else torch.stack([g[j] for g in per]) for j in range(len(inputs))]
