"""verl's rollout correction beside the tokendyn loss: ``bypass_mode`` refused in one line.

verl 0.9's ``algorithm.rollout_correction.bypass_mode=true`` skips the old-log-prob pass and takes the rollout's
log-probs as pi_old (``old_log_probs = rollout_log_probs``). Under ``loss_mode=tokendyn`` that changes what tokendyn
means by pi_old without a word: the probe's bins, the (1 - pi) bound's pi, Lopti's split, Reweight's weights and the
sampler records would all be the sampler's mu, and the trainer's own pi_old (the mismatch's other side) would be
gone; verl's legacy trainer also rewrites ``actor.policy_loss.loss_mode`` to its own ``"bypass_mode"`` loss
(``rollout_corr_helper.apply_bypass_mode``), replacing tokendyn's loss. `install` makes verl refuse it where its
entry point checks the config (``verl.utils.config.validate_config``, which ``main_ppo`` calls before Ray starts) and
in ``apply_bypass_mode`` itself; a verl whose two functions cannot be imported or have moved stops `install` in one
line (`VerlInternalsChanged`): the guard never vanishes without a word. The decoupled mode (``bypass_mode=false``, verl's default) keeps the trainer's pi_old
and passes the weights in as ``rollout_is_weights`` (`tokendyn.integrations.verl.objective`).
"""

from __future__ import annotations

import sys
from functools import wraps
from typing import Any

from tokendyn.integrations.verl.internals import WRAPPED, VerlInternalsChanged, wrapped_function
from tokendyn.integrations.verl.loss import LOSS_NAME, VerlConfigError

_MARK = "_tokendyn_bypass_check"
BYPASS_FIELD = "algorithm.rollout_correction.bypass_mode"
LOSS_FIELD = "actor_rollout_ref.actor.policy_loss.loss_mode"


def _get(node: Any, key: str) -> Any:
    if node is None:
        return None
    if isinstance(node, dict):
        return node.get(key)
    getter = getattr(node, "get", None)  # OmegaConf's DictConfig
    return getter(key) if callable(getter) else getattr(node, key, None)


def refuse_bypass(bypass: Any, loss_mode: Any) -> None:
    """One-line `VerlConfigError` when verl's bypass mode would replace the tokendyn loss."""
    if bool(bypass) and loss_mode == LOSS_NAME:
        raise VerlConfigError(
            f"{BYPASS_FIELD}: must be false with {LOSS_FIELD}={LOSS_NAME} (bypass takes the sampler's log-probs as "
            "pi_old: tokendyn's bins, Lopti's split and records would be the sampler's, and verl's legacy trainer "
            "swaps in its own loss); allowed: false (decoupled: the trainer's pi_old, verl's rollout_is_weights in "
            "tokendyn's loss), got true"
        )


def check_config(config: Any) -> None:
    """The whole run's config (``algorithm`` and ``actor_rollout_ref``), as verl's trainer receives it."""
    correction = _get(_get(config, "algorithm"), "rollout_correction")
    loss = _get(_get(_get(_get(config, "actor_rollout_ref"), "actor"), "policy_loss"), "loss_mode")
    refuse_bypass(_get(correction, "bypass_mode"), loss)


def _guarded(spec: tuple):
    """verl's function of ``spec`` (`internals.WRAPPED`), or one line naming why the guard cannot be installed."""
    try:
        return wrapped_function(*spec)
    except ImportError as exc:
        why = " ".join(str(exc).split()) or type(exc).__name__
        raise VerlInternalsChanged(
            f"{spec[0]}.{spec[1]}: cannot be imported ({why}), so the {BYPASS_FIELD} guard of the tokendyn loss "
            "cannot be installed; install verl's trainer dependencies (pip install 'tokendyn[verl]')"
        ) from None


def _rebind(old, new) -> None:
    """Every module that imported ``old`` by name before it was wrapped (``main_ppo`` binds validate_config when it
    is imported) gets ``new``."""
    for module in list(sys.modules.values()):
        if (getattr(module, "__dict__", None) or {}).get(old.__name__) is old:  # (no module __getattr__ runs)
            setattr(module, old.__name__, new)


def install() -> None:
    """Wrap ``verl.utils.config.validate_config`` and ``rollout_corr_helper.apply_bypass_mode`` once (``main_ppo``
    binds the first when it is imported, after verl's plugins ran: a module that bound it earlier is rebound; the
    legacy trainer imports the second from its module at the call). A module that cannot be imported, or a function
    that moved: `VerlInternalsChanged` in one line (`_guarded`)."""
    specs = {spec[1]: spec for spec in WRAPPED}
    validate = _guarded(specs["validate_config"])
    if not getattr(validate, _MARK, False):

        @wraps(validate)
        def validate_config(config, *args, **kwargs):
            check_config(config)
            return validate(config, *args, **kwargs)

        setattr(validate_config, _MARK, True)
        _rebind(validate, validate_config)
    apply = _guarded(specs["apply_bypass_mode"])
    if not getattr(apply, _MARK, False):

        @wraps(apply)
        def apply_bypass_mode(batch, rollout_corr_config=None, policy_loss_config=None):
            refuse_bypass(True, _get(policy_loss_config, "loss_mode"))
            return apply(batch, rollout_corr_config, policy_loss_config)

        setattr(apply_bypass_mode, _MARK, True)
        _rebind(apply, apply_bypass_mode)
