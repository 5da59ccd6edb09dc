"""verl's own trainer end to end on the CPU: a real ``python -m verl.trainer.main_ppo`` (Ray, the transfer queue,
the agent loop, tokendyn's Hugging Face rollout server, verl's weight sync, the FSDP2 actor) run in a subprocess by
``examples/verl_main_ppo.sh`` on the embedded default policy and K&K rows in verl's format, with the README's tokendyn
overrides read from README.md itself (Reweight, Lopti, the probe, the analyses), two GRPO steps, logged to the
console and to an offline W&B run. Nothing of verl or of tokendyn is replaced; the run is checked against its own
log, its W&B history, its records, and `tokendyn probe` run offline on the batch the actor trained on.

Besides: every verl internal the CPU backend leans on is still there (`internals.check`), the platform and the
rollout are found through verl's own registries, and the rollout server's log-probs are the model's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from _wandb_history import exit_code, history, log_records, offline_env, run_file

pytestmark = pytest.mark.slow_tier  # the slow tier: `make test-slow` (docs/development.md)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "verl_main_ppo.sh"
ROLLOUT_PROBS_DIFF_MAX = 2e-5  # measured 2.3e-6 .. 3.8e-6 per step (float32 on both sides)
# in-run records vs `tokendyn probe` offline, and two ranks vs one, relative to the largest value of the quantity:
# measured <= 1.9e-6 and <= 4.4e-6
RECORDS_REL_DIFF = 2e-5
RECORD_KINDS = {
    "binstats",
    "hist",
    "bound",
    "checks",
    "tokens",
    "shares",
    "prob_change",
    "influence",
    "token_view",
    "precision_check",  # (the measured step precision's check, with sharded float64 steps under verl's FSDP2)
}

# every test of the module reads one main_ppo run (a module fixture, ~100 s of both cores and ~4 GB): one xdist worker
# runs them all (`--dist loadfile` in the Makefile), so the suite makes that run once, not once per worker


def readme_overrides() -> list[str]:
    """The tokendyn overrides of the README's ``main_ppo`` block, as written there."""
    blocks = [
        b for b in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S) if "main_ppo" in b
    ]
    assert len(blocks) == 1
    overrides = re.findall(r"^\s+(\+?actor_rollout_ref\.\S+)", blocks[0], flags=re.M)
    assert len(overrides) == 8
    return overrides


def with_value(overrides: list[str], key: str, value: str) -> list[str]:
    out = [o if o.lstrip("+").split("=", 1)[0] != key else f"{o.split('=', 1)[0]}={value}" for o in overrides]
    assert out != overrides or f"{key}={value}" in "\n".join(overrides), key
    return out


def step_metrics(log: str) -> dict[int, dict[str, float]]:
    """verl's console logger: one ``step:N - key:value - ...`` line per training step."""
    clean = re.sub(r"\x1b\[[0-9;]*m", "", log)
    steps = {}
    for line in clean.splitlines():
        match = re.search(r"\bstep:(\d+) - (.*)$", line)
        if not match:
            continue
        values = {}
        for item in match.group(2).split(" - "):
            key, _, value = item.partition(":")
            number = re.sub(r"^np\.\w+\((.*)\)$", r"\1", value.strip())
            try:
                values[key.strip()] = float(number)
            except ValueError:
                pass
        steps[int(match.group(1))] = values
    return steps


# ---- the install: `pip install "tokendyn[verl]"` is enough to start main_ppo ---------------------------------------
# what verl's trainer imports beyond verl's own requirements (its `verl-core` extra): module -> where it is imported
TRAINER_IMPORTS = {
    "transfer_queue": "verl/trainer/main_ppo.py, verl/trainer/ppo/v1/trainer_base.py",
    "zmq": "transfer_queue",
    "msgspec": "transfer_queue",
    "cachetools": "verl/workers/rollout/router.py",
    "fastapi": "verl/workers/engine_workers.py",
    "uvicorn": "verl/workers/engine_workers.py",
}


