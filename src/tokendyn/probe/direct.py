"""The LM head recomputed on a few tokens, and the "direct" per-token gradient by one batched backward.

direct_l(t) = ||d log pi_t / d h_l[p(t)]||: token t's own term only (the "total" gradient of one ordinary backward
also carries later tokens' losses through attention). For l_t = w_t log pi_t, ||d l_t / d h_l|| = |w_t| direct_l(t).
log pi_t is recomputed from the real final hidden state (a new branch of the live graph, so it works also when the
model's own head is TRL's fused kernel, which cannot be vmapped), then K tokens are differentiated at once with
`torch.autograd.grad(..., is_grads_batched=True)`.
"""

from __future__ import annotations

import torch

from tokendyn.probe import bound as B


def head_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """z = (h W^T + b) / T per row, float64 (rows of h: tokens)."""
    z = h.detach().to(torch.float64) @ weight.detach().to(torch.float64).T
    if bias is not None:
        z = z + bias.detach().to(torch.float64)
    return z / temperature


@torch.no_grad()
def head_check_quantities(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    keep_pi: bool = False,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """For the exact checks, in row chunks (memory: chunk x V): u = d log pi_o / dh = W^T (e_o - pi) / T [K, H],
    the logits-level ratio ||e_o - pi|| / (1 - pi_o) [K], and pi [K, V] if asked (all float64)."""
    us, ratios, pis = [], [], []
    for start in range(0, h.shape[0], chunk):
        z = head_logits(h[start : start + chunk], weight, bias, temperature)
        o = targets[start : start + chunk]
        pi = torch.softmax(z, dim=-1)
        us.append(B.head_direction(weight, pi, o, temperature))
        ratios.append(B.logits_ratio_from_logits(z, o))
        if keep_pi:
            pis.append(pi)
    if not us:
        empty = torch.zeros(0, dtype=torch.float64, device=weight.device)
        return (
            empty.reshape(0, weight.shape[1]),
            empty,
            empty.reshape(0, weight.shape[0]) if keep_pi else None,
        )
    return torch.cat(us), torch.cat(ratios), torch.cat(pis) if keep_pi else None


def head_logprob(
    h_rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """log pi_t = log_softmax((h W^T + b) / T)[o_t], differentiable, float32 outside autocast."""
    with torch.autocast(device_type=h_rows.device.type, enabled=False):
        z = h_rows.float() @ weight.float().T
        if bias is not None:
            z = z + bias.float()
        return torch.log_softmax(z / temperature, dim=-1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def row_slots(rows: torch.Tensor) -> torch.Tensor:
    """slot[k] = the number of earlier tokens j < k in the same row: tokens sharing a slot sit in distinct rows."""
    same = rows.unsqueeze(0) == rows.unsqueeze(1)  # [k, j]
    earlier = torch.ones_like(same).tril(diagonal=-1)
    return (same & earlier).sum(1)


def _grads(
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


def direct_norms(
    hidden: list[torch.Tensor],
    h_final: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    chunk: int = 8,
) -> torch.Tensor:
    """[P, K] float32: ||d log pi_k / d hidden_j[rows_k, positions_k]|| for each probed tensor j and token k.

    `hidden` are the live graph tensors [b, S, H] of the probed points, `h_final` the live LM-head input. Rows of a
    causal LM never interact, so tokens in distinct rows share one backward: token k goes to slot `row_slots`[k],
    a slot's seed is the sum of its tokens' one-hots, and the cost is (max tokens per row) backward passes,
    batched `chunk` slots at a time (memory: chunk x the probed activations). Parameter .grad is never touched
    (only the hidden tensors are differentiation inputs); the graph is retained for the training backward.
    NaN where a point does not influence the token.
    """
    k_total = rows.shape[0]
    out = torch.full((len(hidden), k_total), float("nan"), dtype=torch.float32, device=h_final.device)
    if k_total == 0:
        return out
    slots = row_slots(rows)
    n_slots = int(slots.max()) + 1
    with torch.enable_grad():
        lp = head_logprob(h_final[rows, positions], weight, bias, targets, temperature)
    for start in range(0, n_slots, chunk):
        stop = min(start + chunk, n_slots)
        seeds = (slots.unsqueeze(0) == torch.arange(start, stop, device=rows.device).unsqueeze(1)).to(
            lp.dtype
        )
        grads = _grads(lp, hidden, seeds)
        sel = (slots >= start) & (slots < stop)
        k = torch.nonzero(sel).squeeze(1)
        for j, g in enumerate(grads):
            if g is not None:
                out[j, k] = torch.linalg.vector_norm(
                    g[slots[k] - start, rows[k], positions[k]], dim=-1, dtype=torch.float32
                )
        del grads
    return out
