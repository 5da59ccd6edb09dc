"""The rules that protect low-probability tokens (docs/remedies.md), each against an independent reference on the same
tensors: verl 0.9.1's registered ``dppo_tv`` / ``dppo_kl`` (loss and gradient), and for ASPO, CE-GPPO, Lp-Reg,
W-REINFORCE and the Delta-log-p reweight the closed-form per-token gradient dL/dlog pi written here from the
formula (``log_prob`` a leaf tensor), with the quirks docs/objectives.md lists. tokendyn's side is `loss_terms`
with the rule's `Objective`: what the trainer's loss (`TokendynGRPOTrainer._rule_loss`), the analyses and the
paired comparison use.
"""

from __future__ import annotations

import math

import pytest
import torch

from tokendyn.effects.compare import make_rule, rule_batch
from tokendyn.probe.forward import minp_proxy_logp
from tokendyn.probe.rules import SURROGATES
from tokendyn.probe.tokenloss import Objective, ProbeBatch, loss_terms
from tokendyn.remedies import logp_reweight_advantages, reweight_advantages, w_reinforce_advantages

torch.set_num_threads(1)
B, T = 8, 40


def tensors(seed: int, spread: float = 0.6, positive_frac: float = 0.5):
    """float64 log pi_old, a current log pi off by ``spread`` nats (ratios far from 1 on both sides), per-token
    advantages of both signs and some exact zeros, a mask with random lengths, entropies."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 3, T + 1, (B,), generator=g)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    sign = torch.where(torch.rand(B, 1, generator=g) < positive_frac, 1.0, -1.0)
    adv = (sign * (0.2 + torch.rand(B, 1, generator=g))).expand(B, T).clone().double()
    adv[0] = 0.0  # A = 0 contributes nothing
    old = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 5.0).clamp(max=-1e-4)
    logp = (old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-6)
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64) * 3.0
    return old, logp, adv, mask, entropy


def batch_of(old, adv, mask, **extra) -> ProbeBatch:
    return ProbeBatch(
        input_ids=torch.zeros(mask.size(0), mask.size(1) + 1, dtype=torch.long),
        attention_mask=torch.ones(mask.size(0), mask.size(1) + 1, dtype=torch.long),
        completion_mask=mask,
        advantages=adv,
        old_logp=old,
        **extra,
    )


def ours(objective, old, logp, adv, mask, entropy=None, **extra):
    """tokendyn's loss and dL/dlog pi on these tensors."""
    lp = logp.clone().requires_grad_(True)
    loss = loss_terms(lp, batch_of(old, adv, mask, **extra), objective, entropy).sum()
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad


def rel(got, want) -> float:
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-300)


# ------------------------------------------------------------------------------------------------------- DPPO
verl = pytest.importorskip("verl")
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: E402