def test_verls_trainer_entry_point_imports_and_the_extras_carry_what_it_needs():
    import tomllib
    from importlib.metadata import packages_distributions

    code = (
        "import verl.trainer.main_ppo, verl.trainer.ppo.v1.trainer_base, verl.workers.rollout.router, "
        "verl.workers.engine_workers, transfer_queue; print('ok')"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.split()[-1:] == ["ok"], out.stderr[-3000:]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    distributions = packages_distributions()
    for extra in ("verl", "dev"):
        names = {re.split(r"[<>=!~\[ ]", req, maxsplit=1)[0].lower() for req in extras[extra]}
        for module, where in TRAINER_IMPORTS.items():
            dists = {d.lower() for d in distributions.get(module, [])}
            assert dists & names, f"{extra} extra: {module} ({where}) comes from {dists}, not listed"


# ---- fast: the backend's registrations and the server, in this process --------------------------------------------
def test_every_verl_internal_the_cpu_backend_leans_on_is_still_there():
    from tokendyn.integrations.verl import internals

    names = internals.check()
    assert len(names) == 8 and all(names)  # 5 internals of the CPU backend, 3 wrapped functions


def test_a_moved_verl_internal_fails_loudly_and_leaves_a_gpu_run_its_loss(monkeypatch):
    """`internals.check` names what moved; the plugin's registration warns without ``VERL_PLATFORM=cpu`` (the loss
    and the probe do not need the CPU backend) and raises with it."""
    from tokendyn.integrations.verl import backend, internals

    monkeypatch.setattr(internals, "ROLLOUT_ADAPTERS", ("verl.workers.rollout.base", "_NO_SUCH_TABLE"))
    with pytest.raises(internals.VerlInternalsChanged, match="_NO_SUCH_TABLE is gone"):
        internals.check()
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    with pytest.warns(UserWarning, match="the verl CPU backend is unavailable"):
        assert backend.register_backend() is False
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    monkeypatch.setattr(
        internals, "use_fsdp_engine_on_any_device", lambda: None
    )  # nothing else of this process
    with pytest.raises(internals.VerlInternalsChanged):
        backend.register_backend()


def test_the_platform_and_the_rollout_are_found_through_verls_registries():
    from verl.plugin.platform.platform_manager import PlatformRegistry
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    import tokendyn.integrations.verl  # noqa: F401  (registers, as the plugin entry point does)
    from tokendyn.integrations.verl.cpu import CPUPlatform
    from tokendyn.integrations.verl.hf_rollout import HFReplica, HFServerAdapter

    assert PlatformRegistry.get("cpu") is CPUPlatform
    assert (
        CPUPlatform().is_platform_available(use_smi_check=True) is False
    )  # chosen by name only, never detected
    assert CPUPlatform().ray_resource_options(1) == {"num_gpus": 1}
    assert get_rollout_replica_class("hf") is HFReplica
    assert get_rollout_class("hf", "async") is HFServerAdapter


def test_the_cpu_platform_turns_on_fp32_and_gloo_in_a_fresh_process():
    code = (
        "import verl; from verl.plugin.platform import get_platform; "
        "from verl.workers.config import FSDPEngineConfig; from verl.workers import engine_workers as e; import os; "
        "print(type(get_platform()).__name__, FSDPEngineConfig(strategy='fsdp2').mixed_precision['param_dtype'], "
        "FSDPEngineConfig(strategy='fsdp2', mixed_precision={'param_dtype': 'bf16'}).mixed_precision['param_dtype'], "
        "getattr(e.initialize_global_process_group_ray, '_tokendyn_cpu', False), os.environ['VERL_ENGINE_DEVICE'])"
    )
    env = {**os.environ, "VERL_PLATFORM": "cpu", "OMP_NUM_THREADS": "1"}
    env.pop("VERL_ENGINE_DEVICE", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-5:] == ["CPUPlatform", "fp32", "bf16", "True", "cuda"]


def test_the_hf_rollout_servers_log_probs_are_the_models_at_the_temperature():
    import asyncio

    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from tokendyn.integrations.verl.hf_rollout import HFRolloutServer
    from tokendyn.policy import default_policy_dir

    path = str(default_policy_dir())
    config = OmegaConf.create({"response_length": 12, "seed": 3})
    threads = torch.get_num_threads()
    try:
        server = HFRolloutServer(config, path)
        prompt = [5, 17, 33, 8, 91]
        params = {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
        out = asyncio.run(server.generate(prompt_ids=prompt, sampling_params=params, request_id="r0"))
    finally:
        torch.set_num_threads(threads)
    assert 1 <= len(out.token_ids) <= 12 and len(out.log_probs) == len(out.token_ids)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / 0.7
    want = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.log_probs), want, rtol=0, atol=2e-5)
    # the weight sync: the server takes a state dict by Hugging Face name
    state = {n: p.detach() * 0.5 for n, p in model.named_parameters()}
    assert server.update_weights(state, global_steps=4) == len(state)
    assert server.parameters_digest()["model.norm.weight"] == pytest.approx(
        float(state["model.norm.weight"].double().sum())
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"probe_save_batches": -1}, "policy_loss.probe_save_batches: must be an integer >= 0"),
        ({"probe_save_batches": 1}, "policy_loss.probe_save_batches: needs policy_loss.probe_dir"),
    ],
)
def test_bad_batch_saving_options_fail_in_one_line(options, message):
    from tokendyn.integrations.verl import TokendynPolicyLossConfig, VerlConfigError

    with pytest.raises(VerlConfigError, match=message) as err:
        TokendynPolicyLossConfig(**options)
    assert "\n" not in str(err.value)


