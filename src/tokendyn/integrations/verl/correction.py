"""verl's rollout correction beside the tokendyn loss: ``bypass_mode`` refused in one line.

verl 0.9's ``algorithm.rollout_correction.bypass_mode=true`` skips the old-log-prob pass and takes the rollout's
log-probs as pi_old (``old_log_probs = rollout_log_probs``). Under ``loss_mode=tokendyn`` that changes what tokendyn
means by pi_old without a word: the probe's bins, the (1 - pi) bound's pi, Lopti's split, Reweight's weights and the
sampler records would all be the sampler's mu, and the trainer's own pi_old (the mismatch's other side) would be
gone; verl's legacy trainer also rewrites ``actor.policy_loss.loss_mode`` to its own ``"bypass_mode"`` loss
(``rollout_corr_helper.apply_bypass_mode``), replacing tokendyn's loss. `install` makes verl refuse it where its
entry point checks the config (``verl.utils.config.validate_config``, which ``main_ppo`` calls before Ray starts) and
in ``apply_bypass_mode`` itself. The decoupled mode (``bypass_mode=false``, verl's default) keeps the trainer's pi_old
and passes the weights in as ``rollout_is_weights`` (`tokendyn.integrations.verl.objective`).
"""

from __future__ import annotations

from functools import wraps
from typing import Any

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


def install() -> bool:
    """Wrap ``verl.utils.config.validate_config`` and ``rollout_corr_helper.apply_bypass_mode`` once (``main_ppo``
    binds the first when it is imported, after verl's plugins ran; the legacy trainer imports the second from its
    module at the call); False when either module cannot be imported here."""
    try:
        from verl.trainer.ppo import rollout_corr_helper
        from verl.utils import config as verl_config
    except ImportError:
        return False
    validate = verl_config.validate_config
    if not getattr(validate, _MARK, False):

        @wraps(validate)
        def validate_config(config, *args, **kwargs):
            check_config(config)
            return validate(config, *args, **kwargs)

        setattr(validate_config, _MARK, True)
        verl_config.validate_config = validate_config
    apply = rollout_corr_helper.apply_bypass_mode
    if not getattr(apply, _MARK, False):

        @wraps(apply)
        def apply_bypass_mode(batch, rollout_corr_config=None, policy_loss_config=None):
            refuse_bypass(True, _get(policy_loss_config, "loss_mode"))
            return apply(batch, rollout_corr_config, policy_loss_config)

        setattr(apply_bypass_mode, _MARK, True)
        rollout_corr_helper.apply_bypass_mode = apply_bypass_mode
    return True
