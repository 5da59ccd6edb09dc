"""verl's rollout-correction ``bypass_mode`` under the tokendyn loss is refused in one line naming the field: at
verl's own config check (``validate_config``), at verl's own ``apply_bypass_mode`` (which would rewrite the loss
mode), and from the real entry point ``python -m verl.trainer.main_ppo`` before Ray starts. verl's decoupled mode, and
bypass under verl's own losses, are left as verl runs them."""

from __future__ import annotations

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