# ---- slow: main_ppo itself -----------------------------------------------------------------------------------------
def run_main_ppo(
    out: Path, ranks: int = 1, wandb: bool = False, steps: int = 2, more: tuple[str, ...] = ()
) -> dict:
    """``examples/verl_main_ppo.sh OUT`` with the README's tokendyn lines (probe_dir under OUT) and the batch of the
    first update saved: `steps` GRPO steps on `ranks` actor ranks. ``wandb``: verl's W&B logger too
    (``trainer.logger=['console','wandb']``), an offline run under OUT/wandb. ``more``: further overrides, last
    (so they win over the script's own)."""
    overrides = with_value(
        readme_overrides(), "actor_rollout_ref.actor.policy_loss.probe_dir", str(out / "probe")
    )
    extra = ["+actor_rollout_ref.actor.policy_loss.probe_save_batches=1", *more]
    if wandb:  # after the script's own trainer.logger, so this one wins
        extra.append("trainer.logger=['console','wandb']")
    env = {
        **os.environ,
        **(offline_env(out / "wandb") if wandb else {}),
        "PYTHON": sys.executable,
        "TOKENDYN": "0",  # the script's own tokendyn lines left out: the README's are passed instead
        "STEPS": str(steps),
        "RANKS": str(ranks),
        "RAY_USAGE_STATS_ENABLED": "0",
        # Ray kills workers once the machine's memory is 95% used, whoever uses it (other tests, other jobs); the
        # run itself takes about 4 GB
        "RAY_memory_monitor_refresh_ms": "0",
    }
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out), *overrides, *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=out,
    )
    wall = time.time() - t0
    (out / "main_ppo.log").write_text(proc.stdout + proc.stderr)
    return {"out": out, "proc": proc, "wall": wall, "log": proc.stdout + proc.stderr}


@pytest.fixture(scope="module")
def main_ppo_run(tmp_path_factory):
    return run_main_ppo(tmp_path_factory.mktemp("main_ppo"), wandb=True)  # W&B on the same run: no second one


def per_bin(records: Path, step: int | None = None) -> pl.DataFrame:
    """The binstats of a run (or of one of its updates) merged over ranks and micro-batches, per update, stage,
    probed place, bin and quantity."""
    frame = pl.read_parquet(sorted(records.glob("binstats-*.parquet")))
    if step is not None:
        frame = frame.filter(pl.col("step") == step)
    keys = ("step", "stage", "point", "bin", "quantity") if step is None else ("point", "bin", "quantity")
    return (
        frame.group_by(*keys)
        .agg(pl.col("count").sum(), pl.col("sum").sum(), pl.col("min").min(), pl.col("max").max())
        .sort(*keys)
    )


def assert_same_bins(run: pl.DataFrame, other: pl.DataFrame, label: str) -> None:
    """Equal counts per bin (exactly); sums, minima and maxima within `RECORDS_REL_DIFF` of the largest value of
    their quantity (empty bins: NaN minima and maxima on both sides)."""
    keys = [c for c in run.columns if c not in ("count", "sum", "min", "max")]
    assert run.select(*keys, "count").equals(other.select(*keys, "count"))
    assert run["count"].sum() > 0
    for quantity in run["quantity"].unique().sort().to_list():
        mine, theirs = (
            run.filter(pl.col("quantity") == quantity),
            other.filter(pl.col("quantity") == quantity),
        )
        for column in ("sum", "min", "max"):
            got, want = mine[column].to_numpy(), theirs[column].to_numpy()
            assert (np.isnan(got) == np.isnan(want)).all(), (quantity, column)
            finite = ~np.isnan(want)
            err = np.abs(got - want)[finite].max() / max(np.abs(want[finite]).max(), 1e-30)
            print(f"{label}, {quantity} {column}: max rel diff {err:.1e}")
            assert err < RECORDS_REL_DIFF, (quantity, column, err)


@pytest.mark.slow
def test_the_examples_tokendyn_lines_are_the_readmes():
    text = SCRIPT.read_text()
    lines = re.findall(r"^\s+\"?(\+?actor_rollout_ref\.actor\.policy_loss\.[^\s\"]+)", text, flags=re.M)
    readme = readme_overrides()
    key = "actor_rollout_ref.actor.policy_loss.probe_dir"
    assert with_value(lines, key, "X") == with_value(readme, key, "X")


