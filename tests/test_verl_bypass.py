"""verl's rollout-correction ``bypass_mode`` under the tokendyn loss is refused in one line naming the field: at
verl's own config check (``validate_config``), at verl's own ``apply_bypass_mode`` (which would rewrite the loss
mode), and from the real entry point ``python -m verl.trainer.main_ppo`` before Ray starts. verl's decoupled mode, and
bypass under verl's own losses, are left as verl runs them. A guard that cannot be installed stops the registration in
one line, and each verl function the glue wraps is in `internals.check`."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo import rollout_corr_helper
from verl.utils import config as verl_config

from tokendyn.integrations import verl as glue
from tokendyn.integrations.verl.correction import BYPASS_FIELD, check_config

pytestmark = pytest.mark.slow_tier  # the slow tier: `make test-slow` (docs/development.md)

glue.register()

ROOT = Path(__file__).resolve().parents[1]


def _config(bypass: bool, loss_mode: str = "tokendyn"):
    return OmegaConf.create(
        {
            "algorithm": {"rollout_correction": {"rollout_is": "token", "bypass_mode": bypass}},
            "actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": loss_mode}}},
        }
    )


def test_verls_config_check_refuses_bypass_under_the_tokendyn_loss():
    with pytest.raises(glue.VerlConfigError) as err:
        verl_config.validate_config(_config(True), use_reference_policy=False, use_critic=False)
    message = str(err.value)
    assert message.startswith(f"{BYPASS_FIELD}: must be false") and "\n" not in message
    check_config(_config(False))  # the decoupled mode: tokendyn's loss with the weights
    check_config(_config(True, loss_mode="vanilla"))  # bypass under verl's own loss: verl's business


def _batch():
    logp = torch.log(torch.rand(2, 3).clamp(min=0.1))
    return DataProto.from_dict({"old_log_probs": logp, "rollout_log_probs": logp - 0.01})


def test_verls_apply_bypass_mode_refuses_the_tokendyn_loss_and_keeps_its_own_otherwise():
    corr = OmegaConf.create({"rollout_is": "token", "bypass_mode": True})
    ours = OmegaConf.create({"loss_mode": "tokendyn"})
    with pytest.raises(glue.VerlConfigError, match=BYPASS_FIELD):
        rollout_corr_helper.apply_bypass_mode(_batch(), corr, ours)
    assert ours.loss_mode == "tokendyn"  # refused before verl rewrote it
    theirs = OmegaConf.create({"loss_mode": "vanilla"})
    batch = _batch()
    rollout_corr_helper.apply_bypass_mode(batch, corr, theirs)
    assert theirs.loss_mode == "bypass_mode"
    assert torch.equal(batch.batch["old_log_probs"], batch.batch["rollout_log_probs"])


def test_main_ppo_with_bypass_mode_and_the_tokendyn_loss_stops_in_one_line(tmp_path):
    """The README's verl command with ``algorithm.rollout_correction.bypass_mode=true`` added: it exits non-zero
    with the one line before Ray starts, and no update ran (no records)."""
    env = {**os.environ, "PYTHON": sys.executable, "STEPS": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_memory_monitor_refresh_ms": "0"}  # fmt: skip
    proc = subprocess.run(
        ["bash", str(ROOT / "examples" / "verl_main_ppo.sh"), str(tmp_path),
         "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.bypass_mode=true"],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-2000:]
    lines = [line for line in log.splitlines() if f"{BYPASS_FIELD}: must be false" in line]
    assert lines, log[-3000:]
    assert "Started a local Ray instance" not in log
    assert not list((tmp_path / "probe").glob("records/*.parquet"))


def test_the_guard_that_cannot_be_installed_stops_the_registration_in_one_line(monkeypatch):
    """verl's rollout-correction helper that does not import (``sys.modules`` entry None: Python's own "import of
    this module fails") stops `correction.install` and the plugin's `register` in one line naming the module and
    the field it guards; the guard never vanishes quietly."""
    from tokendyn.integrations.verl import correction
    from tokendyn.integrations.verl.internals import VerlInternalsChanged

    monkeypatch.setitem(sys.modules, "verl.trainer.ppo.rollout_corr_helper", None)
    for call in (correction.install, glue.register):
        with pytest.raises(VerlInternalsChanged) as err:
            call()
        message = str(err.value)
        assert message.startswith(
            "verl.trainer.ppo.rollout_corr_helper.apply_bypass_mode: cannot be imported"
        )
        assert BYPASS_FIELD in message and "\n" not in message


def test_a_module_that_bound_validate_config_before_the_guard_gets_the_guard(monkeypatch):
    """A module that imported ``validate_config`` by name before `install` (as ``main_ppo`` does) is rebound: its
    name refuses bypass too."""
    import types

    from tokendyn.integrations.verl import correction

    original = inspect.unwrap(verl_config.validate_config)
    early = types.ModuleType("_early_importer")
    early.validate_config = original
    monkeypatch.setitem(sys.modules, "_early_importer", early)
    monkeypatch.setattr(verl_config, "validate_config", original)  # as before any install
    correction.install()
    assert early.validate_config is verl_config.validate_config is not original
    with pytest.raises(glue.VerlConfigError, match=BYPASS_FIELD):
        early.validate_config(_config(True), use_reference_policy=False, use_critic=False)


def test_the_wrapped_verl_functions_are_in_internals_check(monkeypatch):
    """`internals.check` names each verl function the glue wraps, and a moved one (a parameter renamed, the
    function gone) fails it in one line naming it."""
    from tokendyn.integrations.verl import internals

    names = internals.check()
    for name in ("verl.utils.config.validate_config", "verl.trainer.ppo.rollout_corr_helper.apply_bypass_mode",
                 "verl.workers.engine_workers.TrainingWorker.train_mini_batch"):  # fmt: skip
        assert name in names

    def apply_bypass_mode(
        data, rollout_corr_config=None, policy_loss_config=None
    ):  # its first parameter renamed
        return data

    monkeypatch.setattr(rollout_corr_helper, "apply_bypass_mode", apply_bypass_mode)
    with pytest.raises(internals.VerlInternalsChanged, match=r"apply_bypass_mode now takes \(data, ") as err:
        internals.check()
    assert "\n" not in str(err.value)
    monkeypatch.delattr(rollout_corr_helper, "apply_bypass_mode")
    with pytest.raises(internals.VerlInternalsChanged, match="apply_bypass_mode is gone"):
        internals.check()
