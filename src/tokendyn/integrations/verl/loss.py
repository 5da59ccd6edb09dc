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

import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from verl.trainer.ppo import core_algos
from verl.workers.config.actor import PolicyLossConfig

from tokendyn.config import ProbeConfig, ProbeConfigError
from tokendyn.config import resolve as resolve_probe_config
from tokendyn.probe.rules import SURROGATES, TokenInputs
from tokendyn.remedies import logp_reweight_advantages, lopti_masks, reweight_advantages
from tokendyn.vocab import LOPTI_ORDERS

LOSS_NAME = "tokendyn"
VERL_SERIES = "0.9"  # the verl minor series this glue is written against (`check_version`)
LOPTI_STAGES = ("all", "low", "high")
# tokendyn's per-token rules that verl 0.9 has no loss mode for, trained as `base_loss_mode` by the tokendyn loss
# (`tokendyn.probe.rules`; their parameters are fields of `TokendynPolicyLossConfig`, with the published defaults)
TOKENDYN_RULES = ("aspo", "ce_gppo")
# rules that cannot run inside verl's policy-loss call: the one-line reason (`TokendynPolicyLossConfig` raises it)
UNAVAILABLE_RULES = {
    "lp_reg": "Lp-Reg needs log pi_proxy(o_t), a min-p filter of pi_old's whole distribution at every response "
    "position, and verl's policy-loss call sees only log pi_old of the sampled token (it would take an extra "
    "old-policy forward over the batch, as the authors' compute_minp_log_prob, not built here): train Lp-Reg with "
    "tokendyn's TRL trainer (policy_loss='lp_reg')",
}


class VerlConfigError(ValueError):
    """A bad tokendyn option in a verl config: the message is one line naming the field and its allowed values."""


def with_rule_fields(cls):
    """One field per parameter of the rules in `TOKENDYN_RULES` (`tokendyn.probe.rules.SURROGATES`: name, published
    default), added before ``@dataclass``: a new rule's parameters need no line here."""
    annotations = cls.__dict__.get("__annotations__", {})
    for name in TOKENDYN_RULES:
        for p in SURROGATES[name].params:
            annotations[p.name] = "float"
            setattr(cls, p.name, field(default=p.default))
    cls.__annotations__ = annotations
    return cls


def rule_params():
    """The parameters (`tokendyn.probe.rules.Param`) of every rule in `TOKENDYN_RULES`, each once."""
    return tuple(p for name in TOKENDYN_RULES for p in SURROGATES[name].params)