@pytest.mark.slow
def test_main_ppo_runs_two_grpo_steps_with_the_readmes_overrides(main_ppo_run):
    proc = main_ppo_run["proc"]
    assert proc.returncode == 0, main_ppo_run["log"][-6000:]
    steps = step_metrics(main_ppo_run["log"])
    assert sorted(steps) == [1, 2]
    for metrics in steps.values():
        # the rollout server's log-probs are the actor's (both float32)
        assert 0 <= metrics["training/rollout_probs_diff_max"] < ROLLOUT_PROBS_DIFF_MAX
        for stage in ("low", "high"):  # Lopti's two updates, each with its probe scalars
            assert metrics[f"actor/tokendyn/{stage}/bound_violations"] == 0
            shares = [metrics[f"actor/tokendyn/{stage}/token_share/bin{b}"] for b in range(4)]
            assert sum(shares) == pytest.approx(1.0)
    print(f"main_ppo wall time {main_ppo_run['wall']:.0f} s")


@pytest.mark.slow
def test_main_ppo_writes_the_records_of_every_kind_with_no_bound_violation(main_ppo_run):
    assert main_ppo_run["proc"].returncode == 0
    records = main_ppo_run["out"] / "probe" / "records"
    kinds = {p.name.split("-", 1)[0] for p in records.glob("*.parquet")}
    assert RECORD_KINDS <= kinds, kinds
    checks = pl.read_parquet(sorted(records.glob("checks-*.parquet")))
    stages = checks.group_by("step").agg(pl.col("stage").first()).sort("step")["stage"].to_list()
    assert stages == ["low", "high", "low", "high"]  # two RL steps, each Lopti's two updates
    for column in ("logits_violations", "identity_violations", "head_violations"):
        assert checks[column].sum() == 0, column
    bound = pl.read_parquet(sorted(records.glob("bound-*.parquet")))
    assert bound["nonfinite"].sum() == 0 and bound["unreached"].sum() == 0


