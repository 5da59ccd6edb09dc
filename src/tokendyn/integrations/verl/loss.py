"""tokendyn's verl loss (0.9.x): Advantage Reweighting and Lopti's stage masks as a registered verl policy loss on
top of any other registered loss mode, registered in every worker through verl's plugin entry point (the package
`tokendyn.integrations.verl` registers on import; `verl_plugin` imports it).

A verl run turns it on with overrides (the loss is named by `loss_mode`, its options live in a config class
of its own because verl's `PolicyLossConfig` rejects unknown keys)::

    actor_rollout_ref.actor.policy_loss._target_=tokendyn.integrations.verl.TokendynPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=tokendyn
    +actor_rollout_ref.actor.policy_loss.base_loss_mode=vanilla     # any registered mode: gspo, cispo, clip_cov, ...
    +actor_rollout_ref.actor.policy_loss.reweight_alpha=0.3         # Advantage Reweighting (0: off)

The loss (`tokendyn_policy_loss`, called by verl's `ppo_loss` as every registered loss is) rewrites the advantages
and hands everything else to the base mode's own function, unchanged:

    A_t <- (alpha pi_old(o_t) + 1 - alpha) A_t            (`remedies.reweight_advantages`; pi_old = exp(old_log_prob))
    A_t <- A_t [t in the active Lopti group]              (`lopti_stage` low / high; `remedies.lopti_masks`)

(or A_t <- (1 + c - c pi_old(o_t)) A_t, the Delta-log-p reweight, `logp_reweight_c`), with the response mask
untouched, so a token-mean loss still divides by every token of the batch, as the official fork's Lopti does. A
base mode of `TOKENDYN_RULES` (ASPO, CE-GPPO: rules verl has no mode for) runs tokendyn's registered rule
(`tokendyn.probe.rules`) through verl's `agg_loss` instead (`rule_policy_loss`). Which group is active is the trainer's to say between its two actor updates (`lopti_stage` is a
mutable field); "all" (the default) is the plain update.
"""

from __future__ import annotations

import torch
from verl.trainer.ppo import core_algos

from tokendyn.integrations.verl.loss_config import (  # noqa: F401  (re-exported: the loss's config and checks)
    LOPTI_STAGES,
    LOSS_NAME,
    TOKENDYN_RULES,
    UNAVAILABLE_RULES,
    VERL_SERIES,
    TokendynPolicyLossConfig,
    VerlConfigError,
    check_base_mode,
    check_stage,
    needs_entropy,
    rule_params,
    with_rule_fields,
)
from tokendyn.probe.rules import SURROGATES, TokenInputs
from tokendyn.remedies import logp_reweight_advantages, lopti_masks, reweight_advantages


def stage_mask(old_log_prob: torch.Tensor, response_mask: torch.Tensor, eta: float | None, stage: str):
    """The tokens whose advantages the update of `stage` keeps: low = pi_old < eta, high = pi_old >= eta (both
    within the response mask, `remedies.lopti_masks`), all = the response mask."""
    check_stage(stage, eta)
    if stage == "all":
        return response_mask.bool()
    low, high = lopti_masks(old_log_prob, response_mask, eta=eta)
    return low if stage == "low" else high


def stage_advantages(
    advantages: torch.Tensor,
    old_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    alpha: float,
    eta: float | None,
    stage: str,
    logp_c: float = 0.0,
) -> torch.Tensor:
    """The advantages the update of `stage` optimises: Reweighted by alpha (the paper's Eq. 4 on pi_old,
    `remedies.reweight_advantages`) or by the Delta-log-p reweight's c (1 + c - c pi_old,
    `remedies.logp_reweight_advantages`), then zeroed outside `stage_mask` ("all": unchanged)."""
    keep = stage_mask(old_log_prob, response_mask, eta, stage)
    adv = reweight_advantages(advantages, old_log_prob, alpha) if alpha else advantages
    adv = logp_reweight_advantages(adv, old_log_prob, logp_c) if logp_c else adv
    return adv if stage == "all" else adv * keep.to(adv.dtype)


