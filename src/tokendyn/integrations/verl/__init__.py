"""tokendyn inside verl (0.9.x): Advantage Reweighting and Lopti as a registered verl policy loss (`loss`), where each
response token sits inside verl's actor engine (`layout`), and the probe attached to the engine's actor module
(`probe`). All of tokendyn's verl glue is this package (and `verl_plugin`, the entry point that imports it), so an
upgrade of verl touches one place.

Importing this package calls `register()` (so the plugin entry point, which imports it in every verl process,
needs nothing else, whichever of verl and tokendyn is imported first): it registers the loss and wraps the actor
worker's update (`worker`: the probe and Lopti's two updates, from the loss config). A verl run turns it on through its
config::

    actor_rollout_ref.actor.policy_loss._target_=tokendyn.integrations.verl.TokendynPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=tokendyn
    +actor_rollout_ref.actor.policy_loss.probe_dir=/path/to/run       # the probe (optional; "+": not in verl's YAML)
    +actor_rollout_ref.actor.policy_loss.lopti_eta=0.5                # Lopti (optional)
"""

from tokendyn.integrations.verl.loss import (
    LOPTI_STAGES,
    LOSS_NAME,
    VERL_SERIES,
    TokendynPolicyLossConfig,
    VerlConfigError,
    check_stage,
    check_version,
    disable_trl_value_head_patch,
    lopti_ppo_loss,
    register_loss,
    stage_advantages,
    stage_mask,
    tokendyn_policy_loss,
)
from tokendyn.integrations.verl.worker import install as install_worker


def register() -> None:
    """Register the tokendyn loss with verl (`loss.register_loss`) and wrap the actor worker's update
    (`worker.install`); idempotent."""
    register_loss()
    install_worker()


__all__ = [
    "LOPTI_STAGES",
    "LOSS_NAME",
    "VERL_SERIES",
    "TokendynPolicyLossConfig",
    "VerlConfigError",
    "check_stage",
    "check_version",
    "disable_trl_value_head_patch",
    "install_worker",
    "lopti_ppo_loss",
    "register",
    "register_loss",
    "stage_advantages",
    "stage_mask",
    "tokendyn_policy_loss",
]

register()  # at import: the plugin entry point imports this package (see verl_plugin for the import order)
