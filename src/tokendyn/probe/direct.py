"""The "direct" per-token gradient by batched backwards from the LM-head input, under a memory cap.

direct_l(t) = ||d log pi_t / d h_l[p(t)]||: token t's own term only (the "total" gradient of one ordinary backward
also carries later tokens' losses through attention). For l_t = w_t log pi_t, ||d l_t / d h_l|| = |w_t| direct_l(t).
The backward starts at the real final hidden state h (a new branch of the live graph, so it works also when the
model's own head is TRL's fused kernel, which cannot be vmapped) from the cotangent u_k = d log pi_k / dh, computed
exactly by `head.py` at the forward (`head_seed`), so the LM head itself is never touched here; K tokens are
differentiated at once with `torch.autograd.grad(..., is_grads_batched=True)`, under a memory cap (`plan_direct`).
"""

from __future__ import annotations

import torch


class DirectMemoryError(RuntimeError):
    """One probed point's gradient for one backward slot is larger than the memory cap (`direct_memory_mb`)."""


def head_seed(h_rows: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """s_k = <h_rows[k], u_k> with u_k = d log pi_k / dh at the forward (`head.head_quantities`), float32 outside
    autocast: ds_k / dh = u_k, so its gradient through the network below h is log pi_k's (the same chain rule from
    the same cotangent), with no logits, no softmax and no weight of the LM head in the graph."""
    with torch.autocast(device_type=h_rows.device.type, enabled=False):
        return (h_rows.float() * direction.to(h_rows.device, torch.float32)).sum(-1)


def plan_direct(slot_bytes: list[int], chunk: int, cap: float | None) -> list[tuple[list[int], int]]:
    """How to run the batched backwards under a memory cap: [(point indices, slots per backward)].

    A batched backward over c slots returns, for each differentiated point j, a gradient of c x slot_bytes[j]
    bytes (b x S x H x itemsize per slot), all held at once. With no cap: all points, c = chunk. Otherwise points are
    packed, in order, into groups whose one-slot sum sum_j slot_bytes[j] <= cap (one backward per group), and each
    group gets c = min(chunk, floor(cap / that sum)) slots. Raises DirectMemoryError when one point's one slot
    exceeds the cap."""
    if cap is None:
        return [(list(range(len(slot_bytes))), chunk)]
    groups: list[list[int]] = []
    for j, size in enumerate(slot_bytes):
        if size > cap:
            raise DirectMemoryError(
                f"one backward slot of one point needs {size / 2**20:.1f} MiB, above the cap of {cap / 2**20:.1f} MiB"
            )
        if groups and sum(slot_bytes[i] for i in groups[-1]) + size <= cap:
            groups[-1].append(j)
        else:
            groups.append([j])
    return [(g, max(1, min(chunk, int(cap // sum(slot_bytes[i] for i in g))))) for g in groups]


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
    direction: torch.Tensor,
    chunk: int = 8,
    memory_bytes: float | None = None,
) -> torch.Tensor:
    """[P, K] float32: ||d log pi_k / d hidden_j[rows_k, positions_k]|| for each probed tensor j and token k.

    `hidden` are the live graph tensors [b, S, H] of the probed points, `h_final` the live LM-head input,
    `direction` [K, H] = d log pi_k / dh (`head_seed`). Rows of a causal LM never interact, so tokens in distinct
    rows share one backward: token k goes to slot `row_slots`[k], a slot's seed is the sum of its tokens' one-hots,
    and the cost is (max tokens per row) backward passes, batched `chunk` slots at a time. Memory: a batched
    backward over c slots holds c x sum_j numel(hidden_j) x itemsize bytes of gradients; `memory_bytes` caps that
    sum (`plan_direct`: fewer slots per backward, then subsets of the points; DirectMemoryError if one point's one
    slot is over the cap); the backward's own transient buffers come on top. Parameter .grad is never touched (only
    the hidden tensors are differentiation inputs); the graph is retained for the training backward. NaN where a
    point does not influence the token.
    """
    k_total = rows.shape[0]
    out = torch.full((len(hidden), k_total), float("nan"), dtype=torch.float32, device=h_final.device)
    plan = plan_direct([t.numel() * t.element_size() for t in hidden], chunk, memory_bytes)
    if k_total == 0:
        return out
    slots = row_slots(rows)
    n_slots = int(slots.max()) + 1
    with torch.enable_grad():
        lp = head_seed(h_final[rows, positions], direction)
    for points, c in plan:
        inputs = [hidden[j] for j in points]
        for start in range(0, n_slots, c):
            stop = min(start + c, n_slots)
            seeds = (slots.unsqueeze(0) == torch.arange(start, stop, device=rows.device).unsqueeze(1)).to(
                lp.dtype
            )
            grads = _grads(lp, inputs, seeds)
            k = torch.nonzero((slots >= start) & (slots < stop)).squeeze(1)
            for j, g in zip(points, grads, strict=True):
                if g is not None:
                    out[j, k] = torch.linalg.vector_norm(
                        g[slots[k] - start, rows[k], positions[k]], dim=-1, dtype=torch.float32
                    )
            del grads
    return out