def rule_objective(config):
    """The tokendyn `Objective` whose rule the tokendyn loss trains for a base mode of `TOKENDYN_RULES`: the rule
    (``policy_loss``), its parameters from the loss config, PPO's clip range from verl's actor config
    (clip_ratio_low / clip_ratio_high, each falling back to clip_ratio, as verl's vanilla); token-mean ("bnpo")
    stands for the aggregation, which verl's `agg_loss` does."""
    from tokendyn.probe.objective import Objective

    opts = config.policy_loss
    eps = float(config.clip_ratio)
    low = float(config.clip_ratio_low) if config.clip_ratio_low is not None else eps
    high = float(config.clip_ratio_high) if config.clip_ratio_high is not None else eps
    params = {p.name: float(getattr(opts, p.name)) for p in SURROGATES[opts.base_loss_mode].params}
    try:
        return Objective(
            eps_low=low, eps_high=high, loss_type="bnpo", policy_loss=opts.base_loss_mode, **params
        )
    except ValueError as exc:
        raise VerlConfigError(f"actor.{str(exc).removeprefix('objective: ')}") from None


def rule_policy_loss(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
):
    """A rule of `TOKENDYN_RULES` in verl's policy-loss form: pg_t from the registered rule
    (`tokendyn.probe.rules.SURROGATES`, on r_t = exp(log pi_t - log pi_old,t), the entropies from
    `entropy_ppo_loss` for ASPO), times verl's rollout IS weights when given, aggregated by verl's `agg_loss`
    (``loss_agg_mode``, the global batch info): the same pg_t as tokendyn's TRL path and analyses."""
    opts = config.policy_loss
    rule = SURROGATES[opts.base_loss_mode]
    mask = response_mask.bool()
    entropy = None
    if rule.needs_entropy:
        entropy = opts.token_entropy
        if entropy is None:
            raise VerlConfigError(
                f"actor.calculate_entropy: base_loss_mode {opts.base_loss_mode!r} reads each token's entropy: set "
                "actor_rollout_ref.actor.calculate_entropy=True (the tokendyn worker hands it to the loss)"
            )
        entropy = entropy.detach().to(log_prob.dtype)
    log_ratio = torch.where(mask, log_prob - old_log_prob, torch.zeros_like(log_prob))
    inputs = TokenInputs(
        logp=log_prob, old=old_log_prob.detach(), log_ratio=log_ratio, ratio=torch.exp(log_ratio),
        adv=advantages, mask=mask, entropy=entropy,
    )  # fmt: skip
    pg = rule(rule_objective(config), inputs)
    if rollout_is_weights is not None:
        pg = pg * rollout_is_weights
    loss = core_algos.agg_loss(
        loss_mat=pg, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info
    )
    m = mask.to(log_prob.dtype)
    ppo_kl = (-(log_ratio.detach()) * m).sum() / m.sum().clamp(min=1.0)
    return loss, {"actor/ppo_kl": float(ppo_kl)}


def tokendyn_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
):
    """verl's policy-loss signature: the base mode's loss on `stage_advantages` (verl's registered function, or
    `rule_policy_loss` for tokendyn's rules), its metrics plus the share of tokens whose advantages this stage kept
    (`actor/tokendyn/stage_token_share`)."""
    opts = config.policy_loss
    adv = stage_advantages(
        advantages, old_log_prob, response_mask, opts.reweight_alpha, opts.eta, opts.lopti_stage,
        opts.logp_reweight_c,
    )  # fmt: skip
    kept = stage_mask(old_log_prob, response_mask, opts.eta, opts.lopti_stage)
    if opts.base_loss_mode in TOKENDYN_RULES:
        base = rule_policy_loss
    else:
        base = core_algos.get_policy_loss_fn(opts.base_loss_mode)
    loss, metrics = base(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=adv,
        response_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        config=config,
        rollout_is_weights=rollout_is_weights,
    )
    metrics = dict(metrics)
    metrics["actor/tokendyn/stage_token_share"] = int(kept.sum()) / max(int(response_mask.bool().sum()), 1)
    return loss, metrics


