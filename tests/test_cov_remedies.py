"""Clip-Cov and KL-Cov (Cui et al. 2025) against verl's own registered losses, on the same tensors.

The reference is verl 0.9.1's ``core_algos.get_policy_loss_fn("clip_cov" / "kl_cov")``, called as verl's actor
calls it (token-mean over the micro-batch); tokendyn's side is the analyses' and the trainer's per-token terms,
`tokendyn.probe.tokenloss.loss_terms` with ``policy_loss`` set. Clip-Cov draws its tokens at random: both sides
draw on torch's generator after the same ``torch.manual_seed``, and tokendyn's seeded generator draws the same.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import PolicyLossConfig  # noqa: E402

from tokendyn.integrations.verl.cpu import actor_config  # noqa: E402
from tokendyn.probe.tokenloss import Objective, ProbeBatch, loss_terms  # noqa: E402
from tokendyn.remedies import clip_cov_keep, kl_cov_select, token_covariance  # noqa: E402

B, T = 12, 48


def rollout(seed: int, spread: float = 0.4):
    """Per-sequence advantages broadcast over tokens (as verl's GRPO), pi_old, and a current log pi off by
    ``spread`` nats (so PPO's clip binds on some tokens), a random length per sequence."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 3, T + 1, (B,), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    adv = (torch.randn(B, 1, generator=g) * 1.5).expand(B, T).contiguous() * mask
    old = -torch.rand(B, T, generator=g) * 4.0
    logp = (old + spread * torch.randn(B, T, generator=g)).clamp(max=0.0)
    return old, logp, adv, mask


def probe_batch(old, adv, mask) -> ProbeBatch:
    """A ProbeBatch carrying these tensors (ids unused by `loss_terms`)."""
    return ProbeBatch(
        input_ids=torch.zeros(B, T + 1, dtype=torch.long),
        attention_mask=torch.ones(B, T + 1, dtype=torch.long),
        completion_mask=mask,
        advantages=adv,
        old_logp=old,
    )


def verl_loss(mode: str, old, logp, adv, mask, **policy):
    config = actor_config(
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        policy_loss=PolicyLossConfig(loss_mode=mode, **policy),
    )
    fn = core_algos.get_policy_loss_fn(mode)
    loss, _ = fn(
        old_log_prob=old,
        log_prob=logp,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode="token-mean",
        config=config,
    )
    return loss


def tokendyn_loss(mode: str, old, logp, adv, mask, seed=None, **policy):
    objective = Objective(
        eps_low=0.2, eps_high=0.28, loss_type="bnpo", policy_loss=mode, cov_seed=seed, **policy
    )
    return loss_terms(logp, probe_batch(old, adv, mask), objective).sum()


def both(mode, seed, policy, data_seed):
    old, logp, adv, mask = rollout(data_seed)
    lp_verl = logp.clone().requires_grad_(True)
    lp_ours = logp.clone().requires_grad_(True)
    torch.manual_seed(seed)
    want = verl_loss(mode, old, lp_verl, adv, mask, **policy)
    torch.manual_seed(
        seed + 12345
    )  # tokendyn draws on its own generator seeded with `seed`, not the global one
    got = tokendyn_loss(mode, old, lp_ours, adv, mask, seed=seed, **policy)
    (g_want,) = torch.autograd.grad(want, lp_verl)
    (g_got,) = torch.autograd.grad(got, lp_ours)
    return want, got, g_want, g_got


CASES = {
    "clip_cov, verl defaults": ("clip_cov", {}),
    "clip_cov, 5 % of tokens": ("clip_cov", dict(clip_cov_ratio=0.05, clip_cov_lb=0.2, clip_cov_ub=8.0)),
    "kl_cov, verl defaults": ("kl_cov", {}),
    "kl_cov, 5 % of tokens, coef 0.5": ("kl_cov", dict(kl_cov_ratio=0.05, ppo_kl_coef=0.5)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("data_seed", [0, 1, 2])
def test_loss_and_gradient_equal_verls_registered_loss(name, data_seed):
    mode, policy = CASES[name]
    want, got, g_want, g_got = both(mode, seed=7 + data_seed, policy=policy, data_seed=data_seed)
    assert torch.allclose(got.float(), want, rtol=1e-6, atol=1e-7), (float(got), float(want))
    assert torch.allclose(g_got, g_want, rtol=1e-5, atol=1e-8), float((g_got - g_want).abs().max())


def test_the_rule_changes_the_gradient_on_the_chosen_tokens_only():
    """The comparison discriminates: against verl's plain PPO loss the gradients differ exactly on the tokens each
    remedy picks (and Clip-Cov's draw depends on the seed)."""
    old, logp, adv, mask = rollout(3)
    policy = dict(clip_cov_ratio=0.05, clip_cov_lb=0.2, clip_cov_ub=8.0)
    lp = logp.clone().requires_grad_(True)
    ppo = Objective(eps_low=0.2, eps_high=0.28, loss_type="bnpo")  # PPO's clip alone, Clip-Cov's surrogate
    (g_ppo,) = torch.autograd.grad(loss_terms(lp, probe_batch(old, adv, mask), ppo).sum(), lp)
    ratio = torch.exp(logp - old)
    keeps = [
        clip_cov_keep(adv, logp, ratio, mask, 0.2, 0.28, generator=torch.Generator().manual_seed(s), **policy)
        for s in (0, 1)
    ]
    assert not torch.equal(keeps[0], keeps[1])
    lp = logp.clone().requires_grad_(True)
    (g_clip,) = torch.autograd.grad(tokendyn_loss("clip_cov", old, lp, adv, mask, seed=0, **policy), lp)
    changed = (g_clip - g_ppo).abs() > 1e-9
    assert torch.equal(changed, (keeps[0] == 0) & (g_ppo.abs() > 1e-9))
    assert int(changed.sum()) == max(int(0.05 * mask.sum()), 1)

    chosen = kl_cov_select(adv, logp, mask, 0.05)
    cov = token_covariance(adv, logp, mask)
    assert int(chosen.sum()) == int(0.05 * mask.sum())
    assert float(cov[chosen].min()) >= float(cov[mask.bool() & ~chosen].max())


def test_the_defaults_are_verls():
    from dataclasses import fields

    from tokendyn.remedies import CLIP_COV_DEFAULTS, KL_COV_DEFAULTS

    verl = {f.name: f.default for f in fields(PolicyLossConfig)}
    objective = Objective(eps_low=0.2, eps_high=0.2, policy_loss="clip_cov")
    for name, value in {**CLIP_COV_DEFAULTS, **KL_COV_DEFAULTS}.items():
        assert verl[name] == value == getattr(objective, name), name
