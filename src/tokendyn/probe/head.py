"""The LM head on a bounded token sample, streamed over vocabulary chunks: no float64 (or any) copy of the head.

Notation (`bound.py`): z = (h W^T + b) / T, pi = softmax(z), o = the sampled token, W = LM-head weight (V x H).
For K sampled tokens the exact checks need u = d log pi_o / dh = W^T (e_o - pi) / T, the logits-level ratio
||e_o - pi|| / (1 - pi_o), and 1 - pi_o. All of them follow from one pass over the rows of W, a chunk of rows
cast to float64 at a time (memory: `vocab_chunk_rows`), with an online logsumexp over the tokens k != o:

    r_k = pi_k / (1 - pi_o) = softmax_{k != o}(z)_k        (does not depend on z_o)
    1 - pi_o = sigmoid(lse_{k != o}(z) - z_o)
    ||e_o - pi|| / (1 - pi_o) = sqrt(1 + sum_{k != o} r_k^2)
    u = (1 - pi_o) (W_o - sum_{k != o} r_k W_k) / T       (= W^T (e_o - pi) / T without cancellation at pi_o -> 1)

A soft-capped head (Gemma 2: z = c tanh((h W^T + b) / c) / T) changes only dz/dh: row k of W is weighted by the
slope s_k = 1 - tanh^2, so u = (1 - pi_o) (s_o W_o - sum_{k != o} r_k s_k W_k) / T; since s_k <= 1, the bound
||u|| <= sigma_max(W) ||e_o - pi|| / T and the lower bound of sigma_max below still hold.

A vocabulary-sharded head (FSDP2: rows split over ranks) gives each rank's partial sums over its own rows for the
tokens of every rank; `parallel.combine_head_partials` merges them (max, then sums), so no rank holds the whole head.

sigma_max(W) = sqrt(lambda_max(W^T W)) comes from the H x H Gram matrix W^T W, accumulated in float64 over the
same chunks (one pass over the head; a sharded head sums the ranks' Grams) and handed to a symmetric eigensolver
(`sigma_max_gram`); `sigma_max_power` is the matrix-free alternative (power iteration, one pass per iteration).

Cost per probed micro-batch (K check tokens): `head_partial` streams the head once with two K x H x V float64
products (z and sum_k exp(z_k) W_k), `logits_identity_error` once more with one (z again); a sigma_max refresh
streams it once with one V x H x H product. Every chunk's [K, rows] work is done in place on the product z.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

HEAD_CHUNK_BYTES = 64 * 2**20  # float64 working set of one vocabulary chunk (`vocab_chunk_rows`)
SIGMA_TOL = 1e-7  # power iteration stops when an iteration raises sigma_max^2 by less than this (relative)
SIGMA_MAX_ITER = 1000


def vocab_chunk_rows(k: int, hidden: int, budget: int = HEAD_CHUNK_BYTES) -> int:
    """Rows of W per chunk: the float64 chunk [rows, H] plus six float64 [K, rows] buffers take
    8 rows (H + 6K) <= budget bytes (at least one row); the passes keep at most three such buffers live (the
    product z, worked on in place; in the identity also the measured gradient's columns, float32 then float64)."""
    return max(1, budget // (8 * (hidden + 6 * max(k, 1))))


@dataclass
class HeadShard:
    """The rows of the LM head held here: rows `offset` .. `offset + weight.shape[0] - 1` of a V-row head.
    `group`: the process group whose ranks hold the other rows (None: the whole head is here)."""

    weight: torch.Tensor  # [V_local, H], any dtype, never copied whole
    bias: torch.Tensor | None  # [V_local]
    offset: int
    vocab: int
    group: object | None = None
    softcap: float | None = None  # Gemma-2 style logits c tanh(logits / c) (`final_logit_softcapping`)

    @property
    def hidden(self) -> int:
        return int(self.weight.shape[1])

    def chunks(self, rows: int):
        """(start, float64 weight rows, float64 bias rows or None) over the local rows, `rows` at a time."""
        w = self.weight.detach()
        for start in range(0, w.shape[0], rows):
            stop = min(start + rows, w.shape[0])
            b = None if self.bias is None else self.bias.detach()[start:stop].to(torch.float64)
            yield start, w[start:stop].to(torch.float64), b

    def capped(self, h64: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, temperature: float):
        """(z [K, n], slope [K, n] or None) of one float64 chunk: z = (h W^T + b) / T, or with a soft cap c,
        z = c tanh((h W^T + b) / c) / T and slope = dz / d((h W^T + b) / T) = 1 - tanh^2 (None without a cap)."""
        if self.softcap is None:
            z = (h64 / temperature) @ w.T
            if b is not None:
                z += b / temperature
            return z, None
        t = h64 @ w.T
        if b is not None:
            t += b
        t = torch.tanh_(t.div_(self.softcap))
        slope = 1.0 - t * t
        return t.mul_(self.softcap / temperature), slope

    def logit_chunks(self, h64: torch.Tensor, targets: torch.Tensor, temperature: float, rows: int | None):
        """(start, W rows [n, H], z [K, n], col [K, 1], own [K], slope [K, n] or None) over the local rows,
        float64, `rows` rows at a time (None: `vocab_chunk_rows`); z and slope as `capped`: `own` says that token
        k's target o_k is among the chunk's rows, `col` is its column there (clamped into the chunk where it is not:
        index with it, then mask by `own`; no host sync). z is the caller's to change in place."""
        local = targets.to(h64.device).long() - self.offset
        for start, w, b in self.chunks(rows or vocab_chunk_rows(h64.shape[0], self.hidden)):
            z, slope = self.capped(h64, w, b, temperature)
            col = local - start
            own = (col >= 0) & (col < w.shape[0])
            yield start, w, z, col.clamp(0, max(w.shape[0] - 1, 0)).unsqueeze(1), own, slope


def _row_sumsq(a: torch.Tensor) -> torch.Tensor:
    """sum_j a_kj^2 = ||a_k||^2 per row of a [K, n]: one fused reduction, no [K, n] temporary (the square of a
    float64 norm: a few units of float64 rounding)."""
    return torch.linalg.vector_norm(a, dim=-1).square()


def _row_sum(a: torch.Tensor) -> torch.Tensor:
    """sum_j a_kj per row of a [K, n], as a matrix-vector product (BLAS: several times a plain row sum's speed)."""
    return torch.mv(a, torch.ones(a.shape[1], dtype=a.dtype, device=a.device))


@dataclass
class HeadPartial:
    """Sums over some rows of W for K tokens (float64), relative to the running maximum m of z_k, k != o:
    s1 = sum exp(z_k - m), s2 = sum exp(2 (z_k - m)), acc = sum exp(z_k - m) s_k W_k; z_o and s_o W_o where o is
    among the rows (0 elsewhere); s_k = 1 without a soft cap."""

    m: torch.Tensor  # [K]
    s1: torch.Tensor  # [K]
    s2: torch.Tensor  # [K]
    acc: torch.Tensor  # [K, H]
    z_o: torch.Tensor  # [K]
    w_o: torch.Tensor  # [K, H]


def head_partial(
    h: torch.Tensor, shard: HeadShard, targets: torch.Tensor, temperature: float, rows: int | None = None
) -> HeadPartial:
    """The `HeadPartial` of the K rows of h [K, H] over the rows of `shard`, one float64 chunk of `rows` rows at a
    time (None: `vocab_chunk_rows`); online logsumexp: when the maximum grows from m to m', the sums are rescaled by
    exp(m - m'), squared for s2. Per chunk: z_o read at the target's column and set to -inf there (so that
    exp(z - m') is 0 at o), then z <- exp(z - m') in place, s1 += sum, s2 += sum of squares, acc += exp(z - m') W."""
    h64 = h.detach().to(torch.float64)
    k, dev = h64.shape[0], h64.device
    m = torch.full((k,), -math.inf, dtype=torch.float64, device=dev)
    s1, s2, z_o = (torch.zeros(k, dtype=torch.float64, device=dev) for _ in range(3))
    acc = torch.zeros(k, shard.hidden, dtype=torch.float64, device=dev)
    local = targets.to(dev).long() - shard.offset
    n_local = shard.weight.shape[0]
    own = ((local >= 0) & (local < n_local)).unsqueeze(-1)  # o is among these rows (no host sync: a mask)
    w_o = torch.zeros_like(acc)
    if n_local:
        w_o = shard.weight.detach()[local.clamp(0, n_local - 1)].to(dev, torch.float64) * own
    neg_inf = torch.tensor(-math.inf, dtype=torch.float64, device=dev)
    slope_o = torch.ones(k, dtype=torch.float64, device=dev)
    for _, w, z, col, is_here, slope in shard.logit_chunks(h64, targets, temperature, rows) if k else ():
        at = z.gather(1, col).squeeze(1)
        z_o = z_o + torch.where(is_here, at, torch.zeros_like(at))
        if slope is not None:  # a soft cap: dz_k/dh = slope_k W_k / T
            slope_o = torch.where(is_here, slope.gather(1, col).squeeze(1), slope_o)
        z.scatter_(1, col, torch.where(is_here, neg_inf, at).unsqueeze(1))
        new = torch.maximum(m, z.amax(-1))
        ref = torch.where(
            torch.isfinite(new), new, torch.zeros_like(new)
        )  # all -inf so far: nothing to scale
        scale = torch.exp(m - ref)
        e = z.sub_(ref.unsqueeze(-1)).exp_()
        s1 = s1 * scale + _row_sum(e)
        s2 = s2 * scale * scale + _row_sumsq(e)
        acc = acc.mul_(scale.unsqueeze(-1)).addmm_(e if slope is None else e * slope, w)
        m = new
    return HeadPartial(m, s1, s2, acc, z_o, w_o * slope_o.unsqueeze(-1))


def rescaled(p: HeadPartial, m: torch.Tensor) -> HeadPartial:
    """The same sums relative to a maximum m >= p.m (e.g. the maximum over all shards): s1 and acc times
    exp(p.m - m), s2 times its square; the sums of several shards' rescaled partials are the partial of their
    union."""
    ref = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    scale = torch.exp(p.m - ref)
    return HeadPartial(m, p.s1 * scale, p.s2 * scale * scale, p.acc * scale.unsqueeze(-1), p.z_o, p.w_o)


@dataclass
class HeadQuantities:
    """The exact-check quantities of K tokens (float64): u = W^T (e_o - pi) / T [K, H], the logits ratio
    ||e_o - pi|| / (1 - pi_o) [K], 1 - pi_o [K], log of the softmax normaliser lse(z) [K], and the per-token lower
    bound ||W^T (e_o - pi)|| / ||e_o - pi|| <= sigma_max(W) [K]."""

    direction: torch.Tensor
    logits_ratio: torch.Tensor
    one_minus_pi: torch.Tensor
    lse: torch.Tensor
    sigma_lower: torch.Tensor


def head_quantities(p: HeadPartial, temperature: float) -> HeadQuantities:
    """From the partial sums over every row of W (see the module docstring):
    lse_{k != o} = m + log s1, sum r_k^2 = s2 / s1^2, E_r[W] = acc / s1, u = (1 - pi_o) (W_o - E_r[W]) / T;
    the sigma lower bound ||W^T (e_o - pi)|| / ||e_o - pi|| = ||W_o - E_r[W]|| / ratio."""
    lse_others = p.m + torch.log(p.s1)
    ratio = torch.sqrt(1.0 + p.s2 / (p.s1 * p.s1))
    omp = torch.sigmoid(lse_others - p.z_o)
    diff = p.w_o - p.acc / p.s1.unsqueeze(-1)
    return HeadQuantities(
        direction=omp.unsqueeze(-1) * diff / temperature,
        logits_ratio=ratio,
        one_minus_pi=omp,
        lse=torch.logaddexp(lse_others, p.z_o),
        sigma_lower=torch.linalg.vector_norm(diff, dim=-1) / ratio,
    )


def logits_identity_error(
    grad_cols: Callable[[int, int], torch.Tensor],
    w: torch.Tensor,
    h: torch.Tensor,
    lse: torch.Tensor,
    shard: HeadShard,
    targets: torch.Tensor,
    temperature: float,
    rows: int | None = None,
) -> torch.Tensor:
    """Relative error of the logits gradient against its formula, per token, streamed over vocabulary chunks:
    ||T g - w (e_o - pi)|| / ||w (e_o - pi)||, g = dL/dz_logits of the K tokens (the measured gradient; columns
    a..b-1 as `grad_cols(a, b)` [K, b - a], so that no K x V copy is made), pi_v = exp(z_v - lse) with
    z = (h W^T + b) / T recomputed one chunk at a time (needs the whole head: `shard` with group None). Per chunk,
    in place on z: d = pi - e_o (pi_o - 1 = expm1(z_o - lse) at the target's column), then
    num += ||T g + w d||^2 and den += w^2 ||d||^2. NaN where w (e_o - pi) = 0."""
    h64 = h.detach().to(torch.float64)
    k, dev = h64.shape[0], h64.device
    w64 = w.to(dev, torch.float64)
    num = torch.zeros(k, dtype=torch.float64, device=dev)
    den = torch.zeros_like(num)
    for start, wc, z, col, is_here, _ in shard.logit_chunks(h64, targets, temperature, rows):
        at = z.gather(1, col).squeeze(1)
        d = z.sub_(lse.unsqueeze(-1)).exp_()
        d.scatter_(
            1, col, torch.where(is_here, torch.expm1(at - lse), d.gather(1, col).squeeze(1)).unsqueeze(1)
        )
        a = start + shard.offset
        r = grad_cols(a, a + wc.shape[0]).to(torch.float64, copy=True).mul_(temperature)
        num += _row_sumsq(r.addcmul_(d, w64.unsqueeze(-1)))
        den += w64 * w64 * _row_sumsq(d)
    err = torch.sqrt(num / den)
    return torch.where(den > 0, err, torch.full_like(err, math.nan))


def gram(
    shard: HeadShard, reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t, rows: int | None = None
) -> torch.Tensor:
    """G = W^T W [H, H] (float64): sum over the local rows, one float64 chunk of `rows` rows at a time (None: a
    chunk of HEAD_CHUNK_BYTES), of W_c^T W_c, then over the ranks by `reduce` (a sum). W's entries are exact in
    float64, so each entry of G carries only the summation's rounding: |dG_ij| <= V u sum_v |W_vi W_vj|."""
    h = shard.hidden
    out = torch.zeros(h, h, dtype=torch.float64, device=shard.weight.device)
    for _, w, _ in shard.chunks(rows or max(1, HEAD_CHUNK_BYTES // (8 * h))):
        out.addmm_(w.T, w)
    return reduce(out)


def sigma_max_gram(
    shard: HeadShard, reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t, rows: int | None = None
) -> tuple[float, torch.Tensor]:
    """(sigma, v): sigma_max(W) = sqrt(lambda_max(G)), G = W^T W (`gram`: one pass over the head, a collective
    under a sharded head), and v the unit eigenvector of lambda_max (W's top right singular vector), by a
    symmetric eigensolver on the H x H matrix. Exact to float64 rounding on either side: with the Gram's error
    dG and the solver's backward error, |lambda - lambda_max| <= ||dG|| + O(H u ||G||), a relative error of
    sigma below V H u / 2 (u = 2^-53; ||dG|| <= V u ||W||_F^2 <= V H u sigma_max^2) even in the worst case, under
    1e-7 for V = 152,064, H = 8,192; no iteration count, no dependence on the gap between the two largest
    singular values (what makes power iteration slow on a random head)."""
    evals, evecs = torch.linalg.eigh(gram(shard, reduce, rows))
    return math.sqrt(max(float(evals[-1]), 0.0)), evecs[:, -1]


def gram_matvec(
    shard: HeadShard, v: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor], rows: int | None = None
) -> torch.Tensor:
    """W^T W v (float64), summed over the local rows chunk by chunk, then over the ranks by `reduce` (a sum)."""
    out = torch.zeros_like(v)
    for _, w, _ in shard.chunks(rows or vocab_chunk_rows(1, shard.hidden)):
        out += w.T @ (w @ v)
    return reduce(out)


def sigma_max_power(
    shard: HeadShard,
    v0: torch.Tensor | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    tol: float = SIGMA_TOL,
    max_iter: int = SIGMA_MAX_ITER,
    rows: int | None = None,
) -> tuple[float, torch.Tensor, int]:
    """(sigma, v, iterations): power iteration on A = W^T W from v0 (None: a fixed pseudo-random start, the same
    on every rank), one pass over W per iteration and no H x H matrix (the probe uses `sigma_max_gram`). With x_i
    unit, lambda_i = ||A x_i|| and x_{i+1} = A x_i / lambda_i; for a symmetric positive semi-definite A, lambda_i never decreases and never exceeds lambda_max = sigma_max^2, so sigma = sqrt(lambda_i)
    is a lower bound of sigma_max(W). Stops when an iteration raises lambda by less than tol (relative), or after
    max_iter iterations; with a tiny gap between the two largest singular values the estimate can then still lie
    further below than tol. `v` (unit) warm-starts the next refresh."""
    h = shard.hidden
    dev = shard.weight.device
    if v0 is None:
        v0 = torch.randn(h, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = v0.to(dev, torch.float64)
    x = x / torch.linalg.vector_norm(x)
    lam, it = 0.0, 0
    for it in range(1, max_iter + 1):
        y = gram_matvec(shard, x, reduce, rows)
        new = float(torch.linalg.vector_norm(y))
        if new == 0.0:
            return 0.0, x, it
        x = y / new
        done = new - lam <= tol * new
        lam = max(lam, new)
        if done:
            break
    return math.sqrt(lam), x, it
