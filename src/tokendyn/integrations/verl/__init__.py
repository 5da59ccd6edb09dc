"""tokendyn inside verl (0.9.x): Advantage Reweighting, the Delta-log-p reweight, Lopti and the per-token rules verl
lacks (ASPO, CE-GPPO) as a registered verl policy loss (`loss`), W-REINFORCE as an advantage estimator
(`advantages`), where each
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

On a machine without a GPU, ``VERL_PLATFORM=cpu`` and ``actor_rollout_ref.rollout.name=hf`` run verl's own trainer
on the CPU (`backend`: the platform "cpu" and a Hugging Face ``generate`` rollout, `hf_rollout`); every verl
internal that leans on is named in `internals`.
"""

from tokendyn.integrations.verl.advantages import register_estimator
from tokendyn.integrations.verl.backend import register_backend
from tokendyn.integrations.verl.correction import install as install_bypass_check
from tokendyn.integrations.verl.loss import (
    LOPTI_STAGES,
    LOSS_NAME,
    TOKENDYN_RULES,
    VERL_SERIES,
    TokendynPolicyLossConfig,
    VerlConfigError,
    check_stage,
    check_version,
    disable_trl_value_head_patch,
    entropy_ppo_loss,
    lopti_ppo_loss,
    register_loss,
    stage_advantages,
    stage_mask,
    tokendyn_policy_loss,
)
from tokendyn.integrations.verl.worker import install as install_worker


def register() -> None:
    """Register the tokendyn loss with verl (`loss.register_loss`), wrap the actor worker's update
    (`worker.install`), register the advantage estimator ``w_reinforce`` (`advantages.register_estimator`) and
    the CPU backend's platform "cpu" and rollout "hf" (`backend.register_backend`, active only with
    ``VERL_PLATFORM=cpu``), and refuse verl's rollout-correction ``bypass_mode`` under the tokendyn loss
    (`correction.install`, which raises in one line when it cannot install the guard); idempotent."""
    register_loss()
    register_estimator()
    install_worker()
    register_backend()
    install_bypass_check()


__all__ = [
    "LOPTI_STAGES",
    "LOSS_NAME",
    "TOKENDYN_RULES",
    "VERL_SERIES",
    "TokendynPolicyLossConfig",
    "VerlConfigError",
    "check_stage",
    "check_version",
    "disable_trl_value_head_patch",
    "entropy_ppo_loss",
    "install_bypass_check",
    "install_worker",
    "lopti_ppo_loss",
    "register",
    "register_backend",
    "register_estimator",
    "register_loss",
    "stage_advantages",
    "stage_mask",
    "tokendyn_policy_loss",
]

register()  # at import: the plugin entry point imports this package (see verl_plugin for the import order)