@dataclass
@with_rule_fields
class TokendynPolicyLossConfig(PolicyLossConfig):
    """verl's `PolicyLossConfig` with tokendyn's fields (validated when built, one line per bad value).

    base_loss_mode: the loss the tokendyn loss runs under: a registered verl loss (not "tokendyn" itself; verl's
        own function, e.g. "dppo_tv" / "dppo_kl" with verl's clip_ratio_low / clip_ratio_high as delta and
        clip_ratio_c as C), or one of tokendyn's rules verl lacks (`TOKENDYN_RULES`: "aspo", "ce_gppo"; their
        parameters are the fields named after them: ``aspo_eps``, ``ce_gppo_beta1``, ...). "lp_reg" is refused in
        one line (`UNAVAILABLE_RULES`).
    reweight_alpha: Advantage Reweighting's alpha in [0, 1] (0: off).
    logp_reweight_c: the Delta-log-p reweight's c >= 0, A <- (1 + c - c pi_old) A (0: off; the authors: 0.1, 0.2);
        exclusive with reweight_alpha (its mirror image).
    lopti_eta: Lopti's threshold on pi_old in (0, 1), or None. Set (or lopti_quantile), verl's actor worker runs
        Lopti's two updates per batch (`integrations.verl.worker`).
    lopti_quantile: instead of a fixed eta, the threshold is this empirical quantile of pi_old over the batch's
        response tokens (all data-parallel ranks), in (0, 1), or None; exclusive with lopti_eta.
    lopti_order: which group the first of the two updates keeps: "low_first" (the paper's) or "high_first".
    lopti_stage: the group whose advantages this update keeps: "all", "low" (pi_old < eta) or "high" (set by the
        two-stage update; "all" outside it).
    probe_dir: a run directory: the actor worker attaches tokendyn's probe to its engine and records every
        micro-batch there (one shard per data-parallel rank), or None (no probe).
    probe_options: `tokendyn.ProbeConfig` fields for that probe (e.g. ``{"bins": "intervals:4"}``).
    probe_analyses_every: run the rebalancing analyses (those ``probe_options["analyses"]`` switches on) on the
        first ``sample_sequences`` sequences of every n-th update's batch, verl's own loss as the objective
        (`integrations.verl.objective`); 0 (the default): off.
    probe_save_batches: save the batches of the first n updates under ``probe_dir/batches`` as `tokendyn probe`
        rollouts files (`integrations.verl.batches`), to replay them offline; 0 (the default): none."""

    _mutable_fields = PolicyLossConfig._mutable_fields | {"lopti_stage", "lopti_batch_eta", "token_entropy"}

    loss_mode: str = LOSS_NAME
    base_loss_mode: str = "vanilla"
    reweight_alpha: float = 0.0
    logp_reweight_c: float = 0.0
    lopti_eta: float | None = None
    lopti_quantile: float | None = None
    lopti_order: str = "low_first"
    lopti_stage: str = "all"
    lopti_batch_eta: float | None = (
        None  # the current batch's threshold from lopti_quantile (set by the update)
    )
    token_entropy: Any = None  # H_t (B, T) of the current micro-batch, for ASPO (set by `entropy_ppo_loss`)
    probe_dir: str | None = None
    probe_options: dict = field(default_factory=dict)
    probe_analyses_every: int = 0
    probe_save_batches: int = 0

    def __post_init__(self) -> None:
        check_base_mode(self.base_loss_mode)
        for p in rule_params():
            if p.problem(getattr(self, p.name)):
                raise VerlConfigError(
                    f"policy_loss.{p.name}: must be {p.allowed}, got {getattr(self, p.name)!r}"
                )
        _unit("reweight_alpha", self.reweight_alpha, closed=True)
        c = self.logp_reweight_c
        if isinstance(c, bool) or not isinstance(c, int | float) or not math.isfinite(c) or c < 0:
            raise VerlConfigError(f"policy_loss.logp_reweight_c: must be a number >= 0 (0: off), got {c!r}")
        if c and self.reweight_alpha:
            raise VerlConfigError(
                "policy_loss.logp_reweight_c: exclusive with reweight_alpha (mirror images: low-pi tokens protected "
                f"vs tamed), got reweight_alpha={self.reweight_alpha!r}, logp_reweight_c={c!r}"
            )
        for name in ("lopti_eta", "lopti_quantile"):
            if getattr(self, name) is not None:
                _unit(name, getattr(self, name), closed=False)
        if self.lopti_eta is not None and self.lopti_quantile is not None:
            raise VerlConfigError(
                f"policy_loss.lopti_quantile: exclusive with lopti_eta (set one), got lopti_eta={self.lopti_eta!r}, "
                f"lopti_quantile={self.lopti_quantile!r}"
            )
        if self.lopti_order not in LOPTI_ORDERS:
            raise VerlConfigError(
                f"policy_loss.lopti_order: must be one of {', '.join(LOPTI_ORDERS)}, got {self.lopti_order!r}"
            )
        check_stage(self.lopti_stage, self.eta)
        if self.probe_dir is not None and (not isinstance(self.probe_dir, str) or not self.probe_dir):
            raise VerlConfigError(
                f"policy_loss.probe_dir: must be a directory path or None, got {self.probe_dir!r}"
            )
        every = self.probe_analyses_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise VerlConfigError(
                f"policy_loss.probe_analyses_every: must be an integer >= 0 (0: off), got {every!r}"
            )
        saves = self.probe_save_batches
        if isinstance(saves, bool) or not isinstance(saves, int) or saves < 0:
            raise VerlConfigError(
                f"policy_loss.probe_save_batches: must be an integer >= 0 (0: none), got {saves!r}"
            )
        if saves and self.probe_dir is None:
            raise VerlConfigError(
                "policy_loss.probe_save_batches: needs policy_loss.probe_dir (the batches go to probe_dir/batches)"
            )
        self.probe_config()

    @property
    def lopti(self) -> bool:
        """Lopti is on: a fixed eta or a quantile."""
        return self.lopti_eta is not None or self.lopti_quantile is not None

    @property
    def eta(self) -> float | None:
        """The threshold in use: lopti_eta, or the current batch's quantile threshold (None outside an update)."""
        return self.lopti_eta if self.lopti_eta is not None else self.lopti_batch_eta

    def method_name(self) -> str:
        """The run's name in tokendyn's records and figures, in the TRL path's form: "verl vanilla + Reweight(a=0.3)
        + Lopti(eta=0.5)"."""
        parts = [f"verl {self.base_loss_mode}"]
        if self.reweight_alpha:
            parts.append(f"Reweight(a={self.reweight_alpha:g})")
        if self.logp_reweight_c:
            parts.append(f"LogpReweight(c={self.logp_reweight_c:g})")
        order = "" if self.lopti_order == "low_first" else ", high first"
        if self.lopti_eta is not None:
            parts.append(f"Lopti(eta={self.lopti_eta:g}{order})")
        if self.lopti_quantile is not None:
            parts.append(f"Lopti(q={self.lopti_quantile:g}{order})")
        return " + ".join(parts)

    def run_config(self) -> dict:
        """The remedy settings a run directory records (run.json "config"), under the TRL path's names."""
        return {
            "base_loss_mode": self.base_loss_mode,
            "advantage_reweight_alpha": self.reweight_alpha,
            "logp_reweight_c": self.logp_reweight_c,
            **{
                p.name: getattr(self, p.name)
                for p in (
                    SURROGATES[self.base_loss_mode].params if self.base_loss_mode in TOKENDYN_RULES else ()
                )
            },
            "lopti_eta": self.lopti_eta,
            "lopti_quantile": self.lopti_quantile,
            "lopti_order": self.lopti_order,
        }

    def probe_config(self) -> ProbeConfig:
        """The probe's checked `ProbeConfig` from ``probe_options`` (one line per bad field)."""
        known = {f.name for f in fields(ProbeConfig)}
        options = dict(self.probe_options or {})
        unknown = sorted(set(options) - known)
        if unknown:
            raise VerlConfigError(
                f"policy_loss.probe_options.{unknown[0]}: not a probe option (one of {', '.join(sorted(known))})"
            )
        try:
            config = resolve_probe_config(None, options)
        except ProbeConfigError as exc:
            raise VerlConfigError(f"policy_loss.probe_options.{exc}") from None
        if config.compare_rules:
            raise VerlConfigError(
                "policy_loss.probe_options.compare_rules: the paired comparison runs in tokendyn's TRL trainer and "
                "`tokendyn probe` (e.g. on a saved verl batch), not inside verl's worker yet; leave it empty"
            )
        return config


