"""Every per-token rule of tokendyn's verl loss against an independent reference on the same tensors (r != 1, every
branch hit): verl's own registered function for the modes verl has (DPPO-TV / -KL, delegated), else the closed-form
per-token gradient dL/dlog pi written here from the formula (ASPO, CE-GPPO: the tables of
docs/remedies.md); the Delta-log-p reweight against verl's loss on advantages rewritten by hand (and its mirror
identity with Advantage Reweighting); W-REINFORCE through verl's own `compute_advantage` dispatch. For each rule the
analyses' objectives reproduce the trained loss: `VerlObjective` (verl's function, what the analyses inside verl
run) and the tokendyn `Objective` the config maps to (`tokendyn_objective`, what tokendyn's own analyses run)."""

from __future__ import annotations

import json

import pytest
import torch
from verl.trainer.ppo import core_algos
from verl.workers.config.actor import FSDPActorConfig, PolicyLossConfig

from tokendyn.integrations import verl as glue
from tokendyn.integrations.verl.objective import VerlObjective, tokendyn_objective
from tokendyn.probe.batch import ProbeBatch
from tokendyn.probe.tokenloss import loss_terms

glue.register()
torch.set_num_threads(1)


def _config(agg="token-mean", clip=(0.2, 0.28), clip_c=3.0, **policy_loss) -> FSDPActorConfig:
    loss = (
        glue.TokendynPolicyLossConfig(**policy_loss)
        if policy_loss.get("loss_mode", glue.LOSS_NAME) == glue.LOSS_NAME
        else PolicyLossConfig(**policy_loss)
    )
    return FSDPActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=loss, loss_agg_mode=agg,
        clip_ratio=clip[0], clip_ratio_low=clip[0], clip_ratio_high=clip[1], clip_ratio_c=clip_c,
    )  # fmt: skip


def _batch(seed: int = 0, b: int = 6, t: int = 9):
    """log r on a grid over [-2.2, 2.2] in every row (every clip edge, r > 3 and r < 1/3), advantages of both
    signs per token with some exactly 0, a padded mask, pi_old spread over (0, 1) (small where r is large) and pi
    up to 1 - 1e-6 (DPPO-KL's log(1 - pi))."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.linspace(
        -2.2, 2.2, t, dtype=torch.float64
    )  # each log r in every row, shifted, both signs of A
    log_r = grid[(torch.arange(t)[None, :] + 2 * torch.arange(b)[:, None]) % t]
    u = torch.rand(b, t, generator=g, dtype=torch.float64).clamp(1e-3, 1 - 1e-6)
    old = torch.log(u) - log_r.clamp(min=0)  # so that log pi = old + log r <= log(1 - 1e-6)
    logp = old + log_r
    sign = 1.0 - 2.0 * ((torch.arange(t)[None, :] + torch.arange(b)[:, None]) % 2)
    adv = sign * (0.1 + torch.rand(b, t, generator=g, dtype=torch.float64))
    adv[0, 3] = adv[2, 1] = 0.0
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 5:] = False
    mask[3, 2:] = False
    entropy = 3.0 * torch.rand(b, t, generator=g, dtype=torch.float64)
    return old, logp, adv, mask, entropy


def _ours(config, old, logp, adv, mask, entropy=None):
    """The loss verl's dispatch runs (`get_policy_loss_fn(loss_mode)`, as `ppo_loss`) and w = dL/dlog pi."""
    lp = logp.clone().requires_grad_()
    opts = config.policy_loss
    if entropy is not None:
        opts.token_entropy = entropy  # what `entropy_ppo_loss` hands over in training
    try:
        loss, _ = core_algos.get_policy_loss_fn(opts.loss_mode)(
            old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask,
            loss_agg_mode=config.loss_agg_mode, config=config, rollout_is_weights=None,
        )  # fmt: skip
    finally:
        if entropy is not None:
            opts.token_entropy = None
    (w,) = torch.autograd.grad(loss, lp)
    return loss.detach(), w


def _analyses(config, old, logp, adv, mask, entropy=None):
    """(loss, w) of the two analyses' objectives on a ProbeBatch of the same tensors: `VerlObjective` (its terms'
    gradient and value) and the mapped tokendyn `Objective` (`loss_terms`, the TRL path's formula)."""
    b, c = mask.shape
    batch = ProbeBatch(
        torch.zeros(b, c + 1, dtype=torch.long), torch.ones(b, c + 1, dtype=torch.long), mask, adv, old
    )
    out = []
    for objective in (VerlObjective(config), tokendyn_objective(config)):
        lp = logp.clone().requires_grad_()
        terms = loss_terms(lp, batch, objective, entropy)
        (w,) = torch.autograd.grad(terms.sum(), lp)
        out.append((terms.sum().detach(), w))
    return out