def lopti_ppo_loss(config, model_output, data, dp_group=None):
    """verl's `ppo_loss` with the KL and entropy terms of a Lopti stage restricted to its group, as the official
    fork restricts them (S: the tokens `stage_mask` keeps, m: the response mask, agg: verl's `agg_loss`, linear in
    its loss matrix for every aggregation mode, its denominator over every token of m)::

        L_S = ppo_loss(A 1_S) - beta agg(kl (1 - 1_S), m) + c_H agg(H (1 - 1_S), m)
            = pg(A 1_S) + beta agg(kl 1_S, m) - c_H agg(H 1_S, m)

    (beta = kl_loss_coef with use_kl_loss, kl = verl's `kl_penalty` of kl_loss_type; c_H = entropy_coeff). Outside
    a Lopti stage (lopti_stage "all") it is `ppo_loss` itself. The actor worker uses it for Lopti's updates
    (`worker`); with `engine.train_batch` pass ``partial(lopti_ppo_loss, config=actor_config)``."""
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    loss, metrics = ppo_loss(config, model_output, data, dp_group)
    opts = config.policy_loss
    if getattr(opts, "lopti_stage", "all") == "all" or not (config.use_kl_loss or config.entropy_coeff):
        return loss, metrics
    fields = data.select("response_mask", "old_log_probs", *(["ref_log_prob"] if config.use_kl_loss else []))
    padded = fields.to_padded_tensor()
    mask = padded["response_mask"].bool()
    outside = (mask & ~stage_mask(padded["old_log_probs"], mask, opts.eta, opts.lopti_stage)).to(
        torch.float32
    )
    info = dict(config.global_batch_info)  # as ppo_loss has just set it from this batch
    if config.use_kl_loss:
        log_prob = no_padding_2_padding(model_output["log_probs"], data)
        kld = core_algos.kl_penalty(
            logprob=log_prob, ref_logprob=padded["ref_log_prob"], kl_penalty=config.kl_loss_type
        )
        kl_out = core_algos.agg_loss(
            loss_mat=kld * outside.to(kld.dtype), loss_mask=mask, loss_agg_mode=config.loss_agg_mode, **info
        )
        loss = loss - kl_out * config.kl_loss_coef
    entropy = model_output.get("entropy")
    if config.entropy_coeff and entropy is not None:
        ent = no_padding_2_padding(entropy, data)
        ent_out = core_algos.agg_loss(
            loss_mat=ent * outside.to(ent.dtype), loss_mask=mask, loss_agg_mode=config.loss_agg_mode, **info
        )
        loss = loss + config.entropy_coeff * ent_out
    return loss, metrics


def entropy_ppo_loss(config, model_output, data, dp_group=None, *, inner=None):
    """``inner`` (verl's `ppo_loss`, or `lopti_ppo_loss`) with each response token's entropy H_t handed to the
    tokendyn loss for a rule that reads it (ASPO, `needs_entropy`): verl's policy-loss call has no entropy
    argument, so the padded, detached H_t sits in the loss config's mutable ``token_entropy`` for this call only.
    verl computes H_t with ``actor.calculate_entropy=True`` (or an entropy bonus). Any other config: ``inner``."""
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    inner = ppo_loss if inner is None else inner
    opts = config.policy_loss
    if not needs_entropy(opts):
        return inner(config, model_output, data, dp_group)
    entropy = model_output.get("entropy")
    if entropy is None:
        raise VerlConfigError(
            f"actor.calculate_entropy: base_loss_mode {opts.base_loss_mode!r} reads each token's entropy: set "
            "actor_rollout_ref.actor.calculate_entropy=True"
        )
    opts.token_entropy = no_padding_2_padding(entropy, data).detach()
    try:
        return inner(config, model_output, data, dp_group)
    finally:
        opts.token_entropy = None


def check_version() -> str:
    """verl's version, or an error naming the series this glue supports."""
    import verl

    version = getattr(verl, "__version__", "unknown")
    if not str(version).startswith(VERL_SERIES + "."):
        raise RuntimeError(f"tokendyn's verl glue supports verl {VERL_SERIES}.x, found {version}")
    return version


def disable_trl_value_head_patch() -> None:
    """verl's `apply_monkey_patch` patches `AutoModelForCausalLMWithValueHead.state_dict` whenever TRL is
    importable, but TRL 1.16 (which tokendyn's trainer needs) has no such class: building verl's engine then fails
    with an ImportError. GRPO needs no value head, so verl's monkey-patch module is told TRL is absent (its own
    `is_trl_available`, nothing else). Raises if verl no longer has that name (then this is to be revisited)."""
    from verl.models.transformers import monkey_patch

    if not hasattr(monkey_patch, "is_trl_available"):
        raise RuntimeError(
            "verl.models.transformers.monkey_patch has no is_trl_available: tokendyn's TRL value-head workaround "
            "needs updating for this verl"
        )
    monkey_patch.is_trl_available = lambda: False


def register_loss() -> None:
    """Register the tokendyn loss with verl and apply the TRL workaround; idempotent."""
    check_version()
    disable_trl_value_head_patch()
    if core_algos.POLICY_LOSS_REGISTRY.get(LOSS_NAME) is not tokendyn_policy_loss:
        core_algos.register_policy_loss(LOSS_NAME)(tokendyn_policy_loss)