@pytest.mark.slow
def test_main_ppo_logs_the_probe_numbers_to_wandb(main_ppo_run):
    """verl's W&B logger on the same run (``trainer.logger=['console','wandb']``, offline): the run's history, read
    back with W&B's own reader, holds at each training step the probe's numbers of both Lopti updates
    (``actor/tokendyn/{low|high}/...``), as verl's console line shows them and as the records of those updates
    give them: token and gradient-energy shares per bin at the final norm, bound violations, the identity's
    largest error."""
    assert main_ppo_run["proc"].returncode == 0, main_ppo_run["log"][-6000:]
    out, prefix = main_ppo_run["out"], "actor/tokendyn/"
    records = log_records(run_file(out / "wandb"), offline_env(out / "wandb"))
    assert exit_code(records) == 0  # verl's TaskRunner finished the run
    rows = history(records)
    logged = {int(r["_step"]): r for r in rows if any(k.startswith(prefix) for k in r)}
    assert sorted(logged) == [1, 2]
    assert "training/rollout_probs_diff_max" in logged[1]  # verl's own metrics are there too
    console = step_metrics(main_ppo_run["log"])
    for step, row in logged.items():  # every tokendyn number of the console line, and no other
        theirs = {k: v for k, v in console[step].items() if k.startswith(prefix)}
        assert {k for k in row if k.startswith(prefix)} == set(theirs)
        for key, value in theirs.items():
            assert row[key] == pytest.approx(value, rel=1e-6), key
    records = out / "probe" / "records"
    bins = pl.read_parquet(sorted(records.glob("binstats-*.parquet")))
    assert "final_norm.out" in set(bins["point"])  # the deepest point, whose numbers go live
    norms = (pl.col("quantity") == "norm") & (pl.col("point") == "final_norm.out") & (pl.col("bin") >= 0)
    final = (
        bins.filter(norms).group_by("step", "stage", "bin").agg(pl.col("count").sum(), pl.col("sumsq").sum())
    )
    checks = pl.read_parquet(sorted(records.glob("checks-*.parquet")))
    updates = final.select("step", "stage").unique().sort("step").rows()
    assert updates == [(0, "low"), (1, "high"), (2, "low"), (3, "high")]
    for update, stage in updates:
        row = logged[update // 2 + 1]  # Lopti's two updates per training step
        key = f"{prefix}{stage}/"
        frame = final.filter(pl.col("step") == update).sort("bin")
        assert frame["bin"].to_list() == [0, 1, 2, 3]
        n, energy = frame["count"].sum(), frame["sumsq"].sum()
        assert n > 0 and energy > 0
        for b, count, sumsq in frame.select("bin", "count", "sumsq").rows():
            assert row[f"{key}token_share/bin{b}"] == pytest.approx(count / n, rel=1e-12, abs=0)
            assert row[f"{key}grad_sq_share/bin{b}"] == pytest.approx(sumsq / energy, rel=1e-9, abs=1e-15)
        c = checks.filter(pl.col("step") == update)
        violations = int(c["logits_violations"].sum() + c["head_violations"].sum())
        assert row[f"{key}bound_violations"] == violations == 0
        assert row[f"{key}identity_rel_err_worst"] == pytest.approx(
            float(c["identity_max_rel_err"].max()), rel=1e-12
        )


@pytest.mark.slow
def test_the_first_updates_records_equal_tokendyn_probe_offline_on_the_saved_batch(main_ppo_run, tmp_path):
    """The batch of the first update, saved by the run (verl's advantages and pi_old), replayed by `tokendyn probe`
    on the same weights (the first update starts from the model itself): with the advantages of Lopti's first
    stage written out here (the official formula: A (alpha pi_old + 1 - alpha), kept where pi_old < eta), the
    per-bin statistics of every probed place equal the run's records of that stage."""
    assert main_ppo_run["proc"].returncode == 0
    out = main_ppo_run["out"]
    written = {
        o.lstrip("+").split("=", 1)[0].rsplit(".", 1)[1]: o.split("=", 1)[1] for o in readme_overrides()
    }
    alpha, eta = float(written["reweight_alpha"]), float(written["lopti_eta"])
    batch = pl.read_parquet(out / "probe" / "batches" / "update-0000-rank0.parquet")
    rows = []
    for row in batch.iter_rows(named=True):
        pi_old = torch.tensor(row["old_logp"], dtype=torch.float64).exp()
        adv = torch.tensor(row["advantage"], dtype=torch.float64)
        kept = (adv * (alpha * pi_old + 1 - alpha)) * (pi_old < eta)
        rows.append({**row, "advantage": kept.tolist()})
    assert any(any(a != 0 for a in r["advantage"]) for r in rows), "no nonzero advantage in the first batch"
    rollouts = tmp_path / "stage_low.parquet"
    pl.DataFrame(rows).write_parquet(rollouts)
    from tokendyn.policy import default_policy_dir

    offline = tmp_path / "offline"
    cmd = [sys.executable, "-m", "tokendyn", "probe", "--model", str(default_policy_dir()), "--rollouts",
           str(rollouts), "--out", str(offline), "--bins", "intervals:4", "--sample_sequences", "0",
           "--threads", "1"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    run = per_bin(out / "probe" / "records", 0)
    off = per_bin(offline / "records")
    assert off["step"].n_unique() == 1  # one offline update
    assert_same_bins(run, off.drop("step", "stage"), "in-run vs offline")


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("TOKENDYN_VERL_TWO_RANKS") != "1",
    reason="a second main_ppo run (~90 s of both cores): TOKENDYN_VERL_TWO_RANKS=1 runs it",
)
def test_two_actor_ranks_under_ray_record_what_one_rank_records(main_ppo_run, tmp_path):
    """The same run on two actor ranks (FSDP2 over gloo, one rollout server for both: tensor_model_parallel_size
    = ranks): the same sequences sampled, and the records of every update, merged over the ranks, equal one
    rank's."""
    assert main_ppo_run["proc"].returncode == 0
    two = run_main_ppo(tmp_path / "two_ranks", ranks=2)
    assert two["proc"].returncode == 0, two["log"][-6000:]
    batches = {}
    for name, run in (("one", main_ppo_run), ("two", two)):
        frame = pl.read_parquet(sorted((run["out"] / "probe" / "batches").glob("update-0000-rank*.parquet")))
        batches[name] = sorted(
            zip(frame["prompt_ids"].to_list(), frame["completion_ids"].to_list(), strict=True)
        )
    assert len(batches["two"]) == 8 and batches["one"] == batches["two"]
    assert list((two["out"] / "probe" / "records").glob("binstats-rank001-*.parquet"))
    one_bins = per_bin(main_ppo_run["out"] / "probe" / "records")
    two_bins = per_bin(two["out"] / "probe" / "records")
    assert one_bins["step"].unique().sort().to_list() == [0, 1, 2, 3]
    assert_same_bins(two_bins, one_bins, "2 ranks vs 1")
    print(f"main_ppo wall time, two ranks: {two['wall']:.0f} s")
