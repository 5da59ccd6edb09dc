"""`TokendynGRPOConfig`: TRL's `GRPOConfig` plus the paper's two remedies and the advantage estimator.

Every field is a `HfArgumentParser` flag (TRL-style CLI/YAML parity). Invalid values fail at construction with a
message naming the field and the accepted values.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass, field, fields
from functools import partial

from trl import GRPOConfig

from tokendyn.config import ProbeConfig, ProbeConfigError
from tokendyn.probe.tokenloss import Objective
from tokendyn.remedies import LOPTI_ORDERS

ADVANTAGE_ESTIMATORS = ("grpo", "reinforce_pp")


def _is_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


PROBE_PREFIX = "probe_"


def _none_or(kind: type):
    """An argparse type reading ``none`` (any case) as None, anything else as ``kind``: `--probe_check_tokens none`."""

    def parse(text: str):
        return None if str(text).strip().lower() == "none" else kind(text)

    parse.__name__ = f"{kind.__name__}_or_none"
    return parse


def _cli_type(annotation):
    """The HfArgumentParser-friendly type of a ProbeConfig field: tuples become lists (``nargs="+"``); an optional
    number takes ``none`` on the command line."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is tuple:
        return list[args[0]]
    if isinstance(annotation, types.UnionType) and any(typing.get_origin(a) is tuple for a in args):
        return list[next(typing.get_args(a)[0] for a in args if typing.get_origin(a) is tuple)] | None
    if isinstance(annotation, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and rest[0] in (int, float):
            return _none_or(rest[0])
    return annotation


def with_probe_fields(cls):
    """Add one field ``probe_<name>`` per `ProbeConfig` field to ``cls`` (before ``@dataclass``): same default, same
    help text, a CLI-friendly type. The trainer's probe options are derived from ProbeConfig, never written twice."""
    hints = typing.get_type_hints(ProbeConfig)
    annotations = cls.__dict__.get("__annotations__", {})
    for f in fields(ProbeConfig):
        name = PROBE_PREFIX + f.name
        meta = {"help": f.metadata["help"] + f" (`ProbeConfig.{f.name}`)"}
        if isinstance(f.default, tuple):
            value = field(default_factory=partial(list, f.default), metadata=meta)
        else:
            value = field(default=f.default, metadata=meta)
        annotations[name] = _cli_type(hints[f.name])
        setattr(cls, name, value)
    cls.__annotations__ = annotations
    return cls


@dataclass
@with_probe_fields
class TokendynGRPOConfig(GRPOConfig):
    r"""
    Configuration of [`TokendynGRPOTrainer`]: all of [`trl.GRPOConfig`] and the fields below.

    Parameters:
        advantage_reweight_alpha (`float`, *optional*, defaults to `0.0`):
            Advantage Reweighting: A_t <- (alpha * pi_old(o_t) + 1 - alpha) * A_t. `0.0` is plain GRPO. Range [0, 1].
        lopti_eta (`float` or `None`, *optional*, defaults to `None`):
            Lopti threshold: tokens with pi_old < eta form the low group. `None` = off. Range (0, 1).
        lopti_quantile (`float` or `None`, *optional*, defaults to `None`):
            Lopti with a data-dependent threshold: the quantile of pi_old over the batch's valid tokens. `None` = off.
            Range (0, 1). Exclusive with `lopti_eta`.
        lopti_order (`str`, *optional*, defaults to `"low_first"`):
            `"low_first"` (the method) or `"high_first"` (the paper's ablation).
        advantage_estimator (`str`, *optional*, defaults to `"grpo"`):
            `"grpo"` (TRL's group-normalised advantages) or `"reinforce_pp"` (batch-whitened returns, no group
            baseline).

    The paper's K&K setting (PAPER.md §1.2) in TRL terms: `loss_type="dapo"`, `epsilon=0.2`, `epsilon_high=0.24`,
    `delta=10.0` (TRL's ratio cap is exactly the official dual-clip constant c), `beta=0.001` with
    `use_bias_correction_kl=False` (TRL 1.16 defaults to the ratio-corrected KL; the official code uses plain k3),
    `temperature=0.7`, `learning_rate=1e-6`, `weight_decay=0.01`, `lr_scheduler_type="constant"`, `max_grad_norm=1.0`,
    `num_iterations=1`, `num_generations=8`. Differences left: TRL's group std epsilon is 1e-4 (official 1e-6) and
    TRL does not clamp the KL (official clamps log-ratio to [-5, 5] and k3 to [-10, 10]).
    """

    advantage_reweight_alpha: float = field(
        default=0.0,
        metadata={
            "help": "Advantage Reweighting coefficient alpha: each token's advantage is multiplied by "
            "alpha * pi_old(token) + 1 - alpha, with pi_old the sampling policy's probability at the sampling "
            "temperature (detached). 0.0 (default) is plain GRPO; the paper uses 0.3 on K&K, 0.1 on math. "
            "Range [0, 1]."
        },
    )
    lopti_eta: float | None = field(
        default=None,
        metadata={
            "help": "Lopti (Low-Probability Token Isolation) threshold eta: tokens with pi_old < eta are updated in "
            "a first full update stage, the others in a second one over the same rollout batch. None (default) "
            "disables Lopti; the paper uses 0.5. Range (0, 1). Exclusive with `lopti_quantile`."
        },
    )
    lopti_quantile: float | None = field(
        default=None,
        metadata={
            "help": "Lopti with a quantile threshold: eta is the given quantile of pi_old over the valid tokens of "
            "the rollout batch. None (default) disables it. Range (0, 1). Exclusive with `lopti_eta`."
        },
    )
    lopti_order: str = field(
        default="low_first",
        metadata={
            "help": "Order of the two Lopti stages: 'low_first' (the method) or 'high_first' (the paper's "
            "reversed-order ablation: pi_old >= eta first).",
            "choices": list(LOPTI_ORDERS),
        },
    )
    advantage_estimator: str = field(
        default="grpo",
        metadata={
            "help": "Advantage estimator: 'grpo' (TRL's group-normalised rewards) or 'reinforce_pp' (REINFORCE++: "
            "returns whitened over all valid tokens of the rollout batch, no group baseline).",
            "choices": list(ADVANTAGE_ESTIMATORS),
        },
    )

    probe_every: int = field(
        default=0,
        metadata={
            "help": "Record per-token activation-gradient statistics (binned by pi_old) from the real training "
            "backward every this many optimizer steps into OUTPUT_DIR/records; 0 (default) = off. The probe's "
            "options are the probe_<field> flags, one per `tokendyn.ProbeConfig` field."
        },
    )
    probe_dump_rollouts: bool = field(
        default=False,
        metadata={
            "help": "Also write the first micro-batch of every probed rollout as a rollouts file "
            "(OUTPUT_DIR/rollouts/step-NNNNNN.parquet) that `tokendyn probe` reads."
        },
    )

    def __post_init__(self):
        self._validate_tokendyn_fields()
        super().__post_init__()
        self._validate_lopti_schedule()

    def probe_config(self) -> ProbeConfig:
        """The `ProbeConfig` of the probe_<field> fields (validated; an error names the probe_ field)."""
        values = {f.name: getattr(self, PROBE_PREFIX + f.name) for f in fields(ProbeConfig)}
        try:
            return ProbeConfig(**values)
        except ProbeConfigError as exc:
            raise ValueError(f"{PROBE_PREFIX}{exc.field}: {exc.message}") from None

    @property
    def lopti_enabled(self) -> bool:
        """Whether Lopti's two-stage update is on."""
        return self.lopti_eta is not None or self.lopti_quantile is not None

    def _validate_tokendyn_fields(self) -> None:
        alpha = self.advantage_reweight_alpha
        if not _is_number(alpha) or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"advantage_reweight_alpha must be a number in [0, 1] (0 = off), got {alpha!r}")
        for name in ("lopti_eta", "lopti_quantile"):
            value = getattr(self, name)
            if value is not None and (not _is_number(value) or not 0.0 < value < 1.0):
                raise ValueError(
                    f"{name} must be None (off) or a number in the open interval (0, 1), got {value!r}"
                )
        if self.lopti_eta is not None and self.lopti_quantile is not None:
            raise ValueError(
                "lopti_eta and lopti_quantile are mutually exclusive: set one of them (or neither to disable Lopti), "
                f"got lopti_eta={self.lopti_eta!r}, lopti_quantile={self.lopti_quantile!r}"
            )
        if self.lopti_order not in LOPTI_ORDERS:
            raise ValueError(
                f"lopti_order must be one of {', '.join(LOPTI_ORDERS)}; got {self.lopti_order!r}"
            )
        if (
            not isinstance(self.probe_every, int)
            or isinstance(self.probe_every, bool)
            or self.probe_every < 0
        ):
            raise ValueError(f"probe_every must be an integer >= 0, got {self.probe_every!r}")
        probe = self.probe_config()
        if not _is_number(self.temperature) or self.temperature <= 0:
            raise ValueError(
                f"temperature must be a number > 0 (the sampling temperature), got {self.temperature!r}"
            )
        if self.probe_every and probe.active_analyses:
            Objective.from_config(
                self
            )  # the analyses must reproduce the trained loss: else fail now, naming it
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"advantage_estimator must be one of {', '.join(ADVANTAGE_ESTIMATORS)}; got {self.advantage_estimator!r}"
            )

    def _validate_lopti_schedule(self) -> None:
        if not self.lopti_enabled:
            return
        passes = self.steps_per_generation * self.num_iterations
        if passes % self.gradient_accumulation_steps != 0:
            raise ValueError(
                "Lopti needs each stage to span whole optimizer steps: steps_per_generation * num_iterations "
                f"({self.steps_per_generation} * {self.num_iterations}) must be a multiple of "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps})"
            )
        if self.entropy_coef != 0.0 or self.use_adaptive_entropy:
            raise ValueError(
                "Lopti does not support the entropy bonus (it would not be masked per stage): set entropy_coef=0.0 "
                f"and use_adaptive_entropy=False, got entropy_coef={self.entropy_coef!r}, "
                f"use_adaptive_entropy={self.use_adaptive_entropy!r}"
            )
