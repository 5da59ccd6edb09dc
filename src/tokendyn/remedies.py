"""Pure advantage and masking functions of the paper's two remedies, usable from any RL stack.

Notation (docs/definitions.md): ``old_logp[b, t] = log pi_old(o_t)``, the log-probability of the sampled token under the
policy that generated the batch, at the sampling temperature; ``completion_mask[b, t]`` is 1 on scored completion
tokens and 0 on padding. Every function is side-effect free and never builds an autograd graph through
``old_logp``.
"""

from __future__ import annotations

import math

import torch

from tokendyn.vocab import LOPTI_ORDERS


def _check_unit_interval(name: str, value: float, *, closed: bool) -> float:
    interval = "[0, 1]" if closed else "(0, 1)"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")
    inside = 0.0 <= value <= 1.0 if closed else 0.0 < value < 1.0
    if not inside:
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return float(value)


def _check_token_tensors(old_logp: torch.Tensor, completion_mask: torch.Tensor) -> None:
    if old_logp.dim() != 2:
        raise ValueError(f"old_logp must have shape (B, T), got {tuple(old_logp.shape)}")
    if completion_mask.shape != old_logp.shape:
        raise ValueError(
            f"completion_mask must have the shape of old_logp {tuple(old_logp.shape)}, got {tuple(completion_mask.shape)}"
        )


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised outcome advantages, as the official code computes them.

    ``rewards`` has shape (N,), laid out as N / group_size consecutive groups of completions of one prompt. For
    completion i of group g::

        A_i = (r_i - mean_g) / (std_g + eps)

    with ``std_g`` the unbiased (N-1) standard deviation. A group of size 1 uses mean 0 and std 1. Returns shape (N,).
    (TRL's own GRPOTrainer uses eps = 1e-4; the paper's code 1e-6.)
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (N,), got {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"group_size ({group_size}) must divide the number of rewards ({rewards.numel()})")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    grouped = rewards.detach().reshape(-1, group_size).to(torch.float64)
    if group_size == 1:
        mean = torch.zeros_like(grouped)
        std = torch.ones_like(grouped)
    else:
        mean = grouped.mean(dim=1, keepdim=True)
        std = grouped.std(dim=1, unbiased=True, keepdim=True)
    return ((grouped - mean) / (std + eps)).reshape(-1).to(rewards.dtype)


def reinforce_pp_advantages(
    rewards: torch.Tensor, completion_mask: torch.Tensor, eps: float = 1e-8
) -> torch.Tensor:
    """REINFORCE++ outcome advantages: batch-whitened returns, no group baseline (the paper's second baseline).

    With gamma = 1 and the outcome reward on the last token, every valid token t of completion b has the return
    ``R_bt = r_b``. The returns are whitened over all valid tokens of the batch (longer completions weigh more)::

        mu  = sum_bt m_bt R_bt / sum_bt m_bt
        var = sum_bt m_bt (R_bt - mu)^2 / sum_bt m_bt * n / (n - 1),   n = sum_bt m_bt
        A_bt = m_bt (R_bt - mu) / sqrt(var + eps)

    ``rewards`` (B,), ``completion_mask`` (B, T); returns (B, T), zero on padding. Needs at least 2 valid tokens.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (B,), got {tuple(rewards.shape)}")
    if completion_mask.dim() != 2 or completion_mask.size(0) != rewards.size(0):
        raise ValueError(
            f"completion_mask must have shape (B, T) with B = {rewards.size(0)}, got {tuple(completion_mask.shape)}"
        )
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    mask = completion_mask.detach().to(torch.float64)
    n = mask.sum()
    if n < 2:
        raise ValueError(
            f"completion_mask must contain at least 2 valid tokens to whiten, got {int(n.item())}"
        )
    returns = rewards.detach().to(torch.float64).unsqueeze(1).expand_as(mask)
    mean = (returns * mask).sum() / n
    var = ((returns - mean) ** 2 * mask).sum() / n * (n / (n - 1))
    adv = (returns - mean) * torch.rsqrt(var + eps) * mask
    dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    return adv.to(dtype)


def _per_token(adv: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """``adv`` (B,) or (B, T) as (B, 1) or (B, T) against ``old_logp`` (B, T); a ValueError naming the bad shape."""
    if old_logp.dim() != 2:
        raise ValueError(f"old_logp must have shape (B, T), got {tuple(old_logp.shape)}")
    if adv.dim() == 1:
        if adv.size(0) != old_logp.size(0):
            raise ValueError(f"adv of shape (B,) must have B = {old_logp.size(0)}, got {tuple(adv.shape)}")
        adv = adv.unsqueeze(1)
    elif adv.shape != old_logp.shape:
        raise ValueError(
            f"adv must have shape (B,) or the shape of old_logp {tuple(old_logp.shape)}, got {tuple(adv.shape)}"
        )
    return adv


def reweight_advantages(adv: torch.Tensor, old_logp: torch.Tensor, alpha: float) -> torch.Tensor:
    """Advantage Reweighting (paper Eq. 4, official ``both_linear_normal``)::

        A_t <- (alpha * pi_old(o_t) + 1 - alpha) * A_t,    pi_old = exp(old_logp), detached

    the same rule for both signs of A. ``adv`` is (B,) (one advantage per completion, broadcast over tokens) or
    (B, T); ``old_logp`` is (B, T). Returns (B, T). alpha = 0 returns the advantages unchanged (broadcast).
    """
    alpha = _check_unit_interval("alpha", alpha, closed=True)
    adv = _per_token(adv, old_logp)
    weight = alpha * torch.exp(old_logp.detach()) + (1.0 - alpha)
    return weight * adv


def logp_reweight_advantages(adv: torch.Tensor, old_logp: torch.Tensor, c: float) -> torch.Tensor:
    """The Delta-log-p direction reweight ("Beyond Magnitude", Huang et al., arXiv 2603.22117, ICLR 2026;
    Hesse73/RLVR-Directions ``reweight.method='reshape_reversed'``)::

        A_t <- (1 + c - c * pi_old(o_t)) * A_t,    pi_old = exp(old_logp), detached

    on every token, both signs: the mirror image of `reweight_advantages` (its weight alpha pi_old + 1 - alpha; the
    two sum to 2 at c = alpha), up-weighting low-pi tokens. ``adv`` (B,) or (B, T), ``old_logp`` (B, T); returns
    (B, T). c = 0 returns the advantages unchanged (broadcast). Published c: 0.2 (Qwen2.5-Math-7B), 0.1 (Qwen3-8B)."""
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
        raise ValueError(f"c must be a number >= 0, got {c!r}")
    adv = _per_token(adv, old_logp)
    weight = 1.0 + c - c * torch.exp(old_logp.detach())
    return weight * adv


def w_reinforce_advantages(rewards: torch.Tensor, lam: float = 0.1) -> torch.Tensor:
    """W-REINFORCE's advantages (Zhu et al., arXiv 2506.01347; TianHongZXY/RLVR-Decomposed
    ``compute_psr_nsr_outcome_advantage``, ``advantage=weighted``): the return of the 0/1 terminal reward, no
    baseline, no std, negatives weighted 1/lam more::

        A_i = lam  if r_i == 1;   -1  if r_i == 0;   r_i otherwise (the authors' quirk: any other score is kept)

    ``rewards`` (B,); returns (B,) float. A NaN reward (unscorable) gets 0, as TRL's advantages."""
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam) or lam < 0:
        raise ValueError(f"lam must be a number >= 0, got {lam!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (B,), got {tuple(rewards.shape)}")
    r = rewards.detach().to(torch.get_default_dtype() if not rewards.is_floating_point() else rewards.dtype)
    adv = torch.where(
        r == 1, torch.full_like(r, float(lam)), torch.where(r == 0, torch.full_like(r, -1.0), r)
    )
    return torch.nan_to_num(adv, nan=0.0)