def check_base_mode(mode) -> None:
    """`base_loss_mode` must be a registered verl loss other than "tokendyn", or one of `TOKENDYN_RULES`; a rule of
    `UNAVAILABLE_RULES` fails with its reason, a tokendyn rule that verl has since registered under the same name
    fails too (the glue must then choose), each in one line."""
    if mode in UNAVAILABLE_RULES:
        raise VerlConfigError(
            f"policy_loss.base_loss_mode: {mode!r} cannot run in verl's loss: {UNAVAILABLE_RULES[mode]}"
        )
    if mode in TOKENDYN_RULES:
        if mode in core_algos.POLICY_LOSS_REGISTRY:
            raise VerlConfigError(
                f"policy_loss.base_loss_mode: {mode!r} is both a tokendyn rule and a registered verl loss in this "
                "verl: tokendyn's verl glue needs updating"
            )
        return
    if mode == LOSS_NAME or mode not in core_algos.POLICY_LOSS_REGISTRY:
        known = sorted(n for n in core_algos.POLICY_LOSS_REGISTRY if n != LOSS_NAME)
        raise VerlConfigError(
            f"policy_loss.base_loss_mode: must be a registered verl loss other than '{LOSS_NAME}' "
            f"({', '.join(known)}) or one of tokendyn's rules ({', '.join(TOKENDYN_RULES)}), got {mode!r}"
        )


def needs_entropy(opts) -> bool:
    """The tokendyn loss reads each token's entropy H_t (ASPO's clip range by entropy): `entropy_ppo_loss` hands it
    over (verl's policy-loss call has no entropy argument)."""
    mode = getattr(opts, "base_loss_mode", None)
    return (
        getattr(opts, "loss_mode", None) == LOSS_NAME
        and mode in TOKENDYN_RULES
        and SURROGATES[mode].needs_entropy
    )


def _unit(name: str, value, *, closed: bool) -> None:
    ok = not isinstance(value, bool) and isinstance(value, int | float)
    inside = ok and ((0.0 <= value <= 1.0) if closed else (0.0 < value < 1.0))
    if not inside:
        interval = "[0, 1]" if closed else "(0, 1)"
        raise VerlConfigError(f"policy_loss.{name}: must be a number in {interval}, got {value!r}")


def check_stage(stage: str, eta: float | None) -> None:
    """A Lopti stage must be one of LOPTI_STAGES, and "low" / "high" need `lopti_eta`."""
    if stage not in LOPTI_STAGES:
        raise VerlConfigError(
            f"policy_loss.lopti_stage: must be one of {', '.join(LOPTI_STAGES)}, got {stage!r}"
        )
    if stage != "all" and eta is None:
        raise VerlConfigError(
            f"policy_loss.lopti_stage: {stage!r} needs a threshold (policy_loss.lopti_eta, or lopti_quantile inside "
            "the two-stage update)"
        )


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
