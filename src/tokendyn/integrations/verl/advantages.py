"""W-REINFORCE (Zhu et al., arXiv 2506.01347) as a registered verl advantage estimator: it is a rule on each
response's reward, which verl's policy-loss call never sees (it gets token advantages), so it lives where verl
computes advantages from rewards (`core_algos.register_adv_est`; verl's `compute_advantage` dispatches to it in
both trainers). A run chooses it with::

    algorithm.adv_estimator=w_reinforce
    +algorithm.w_reinforce_lambda=0.1      # lambda >= 0 (the authors' 0.1 when unset)

    A_t = lambda  on every response token of a response with score 1,  -1 with score 0,  the score otherwise
          (score = sum_t token_level_rewards_t, the 0/1 terminal reward's return; `remedies.w_reinforce_advantages`)

with verl's PPO-clip loss on top (``loss_mode=vanilla``, or tokendyn's loss on a base mode) as the authors train.
"""

from __future__ import annotations

import math

import torch
from verl.trainer.ppo import core_algos

from tokendyn.integrations.verl.loss import VerlConfigError
from tokendyn.remedies import w_reinforce_advantages

ESTIMATOR_NAME = "w_reinforce"
DEFAULT_LAMBDA = 0.1


def w_reinforce_lambda(config) -> float:
    """lambda from verl's algorithm config (``w_reinforce_lambda``, default 0.1), checked in one line."""
    lam = DEFAULT_LAMBDA if config is None else config.get("w_reinforce_lambda", DEFAULT_LAMBDA)
    if isinstance(lam, bool) or not isinstance(lam, int | float) or not math.isfinite(lam) or lam < 0:
        raise VerlConfigError(f"algorithm.w_reinforce_lambda: must be a number >= 0, got {lam!r}")
    return float(lam)


def compute_w_reinforce_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config=None, **_: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's estimator signature: (advantages, returns), both A_t (module docstring) times the response mask."""
    lam = w_reinforce_lambda(config)
    scores = (token_level_rewards * response_mask).sum(-1)
    adv = w_reinforce_advantages(scores, lam).to(token_level_rewards.dtype)[:, None] * response_mask
    return adv, adv


def register_estimator() -> None:
    """Register `compute_w_reinforce_advantage` as verl's ``w_reinforce``; idempotent (verl raises if another
    function holds the name)."""
    if core_algos.ADV_ESTIMATOR_REGISTRY.get(ESTIMATOR_NAME) is not compute_w_reinforce_advantage:
        core_algos.register_adv_est(ESTIMATOR_NAME)(compute_w_reinforce_advantage)
