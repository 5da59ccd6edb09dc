"""tokendyn inside verl (0.9.x): Advantage Reweighting and Lopti as a registered verl policy loss (`loss`), where each
response token sits inside verl's actor engine (`layout`), and the probe attached to the engine's actor module
(`probe`). All of tokendyn's verl glue is this package (and `verl_plugin`, the entry point that imports it), so an
upgrade of verl touches one place.

A verl run names the loss through its config::

    actor_rollout_ref.actor.policy_loss._target_=tokendyn.integrations.verl.TokendynPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=tokendyn
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
    register,
    stage_advantages,
    stage_mask,
    tokendyn_policy_loss,
)

__all__ = [
    "LOPTI_STAGES",
    "LOSS_NAME",
    "VERL_SERIES",
    "TokendynPolicyLossConfig",
    "VerlConfigError",
    "check_stage",
    "check_version",
    "disable_trl_value_head_patch",
    "register",
    "stage_advantages",
    "stage_mask",
    "tokendyn_policy_loss",
]