def verl_dppo(mode, old, logp, adv, mask, delta, cap):
    config = FSDPActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=delta,
        clip_ratio_low=delta,
        clip_ratio_high=delta,
        clip_ratio_c=cap,
        policy_loss=PolicyLossConfig(loss_mode=mode),
    )
    lp = logp.clone().requires_grad_(True)
    loss, _ = core_algos.get_policy_loss_fn(mode)(
        old_log_prob=old,
        log_prob=lp,
        advantages=adv,
        response_mask=mask.double(),
        loss_agg_mode="token-mean",
        config=config,
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad


def worked_examples():
    """Worked examples, by hand from the masks' definitions: pi_old = 0.001 with A > 0 (TV keeps it up to
    pi = 0.151, KL up to ~0.054) and pi_old = 0.99 with A < 0 (TV masks below 0.84, KL below ~0.922), each just
    inside and just outside; a token with r > C; A = 0; pi -> 1 in the KL's log(1 - pi)."""
    pi_old = torch.tensor([[1e-3] * 6 + [0.99] * 6 + [0.5, 0.5, 0.999999, 1e-3]], dtype=torch.float64)
    pi = torch.tensor(
        [
            [
                0.14,
                0.16,
                0.05,
                0.06,
                0.002,
                0.0009,
                0.85,
                0.83,
                0.93,
                0.91,
                0.995,
                0.5,
                0.6,
                0.4,
                0.9999999,
                0.5,
            ]
        ],
        dtype=torch.float64,
    )
    adv = torch.tensor([[1.0] * 6 + [-1.0] * 6 + [0.0, 1.0, -1.0, 1.0]], dtype=torch.float64)
    return pi_old.log(), pi.log(), adv, torch.ones_like(adv, dtype=torch.bool)


@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("case", ["random, verl's C 3", "random, the authors' C 1e4", "worked examples, C 3"])
def test_dppo_equals_verls_registered_loss(mode, case):
    delta = 0.15 if mode == "dppo_tv" else 0.05
    cap = 1e4 if "1e4" in case else 3.0
    if case.startswith("worked"):
        old, logp, adv, mask = worked_examples()
    else:
        old, logp, adv, mask, _ = tensors(1, spread=1.5)
    field = "dppo_tv_delta" if mode == "dppo_tv" else "dppo_kl_delta"
    objective = Objective(loss_type="bnpo", policy_loss=mode, dppo_is_cap=cap, **{field: delta})
    want_loss, want_grad = verl_dppo(mode, old, logp, adv, mask, delta, cap)
    got_loss, got_grad = ours(objective, old, logp, adv, mask)
    e_loss, e_grad = rel(got_loss, want_loss), rel(got_grad, want_grad)
    print(f"{mode} {case}: loss rel err {e_loss:.1e}, grad rel err {e_grad:.1e}")
    assert e_loss < 1e-12 and e_grad < 1e-12
    # the test discriminates: the mask drops some tokens, r > C binds on some (C = 3), and A = 0 gives 0
    r = torch.exp(logp - old)
    dropped = (want_grad == 0) & (adv != 0) & mask
    assert int(dropped.sum()) > 0
    if cap == 3.0:
        assert bool(((r > cap) & ~dropped & (adv != 0)).any())


# ------------------------------------------------------------------------------------------------------- ASPO
def aspo_closed_form(old, logp, adv, mask, entropy, eps=0.2, eps_high=0.4, top=0.2, c=3.0):
    """dL/dlog pi = -w A / N: A > 0: w = c (r < 1/c), 1/r (1/c <= r <= 1 + eps_t), 0 above; A < 0: w = 0
    (r < 1 - eps_t), r (up to c), c above; eps_t = eps_high on the tokens above the row's (1 - top)-quantile of H."""
    eps_t = torch.full_like(old, eps)
    for i in range(old.size(0)):
        valid = entropy[i][mask[i]]
        q = torch.quantile(valid, 1.0 - top)
        eps_t[i] = torch.where(entropy[i] <= q, eps, eps_high)
    r = torch.exp(logp - old)
    w_pos = torch.where(r < 1 / c, c, torch.where(r <= 1 + eps_t, 1 / r, 0.0))
    w_neg = torch.where(r > c, c, torch.where(r >= 1 - eps_t, r, 0.0))
    w = torch.where(adv > 0, w_pos, w_neg)
    return torch.where(mask, -w * adv, torch.zeros_like(w)) / mask.sum()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_aspo_gradient_is_the_closed_form(seed):
    old, logp, adv, mask, entropy = tensors(seed, spread=1.2)
    objective = Objective(loss_type="bnpo", policy_loss="aspo")
    _, got = ours(objective, old, logp, adv, mask, entropy)
    want = aspo_closed_form(old, logp, adv, mask, entropy)
    err = rel(got, want)
    print(f"aspo seed {seed}: grad rel err {err:.1e}")
    assert err < 1e-12
    r = torch.exp(logp - old)
    # every branch is hit: flipped weight, clipped, soft dual clip, on both signs; and it is not PPO's gradient
    assert bool(((adv > 0) & (r < 1 / 3) & mask).any()) and bool(((adv < 0) & (r > 3) & mask).any())
    _, ppo = ours(Objective(eps_low=0.2, eps_high=0.2, loss_type="bnpo"), old, logp, adv, mask)
    assert rel(got, ppo) > 0.1


# ----------------------------------------------------------------------------------------------------- CE-GPPO
def ce_gppo_closed_form(old, logp, adv, mask, eps_low=0.2, eps_high=0.28, beta1=0.5, beta2=1.0, c=10.0):
    """dL/dlog pi = -w A / N: w = beta1 (1 - eps_low) (A < 0, r < 1 - eps_low), beta2 (1 + eps_high) (A > 0,
    r > 1 + eps_high), 0 (A < 0, r > c), else r."""
    r = torch.exp(logp - old)
    w = r.clone()
    w = torch.where((adv < 0) & (r < 1 - eps_low), beta1 * (1 - eps_low), w)
    w = torch.where((adv > 0) & (r > 1 + eps_high), beta2 * (1 + eps_high), w)
    w = torch.where((adv < 0) & (r > c), 0.0, w)
    return torch.where(mask, -w * adv, torch.zeros_like(w)) / mask.sum()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ce_gppo_gradient_is_the_closed_form(seed):
    old, logp, adv, mask, _ = tensors(seed, spread=1.3)
    objective = Objective(
        eps_low=0.2,
        eps_high=0.28,
        loss_type="bnpo",
        policy_loss="ce_gppo",
        ce_gppo_beta1=0.5,
        ce_gppo_dual_clip=3.0,
    )
    loss, got = ours(objective, old, logp, adv, mask)
    want = ce_gppo_closed_form(old, logp, adv, mask, c=3.0)
    err = rel(got, want)
    print(f"ce_gppo seed {seed}: grad rel err {err:.1e}")
    assert err < 1e-12
    r = torch.exp(logp - old)
    assert bool(((adv < 0) & (r > 3) & mask).any()) and bool(((adv > 0) & (r > 1.28) & mask).any())
    # the loss value: the bounded branches carry value -beta (1 -/+ eps) A, the dual clip -c A
    pg = torch.where(
        (adv < 0) & (r < 0.8), -0.5 * 0.8 * adv, torch.where((adv > 0) & (r > 1.28), -1.28 * adv, -r * adv)
    )
    pg = torch.where(adv < 0, torch.minimum(pg, -3.0 * adv), pg)
    assert rel(loss, (pg * mask).sum() / mask.sum()) < 1e-12


# ------------------------------------------------------------------------------------------------------ Lp-Reg
def lp_reg_set(logp, proxy, adv, mask, rho):
    """S written from the description: the valid A < 0 tokens sorted by current log pi, the k = max(1, int(rho n))
    lowest (none when k <= 1), those below the proxy."""
    neg = [
        (float(logp[i, j]), i, j)
        for i in range(adv.size(0))
        for j in range(adv.size(1))
        if mask[i, j] and adv[i, j] < 0
    ]
    k = max(1, int(len(neg) * rho))
    chosen = torch.zeros_like(mask)
    if k > 1:
        for value, i, j in sorted(neg)[:k]:
            if value < float(proxy[i, j]):
                chosen[i, j] = True
    return chosen


def lp_reg_closed_form(old, logp, adv, mask, proxy, rho, beta=1.0, eps_low=0.2, eps_high=0.28):
    """On S: dL/dlog pi = (-A r + beta (1 - pi_proxy / pi) 1[k3 <= 10]) / N; off S: PPO-clip, -A r 1[unclipped] / N."""
    r = torch.exp(logp - old)
    s = lp_reg_set(logp, proxy, adv, mask, rho)
    d = proxy - logp
    k3 = torch.exp(d) - d - 1
    on = -adv * r + beta * (1 - torch.exp(proxy - logp)) * (k3 <= 10)
    unclipped = torch.where(adv > 0, r <= 1 + eps_high, r >= 1 - eps_low)
    off = -adv * r * unclipped
    return torch.where(mask, torch.where(s, on, off), torch.zeros_like(r)) / mask.sum(), s, k3


def test_lp_reg_gradient_is_the_closed_form_with_its_quirks():
    old, logp, adv, mask, _ = tensors(4, spread=0.8, positive_frac=0.3)
    g = torch.Generator().manual_seed(9)
    proxy = (logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 2.0).clamp(max=-1e-6)
    lowest = torch.where(mask & (adv < 0), logp, torch.full_like(logp, 1.0)).argmin()
    proxy.view(-1)[lowest] = (
        logp.view(-1)[lowest] + 4.0
    )  # pi_proxy / pi = e^4 > 13.6: the k3 clamp binds there
    objective = Objective(eps_low=0.2, eps_high=0.28, loss_type="bnpo", policy_loss="lp_reg", lp_reg_rho=0.3)
    _, got = ours(objective, old, logp, adv, mask, proxy_logp=proxy)
    want, s, k3 = lp_reg_closed_form(old, logp, adv, mask, proxy, rho=0.3)
    err = rel(got, want)
    print(f"lp_reg: grad rel err {err:.1e}, |S| = {int(s.sum())}")
    assert err < 1e-12
    assert 1 < int(s.sum()) and bool((s & (k3 > 10)).any()) and bool((s & (k3 <= 10)).any())
    # the quirk k <= 1: rho so small that k = 1 regularises nothing, so the loss is PPO-clip's
    tiny = Objective(eps_low=0.2, eps_high=0.28, loss_type="bnpo", policy_loss="lp_reg", lp_reg_rho=1e-4)
    _, got_tiny = ours(tiny, old, logp, adv, mask, proxy_logp=proxy)
    _, ppo = ours(Objective(eps_low=0.2, eps_high=0.28, loss_type="bnpo"), old, logp, adv, mask)
    assert torch.equal(got_tiny, ppo)
    with pytest.raises(ValueError, match="proxy_logp"):
        ours(objective, old, logp, adv, mask)


def test_the_min_p_proxy_is_log_softmax_over_the_kept_tokens():
    g = torch.Generator().manual_seed(2)
    raw = torch.randn(30, 50, generator=g, dtype=torch.float64) * 3
    ids = torch.randint(0, 50, (30,), generator=g)
    for temperature, kappa in ((1.0, 0.02), (0.7, 0.1)):
        z = raw / temperature
        p_raw = torch.softmax(raw, -1)
        keep = p_raw >= kappa * p_raw.max(-1, keepdim=True).values  # the filter on the raw distribution
        p = torch.softmax(z, -1) * keep
        want = torch.log(p / p.sum(-1, keepdim=True)).gather(-1, ids[:, None]).squeeze(-1)
        got = minp_proxy_logp(z, ids, temperature, kappa)
        kept = keep.gather(-1, ids[:, None]).squeeze(-1)
        assert 0 < int(kept.sum()) < 30
        assert rel(got[kept], want[kept]) < 1e-12
        assert bool((got[~kept] < -1000).all())  # a filtered token: pi_proxy ~ 0


# ----------------------------------------------------------------------------- W-REINFORCE, Delta-log-p reweight
def test_w_reinforce_advantages_and_gradient():
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, float("nan"), -1.0, 0.0])
    adv = w_reinforce_advantages(rewards, 0.1)
    assert adv.tolist() == pytest.approx([0.1, -1.0, 0.5, 0.1, -1.0, 0.0, -1.0, -1.0])
    old, logp, _, mask, _ = tensors(5, spread=0.4)
    base = Objective(eps_low=0.2, eps_high=0.2, loss_type="bnpo")
    rule = make_rule("w_reinforce", base, lam=0.1)
    batch = rule_batch(rule, batch_of(old, torch.zeros(B), mask, rewards=rewards))
    _, got = ours(rule.objective, old, logp, batch.advantages, mask)
    a = torch.tensor([0.1, -1.0, 0.5, 0.1, -1.0, 0.0, -1.0, -1.0], dtype=torch.float64)[:, None]
    r = torch.exp(logp - old)
    unclipped = torch.where(a > 0, r <= 1.2, r >= 0.8)
    want = torch.where(mask, -a * r * unclipped, torch.zeros_like(r)) / mask.sum()
    err = rel(got, want)
    print(f"w_reinforce: grad rel err {err:.1e}")
    assert err < 1e-12
    with pytest.raises(ValueError, match="rewards"):
        rule_batch(rule, batch_of(old, torch.zeros(B), mask))