def _rel(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-300))


def _check(name, config, ref_loss, ref_w, old, logp, adv, mask, entropy=None, tol=1e-12):
    """Our loss and w, and both analyses' objectives, against the reference; prints the largest relative error."""
    loss, w = _ours(config, old, logp, adv, mask, entropy)
    errs = {"loss": _rel(loss, ref_loss), "w": _rel(w, ref_w)}
    analyses = _analyses(config, old, logp, adv, mask, entropy)
    for label, (a_loss, a_w) in zip(("verl_objective", "tokendyn_objective"), analyses, strict=True):
        errs[f"{label}_loss"] = _rel(a_loss, ref_loss)
        errs[f"{label}_w"] = _rel(a_w, ref_w)
    print(json.dumps({"rule": name, **errs}))
    assert max(errs.values()) <= tol, errs
    assert ref_w[mask].abs().max() > 0 and torch.count_nonzero(w[~mask]) == 0


@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl"])
def test_dppo_delegates_to_verls_function_with_clip_ratio_as_delta_and_clip_ratio_c_as_c(mode):
    """verl's registered dppo_tv / dppo_kl (clip_ratio_low / _high = delta, clip_ratio_c = C, not the 20 of its
    code's fallback) on the same tensors: bitwise; and the closed form -A min(r, C) M / N (M the trust-region mask
    written here) for w, the tokendyn Objective (dppo_*_delta = delta, dppo_is_cap = C) for both."""
    delta = 0.15 if mode == "dppo_tv" else 0.05
    old, logp, adv, mask, _ = _batch(seed=1)
    ref_cfg = _config(clip=(delta, delta), loss_mode=mode)
    ours_cfg = _config(clip=(delta, delta), base_loss_mode=mode)
    ref_loss, ref_w = _ours(ref_cfg, old, logp, adv, mask)
    loss, w = _ours(ours_cfg, old, logp, adv, mask)
    assert torch.equal(loss, ref_loss) and torch.equal(w, ref_w)
    # the closed form, from docs/remedies.md (the camp that protects low-probability tokens)
    r = torch.exp(torch.clamp(logp - old, -20, 20))
    pi, pi_old = torch.exp(logp), torch.exp(old)
    if mode == "dppo_tv":
        keep = torch.where(adv > 0, pi - pi_old <= delta, pi - pi_old >= -delta)
    else:
        d = pi_old * (old - logp) + (1 - pi_old) * torch.log((1 - pi_old + 1e-8) / (1 - pi + 1e-8))
        keep = torch.where(adv > 0, (d <= delta) | (pi <= pi_old), (d <= delta) | (pi >= pi_old))
    n = mask.sum()
    closed_w = torch.where(mask, -adv * r.clamp(max=3.0) * keep / n, 0.0)
    assert (
        (r[mask] > 3.0).any() and (~keep[mask]).any() and keep[mask].any()
    )  # the cap and the mask both bind
    torch.testing.assert_close(w, closed_w, rtol=1e-12, atol=1e-15)
    _check(mode, ours_cfg, ref_loss, ref_w, old, logp, adv, mask)


def _ce_gppo_reference(old, logp, adv, mask, eps_low, eps_high, beta1, beta2, c):
    """CE-GPPO written out (section 4): pg value and w = dL/dlog pi, token-mean."""
    r = torch.exp(logp - old)
    low = (adv < 0) & (r < 1 - eps_low)
    high = (adv > 0) & (r > 1 + eps_high)
    coef = torch.where(low, beta1 * (1 - eps_low), torch.where(high, beta2 * (1 + eps_high), r))
    value = torch.where(low | high, -coef * adv, -r * adv)
    dual = (adv < 0) & (r > c)  # min(pg, -c A) binds: value -c A, no gradient
    value = torch.where(dual, -c * adv, value)
    coef = torch.where(dual, 0.0, coef)
    n = mask.sum()
    assert low[mask].any() and high[mask].any() and dual[mask].any()
    return (value * mask).sum() / n, torch.where(mask, -coef * adv / n, 0.0)


