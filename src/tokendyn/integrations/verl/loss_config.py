"""The tokendyn verl loss's configuration: `TokendynPolicyLossConfig` (verl's `PolicyLossConfig` with tokendyn's
fields, validated when built), its checks (`check_base_mode`, `check_stage`, one line per bad value) and the names
the loss is registered under. Re-exported by `tokendyn.integrations.verl.loss`, the loss itself."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from verl.trainer.ppo import core_algos
from verl.workers.config.actor import PolicyLossConfig

from tokendyn.config import ProbeConfig, ProbeConfigError
from tokendyn.config import resolve as resolve_probe_config
from tokendyn.probe.rules import SURROGATES
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