def test_logp_reweight_is_the_mirror_of_advantage_reweighting():
    old, logp, adv, mask, _ = tensors(6)
    pi_old = torch.exp(old)
    for c in (0.1, 0.2, 0.7):
        mine = logp_reweight_advantages(adv, old, c)
        assert rel(mine, (1 + c - c * pi_old) * adv) < 1e-15
        # w_rev + w_AR = 2 at alpha = c (on tokens with A != 0)
        ar = reweight_advantages(adv, old, c)
        nz = adv != 0
        assert rel((mine + ar)[nz] / adv[nz], torch.full_like(adv[nz], 2.0)) < 1e-14
    # as the comparison's rule, and its gradient: -(1 + c - c pi_old) A dPPO / N
    base = Objective(eps_low=0.2, eps_high=0.2, loss_type="bnpo")
    rule = make_rule("logp_reweight", base, c=0.2)
    batch = rule_batch(rule, batch_of(old, adv, mask))
    _, got = ours(rule.objective, old, logp, batch.advantages, mask)
    r = torch.exp(logp - old)
    a = (1.2 - 0.2 * pi_old) * adv
    want = (
        torch.where(mask, -a * r * torch.where(a > 0, r <= 1.2, r >= 0.8), torch.zeros_like(r)) / mask.sum()
    )
    assert rel(got, want) < 1e-12


# ------------------------------------------------------------------------------------------------- one table
def test_every_rule_is_registered_with_a_formula_and_defaults_that_validate():
    for name, rule in SURROGATES.items():
        assert rule.fn.__doc__ and ("pg_t" in rule.fn.__doc__ or "dL/dlog pi" in rule.fn.__doc__), name
        for p in rule.params:
            assert p.problem(p.default) is None, (name, p.name)
            assert p.problem(float("nan")) is not None
    with pytest.raises(ValueError, match=r"objective: dppo_tv_delta must be > 0, got -0.1"):
        Objective(policy_loss="dppo_tv", dppo_tv_delta=-0.1)
    with pytest.raises(ValueError, match=r"objective: policy_loss ce_gppo needs eps_low"):
        Objective(policy_loss="ce_gppo")
    assert math.isfinite(Objective(policy_loss="aspo").aspo_dual_clip)