def test_ce_gppo_equals_its_closed_form():
    """CE-GPPO (tokendyn's rule; verl has none): beta1 (1 - eps_low) on clipped A < 0 tokens, beta2 (1 + eps_high) on
    clipped A > 0 tokens, r elsewhere, 0 past the dual clip c for A < 0; eps from verl's clip_ratio_low / _high
    (asymmetric here, so a swap shows), c = ce_gppo_dual_clip (not clip_ratio_c)."""
    old, logp, adv, mask, _ = _batch(seed=2)
    cfg = _config(
        clip=(0.2, 0.28), clip_c=3.0, base_loss_mode="ce_gppo", ce_gppo_beta1=0.75, ce_gppo_dual_clip=4.0
    )
    ref_loss, ref_w = _ce_gppo_reference(old, logp, adv, mask, 0.2, 0.28, 0.75, 1.0, 4.0)
    _check("ce_gppo", cfg, ref_loss, ref_w, old, logp, adv, mask)


def _aspo_reference(old, logp, adv, mask, entropy, eps=0.2, eps_high=0.4, top=0.2, c=3.0):
    """ASPO written out (section 3): eps_t by each sequence's (1 - top)-quantile of H over its tokens; A > 0:
    value -A / min(r, 1 + eps_t), w = 1/r inside, 0 above, c (value -A c log pi) below 1/c; A <= 0: value
    -A max(r, 1 - eps_t), w = r above 1 - eps_t, 0 below, c (value -A c log pi) above c."""
    eps_t = torch.empty_like(logp)
    for b in range(mask.shape[0]):
        q = torch.quantile(entropy[b, mask[b]], 1 - top)
        eps_t[b] = torch.where(
            entropy[b] <= q,
            torch.tensor(eps, dtype=torch.float64),
            torch.tensor(eps_high, dtype=torch.float64),
        )
    r = torch.exp(torch.clamp(logp - old, -20, 20))
    pos, soft_pos, soft_neg = adv > 0, r < 1 / c, r > c
    value = torch.where(
        pos,
        torch.where(soft_pos, -adv * c * logp, -adv / torch.minimum(r, 1 + eps_t)),
        torch.where(soft_neg, -adv * c * logp, -adv * torch.maximum(r, 1 - eps_t)),
    )
    coef = torch.where(
        pos,
        torch.where(soft_pos, c, torch.where(r <= 1 + eps_t, 1 / r, 0.0)),
        torch.where(soft_neg, c, torch.where(r >= 1 - eps_t, r, 0.0)),
    )
    n = mask.sum()
    m = mask & (adv != 0)
    assert (m & pos & soft_pos).any() and (m & ~pos & soft_neg).any() and (m & pos & (r > 1 + eps_t)).any()
    assert (m & (eps_t > eps)).any() and (m & ~pos & (r < 1 - eps_t)).any()
    return (value * mask).sum() / n, torch.where(mask, -coef * adv / n, 0.0)


def test_aspo_equals_its_closed_form_with_the_entropies_handed_over():
    """ASPO (tokendyn's rule; verl has none): the flipped IS weight 1/r for A > 0, soft dual clip c = 3, eps 0.2 or
    0.4 on each sequence's top-20 % entropy tokens (H_t handed to the loss as `entropy_ppo_loss` does; the
    quantile computed here per sequence with torch.quantile)."""
    old, logp, adv, mask, entropy = _batch(seed=3)
    cfg = _config(base_loss_mode="aspo")
    ref_loss, ref_w = _aspo_reference(old, logp, adv, mask, entropy)
    _check("aspo", cfg, ref_loss, ref_w, old, logp, adv, mask, entropy)
    assert (
        VerlObjective(cfg).needs_entropy and cfg.policy_loss.token_entropy is None
    )  # put back after each call


def test_aspo_without_the_entropies_fails_in_one_line():
    old, logp, adv, mask, _ = _batch()
    with pytest.raises(glue.VerlConfigError, match=r"actor.calculate_entropy: .*'aspo'") as err:
        _ours(_config(base_loss_mode="aspo"), old, logp, adv, mask)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("base", ["vanilla", "dppo_tv", "ce_gppo"])