def lopti_threshold(old_logp: torch.Tensor, completion_mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """Empirical ``quantile`` of pi_old = exp(old_logp) over the valid tokens only (linear interpolation, as
    ``torch.quantile``). Returns a 0-d tensor; NaN when there is no valid token."""
    quantile = _check_unit_interval("quantile", quantile, closed=False)
    _check_token_tensors(old_logp, completion_mask)
    probs = torch.exp(old_logp.detach())[completion_mask.bool()]
    if probs.numel() == 0:
        return torch.tensor(float("nan"), dtype=torch.float64, device=old_logp.device)
    ordered, _ = torch.sort(probs.to(torch.float64))
    pos = quantile * (ordered.numel() - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def lopti_masks(
    old_logp: torch.Tensor,
    completion_mask: torch.Tensor,
    eta: float | None = None,
    quantile: float | None = None,
    order: str = "low_first",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lopti (Low-Probability Token Isolation) stage masks, as the official code splits the tokens::

        low  = valid & (pi_old <  eta)        (strict, official code)
        high = valid & (pi_old >= eta)

    with pi_old = exp(old_logp). Exactly one of ``eta`` in (0, 1) (fixed threshold) and ``quantile`` in (0, 1)
    (threshold = that empirical quantile of pi_old over the valid tokens, see :func:`lopti_threshold`) is given.
    ``order="low_first"`` (the method) returns ``(low, high)``; ``"high_first"`` (the paper's ablation) returns
    ``(high, low)``. Masks are bool (B, T), disjoint, and their union is ``completion_mask``.
    """
    if (eta is None) == (quantile is None):
        raise ValueError(
            f"exactly one of eta and quantile must be given, got eta={eta!r}, quantile={quantile!r}"
        )
    if order not in LOPTI_ORDERS:
        raise ValueError(f"order must be one of {LOPTI_ORDERS}, got {order!r}")
    _check_token_tensors(old_logp, completion_mask)
    valid = completion_mask.bool()
    pi_old = torch.exp(old_logp.detach())  # in old_logp's dtype, as the official code compares
    if eta is not None:
        below = pi_old < _check_unit_interval("eta", eta, closed=False)
    else:
        below = pi_old.to(torch.float64) < lopti_threshold(old_logp, completion_mask, quantile)
    low, high = valid & below, valid & ~below
    return (low, high) if order == "low_first" else (high, low)


def random_halves_masks(completion_mask: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lopti's step-count control: the valid tokens split into two random halves, not by pi_old::

        order = a uniformly random permutation of the n valid tokens (row-major), drawn from ``seed``
        first  = the tokens order[0 .. ceil(n / 2) - 1],  second = the other floor(n / 2)

    Same shapes and contract as `lopti_masks` (bool (B, T), disjoint, union = ``completion_mask``), so a trainer
    runs it through Lopti's two stages: two optimizer steps per rollout batch as Lopti takes, without its split by
    probability. Deterministic in ``seed`` (a CPU generator; the masks land on ``completion_mask``'s device)."""
    if completion_mask.dim() != 2:
        raise ValueError(f"completion_mask must have shape (B, T), got {tuple(completion_mask.shape)}")
    valid = completion_mask.bool()
    where = valid.flatten().nonzero().squeeze(1).cpu()
    order = torch.randperm(where.numel(), generator=torch.Generator().manual_seed(int(seed)))
    first = torch.zeros(valid.numel(), dtype=torch.bool)
    first[where[order[: (where.numel() + 1) // 2]]] = True
    first = first.view_as(valid).to(valid.device)
    return first, valid & ~first


# ------------------------------------------------------------------------------------- covariance remedies
# "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models" (Cui et al., 2025), as verl 0.9.1
# defines them (`verl.trainer.ppo.core_algos`, policy loss modes "clip_cov" and "kl_cov"; defaults of
# `verl.workers.config.actor.PolicyLossConfig`). Both pick tokens by the centred covariance of advantage and
# log-probability over the micro-batch's valid tokens and act on those few alone.

CLIP_COV_DEFAULTS = {"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0}
KL_COV_DEFAULTS = {"kl_cov_ratio": 2e-4, "ppo_kl_coef": 0.1}


def token_covariance(advantages: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """cov_t = (A_t - mean_m A) (log pi_t - mean_m log pi), with mean_m x = sum_t m_t x_t / (sum_t m_t + 1e-8) (verl's
    ``masked_mean``) over the valid tokens; detached, (B, T), the per-token summand of Cov(A, log pi)."""
    m = mask.to(logp.dtype)
    adv, lp = advantages.detach().to(logp.dtype), logp.detach()
    mean_a = (adv * m).sum() / (m.sum() + 1e-8)
    mean_l = (lp * m).sum() / (m.sum() + 1e-8)
    return (adv - mean_a) * (lp - mean_l)


def clip_cov_keep(
    advantages: torch.Tensor,
    logp: torch.Tensor,
    ratio: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Clip-Cov's gradient mask (verl ``compute_policy_loss_clip_cov``): 0 on the detached tokens, 1 elsewhere, (B, T).

    Candidates: valid tokens with lb < cov_t < ub (`token_covariance`) that PPO's clip does not already cut, i.e. not
    -A_t clip(r_t, 1 - eps_low, 1 + eps_high) > -A_t r_t. Of those, n = max(floor(clip_cov_ratio * sum_t m_t), 1)
    are drawn uniformly without replacement (``torch.randperm`` over the candidates in row-major order, on
    ``generator``; None: torch's global generator, as verl), and their loss term is multiplied by 0. The training
    loss is then  max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)) * keep_t."""
    valid = mask.bool()
    adv, r = advantages.detach().to(ratio.dtype), ratio.detach()
    clipped = (-adv * torch.clamp(r, 1 - eps_low, 1 + eps_high) > -adv * r) & valid
    cov = token_covariance(advantages, logp, mask)
    candidates = torch.nonzero(valid & ~clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub))
    keep = torch.ones_like(ratio)
    if len(candidates):
        n = max(int(clip_cov_ratio * int(valid.sum())), 1)
        order = torch.randperm(len(candidates), generator=generator)
        chosen = candidates[order[: min(n, len(candidates))].to(candidates.device)]
        keep[chosen[:, 0], chosen[:, 1]] = 0
    return keep


def kl_cov_select(
    advantages: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, kl_cov_ratio: float = 2e-4
) -> torch.Tensor:
    """KL-Cov's token set (verl ``compute_policy_loss_kl_cov``): the k = max(1, floor(kl_cov_ratio * n)) valid tokens
    of largest covariance, cov_t = (A_t - mean A)(log pi_t - mean log pi) with plain means over the n valid tokens
    (``torch.topk`` over them in row-major order). Bool (B, T). The training loss is -A_t r_t + ppo_kl_coef
    |log r_t| on the selected tokens and -A_t r_t elsewhere (no clipping)."""
    valid = mask.bool()
    flat = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    selected = torch.zeros_like(valid)
    if flat.numel() == 0:
        return selected
    adv = advantages.detach().to(logp.dtype)[valid].reshape(-1).cpu()
    lp = logp.detach()[valid].reshape(-1).cpu()
    cov = (adv - adv.mean()) * (lp - lp.mean())
    k = max(1, int(cov.numel() * kl_cov_ratio))
    top = flat[torch.topk(cov, k, largest=True).indices.to(flat.device)]
    selected.view(-1)[top] = True
    return selected