def test_logp_reweight_is_the_authors_formula_and_the_mirror_of_advantage_reweighting(base):
    """A <- (1 + c - c pi_old) A (Hesse73/RLVR-Directions 'reshape_reversed') under any base loss: our loss equals
    the base loss on advantages rewritten by hand; and as both weights are positive and sum to 2 at alpha = c, a
    loss positively homogeneous in each token's A gives w(c) + w(Reweight alpha = c) = 2 w(base)."""
    c = 0.2
    old, logp, adv, mask, _ = _batch(seed=4)
    by_hand = adv * (1 + c - c * torch.exp(old))
    plain = {"loss_mode": base} if base != "ce_gppo" else {"base_loss_mode": base}
    ref = _ours(_config(**plain), old, logp, by_hand, mask)
    ours = _ours(_config(base_loss_mode=base, logp_reweight_c=c), old, logp, adv, mask)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-12, atol=1e-15)
    tamed = _ours(_config(base_loss_mode=base, reweight_alpha=c), old, logp, adv, mask)
    base_w = _ours(_config(**plain), old, logp, adv, mask)[1]
    torch.testing.assert_close(ours[1] + tamed[1], 2 * base_w, rtol=1e-12, atol=1e-15)
    print(json.dumps({"rule": f"logp_reweight/{base}", "w": _rel(ours[1], ref[1])}))


def test_w_reinforce_through_verls_compute_advantage_then_ppo_clip():
    """verl's own advantage dispatch (`ray_trainer.compute_advantage`, which both trainers call) with
    adv_estimator=w_reinforce: lambda on every token of a response scored 1, -1 scored 0, the score otherwise; then
    tokendyn's loss (vanilla base) gives w = -A r 1[unclipped] / N, written out."""
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    lam = 0.25
    old, logp, _, mask, _ = _batch(seed=5)
    logp = old + 0.12 * (logp - old)  # r in [0.77, 1.3]: clipped both ways, the dual clip idle
    scores = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 1.0], dtype=torch.float64)
    last = mask.sum(-1) - 1
    rewards = torch.zeros_like(logp)
    rewards[torch.arange(6), last] = (
        scores  # verl's token_level_rewards: the score on the last response token
    )
    data = DataProto.from_dict({"token_level_rewards": rewards, "response_mask": mask.to(torch.float64)})
    config = OmegaConf.create({"adv_estimator": "w_reinforce", "w_reinforce_lambda": lam})
    adv = compute_advantage(data, adv_estimator="w_reinforce", config=config).batch["advantages"]
    want = torch.where(scores == 1, lam, torch.where(scores == 0, -1.0, scores))[:, None] * mask
    torch.testing.assert_close(adv, want, rtol=0, atol=0)
    cfg = _config(clip=(0.2, 0.2))
    loss, w = _ours(cfg, old, logp, adv, mask)
    r = torch.exp(logp - old)
    unclipped = torch.where(adv > 0, r <= 1.2, r >= 0.8)
    ref_w = torch.where(mask, -adv * r * unclipped / mask.sum(), 0.0)
    assert (~unclipped[mask]).any()
    print(json.dumps({"rule": "w_reinforce", "w": _rel(w, ref_w)}))
    torch.testing.assert_close(w, ref_w, rtol=1e-12, atol=1e-15)
    with pytest.raises(
        glue.VerlConfigError, match=r"algorithm.w_reinforce_lambda: must be a number >= 0, got -1"
    ):
        compute_advantage(
            data, adv_estimator="w_reinforce", config=OmegaConf.create({"w_reinforce_lambda": -1})
        )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"base_loss_mode": "lp_reg"},
            r"policy_loss.base_loss_mode: 'lp_reg' cannot run in verl's loss: Lp-Reg",
        ),
        ({"base_loss_mode": "nope"}, r"or one of tokendyn's rules \(aspo, ce_gppo\), got 'nope'"),
        ({"base_loss_mode": "aspo", "aspo_eps": 1.5}, r"policy_loss.aspo_eps: must be in \(0, 1\), got 1.5"),
        ({"ce_gppo_dual_clip": 1.0}, r"policy_loss.ce_gppo_dual_clip: must be > 1, got 1.0"),
        ({"ce_gppo_beta1": -0.1}, r"policy_loss.ce_gppo_beta1: must be >= 0, got -0.1"),
        (
            {"logp_reweight_c": -0.1},
            r"policy_loss.logp_reweight_c: must be a number >= 0 \(0: off\), got -0.1",
        ),
        (
            {"logp_reweight_c": 0.1, "reweight_alpha": 0.3},
            "policy_loss.logp_reweight_c: exclusive with reweight",
        ),
    ],
)
def test_bad_rule_options_fail_in_one_line_naming_the_field(options, message):
    with pytest.raises(glue.VerlConfigError, match=message) as err:
        glue.TokendynPolicyLossConfig(**options)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base_loss_mode": "vanilla"}, r"actor.policy_loss: verl's 'vanilla' has no tokendyn Objective"),
        ({"loss_mode": "gspo"}, r"actor.policy_loss: verl's 'gspo' has no tokendyn Objective"),
        (
            {"base_loss_mode": "dppo_tv", "clip": (0.1, 0.2)},
            r"actor.clip_ratio_low / clip_ratio_high: dppo_tv's",
        ),
        (
            {"base_loss_mode": "ce_gppo", "agg": "token-sum"},
            r"actor.loss_agg_mode: 'token-sum' has no tokendyn",
        ),
    ],
)
def test_what_the_tokendyn_objective_does_not_reproduce_fails_in_one_line(kwargs, message):
    with pytest.raises(glue.VerlConfigError, match=message) as err:
        tokendyn_objective(_config(**kwargs))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_the_rules_under_verls_sequence_aggregations(agg):
    """CE-GPPO under verl's sequence-level aggregations: w equals the token-mean closed form rescaled per sequence
    (n_i B for seq-mean-token-mean, B for seq-mean-token-sum), and both analyses' objectives reproduce it."""
    old, logp, adv, mask, _ = _batch(seed=6)
    cfg = _config(agg=agg, base_loss_mode="ce_gppo", ce_gppo_dual_clip=4.0)
    n, b, n_i = mask.sum(), mask.shape[0], mask.sum(-1, keepdim=True)
    _, w_mean = _ce_gppo_reference(old, logp, adv, mask, 0.2, 0.28, 0.5, 1.0, 4.0)
    per_token = w_mean * n  # -coef A, per token
    scale = n_i * b if agg == "seq-mean-token-mean" else torch.full_like(n_i, b)
    ref_w = per_token / scale
    loss, w = _ours(cfg, old, logp, adv, mask)
    for a_loss, a_w in _analyses(cfg, old, logp, adv, mask):
        torch.testing.assert_close(a_loss, loss, rtol=1e-7, atol=0)  # verl's +1e-8 in n_i
        torch.testing.assert_close(a_w, w, rtol=1e-7, atol=1e-15)
    torch.testing.assert_close(w, ref_w, rtol=1e-7, atol=1e-15)


@pytest.mark.parametrize("shape", ["token", "sequence"])
def test_the_analyses_objective_carries_verls_rollout_correction_weights(shape):
    """verl's rollout correction multiplies `rollout_is_weights` into the actor's loss (`ppo_loss` hands them to
    the registered function): `VerlObjective` on a ProbeBatch carrying them (`is_ratio`, as `probe_batch` reads
    them from the batch) has verl's own loss and w = dL/dlog pi with those weights, the tokendyn objective with
    TRL's importance-sampling correction (`is_correction`, checked against TRL's training step in test_one_loss)
    has the same, and without the weights both differ."""
    from tokendyn.probe.tokenloss import Objective

    config = _config(loss_mode="vanilla", clip_c=1e6)  # no dual clip: TRL's PPO term has none
    old, logp, adv, mask, _ = _batch(3)
    b, c = mask.shape
    g = torch.Generator().manual_seed(1)
    weights = torch.rand(b, c if shape == "token" else 1, generator=g, dtype=torch.float64) * 2
    weights[0] = 0.0  # a rejected sequence (rollout_rs / IcePop-style zeroing)
    lp = logp.clone().requires_grad_()
    ref, _ = core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask,
        loss_agg_mode=config.loss_agg_mode, config=config, rollout_is_weights=weights.expand(b, c),
    )  # fmt: skip
    (ref_w,) = torch.autograd.grad(ref, lp)
    ids = torch.zeros(b, c + 1, dtype=torch.long)
    batch = ProbeBatch(ids, torch.ones_like(ids), mask, adv, old, is_ratio=weights)
    unweighted = ProbeBatch(ids, torch.ones_like(ids), mask, adv, old)
    # verl's vanilla token-mean is TRL's bnpo PPO term with its two clip ratios
    trl_like = Objective(eps_low=0.2, eps_high=0.28, loss_type="bnpo", is_correction=True)
    for objective, on in (
        (VerlObjective(config), batch),
        (trl_like, batch),
        (VerlObjective(config), unweighted),
    ):
        p = logp.clone().requires_grad_()
        terms = loss_terms(p, on, objective)
        (w,) = torch.autograd.grad(terms.sum(), p)
        if on is batch:
            assert _rel(terms.sum().detach(), ref.detach()) < 1e-12 and _rel(w, ref_w) < 1e-12
            assert torch.count_nonzero(w[0]) == 0  # the zeroed sequence sends no gradient
        else:
            assert _rel(w, ref_w) > 1e-2
