"""tokendyn inside verl 0.9's own FSDP2 actor engine on CPU (`_verl_engine`: no Ray, gloo), against references that
do not go through verl: a plain Hugging Face model with the probe on a hand-written PPO loss (one row per sequence,
its own padding), a plain-torch SGD loop for Lopti's two stages, and verl itself with the probe off.

Run by pytest, the data-parallel test launches this file under `torchrun --nproc_per_node 2`; as a script it is the
worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import polars as pl
import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import _verl_engine as ve  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from tokendyn.analysis import analyze_run  # noqa: E402
from tokendyn.hooks import instrument  # noqa: E402
from tokendyn.integrations import verl as glue  # noqa: E402
from tokendyn.integrations.verl.lopti import lopti_update  # noqa: E402
from tokendyn.integrations.verl.loss import lopti_ppo_loss  # noqa: E402
from tokendyn.integrations.verl.probe import METRIC_PREFIX, probe_engine  # noqa: E402
from tokendyn.remedies import lopti_masks, reweight_advantages  # noqa: E402

glue.register()
T = 0.7
CLIP = 0.2
PROMPTS = [[2, 5, 6], [2, 7], [2, 9, 10, 11], [2, 3], [2, 4, 8], [2, 30, 31]]
LENGTHS = [4, 2, 3, 5, 3, 4]
RESPONSES: list[
    list[int]
] = []  # sampled from the model at T by `sharp_model` (stored beside it for the workers)
PROBE = dict(bins="intervals:4", check_tokens=None, direct_tokens=0, sample_tokens=4096)
# the per-bin columns compared at rtol 1e-4: not the minima, which sit on the near-certain tokens, where float32 itself
# is the floor (a pi = 0.9999 token's norm, 5e-5 of the largest 0.3, differs by 0.6 % between two correct float32 paths)
BIN_COLS = [
    "tokens",
    "share",
    "norm_mean",
    "norm_std",
    "norm_max",
    "norm_per_w_mean",
    "ratio_mean",
    "ratio_max",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return sharp_model(tmp_path_factory.mktemp("verl") / "model")


def sharp_model(path: Path) -> Path:
    """A tiny Qwen2 whose LM head is scaled up, and responses sampled from it at T (saved as responses.json), so
    that pi_old spreads over every bin."""
    ve.save_tiny_qwen2(path, seed=0)
    model = ve.load_hf_model(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    model.save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    responses = []
    with torch.no_grad():
        for prompt, n in zip(PROMPTS, LENGTHS, strict=True):
            ids = list(prompt)
            for _ in range(n):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1] / T
                ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g)))
            responses.append(ids[len(prompt) :])
    (path / "responses.json").write_text(json.dumps(responses))
    return use_responses(path)


def use_responses(path: Path) -> Path:
    RESPONSES[:] = json.loads((Path(path) / "responses.json").read_text())
    return path


def rollout(model_dir: Path, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """pi_old (the model's own log-probs at T, perturbed so that the ratio clips) and one advantage per
    response, [B, longest response]; computed on the plain HF model so that every engine sees the same batch."""
    model = ve.load_hf_model(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        logp = reference_logps(model, range(len(PROMPTS)))[0]
    width = max(map(len, RESPONSES))
    old = (logp + 0.3 * torch.randn(logp.shape, generator=g)).clamp(max=-1e-3)
    adv = torch.randn(len(PROMPTS), 1, generator=g).expand(-1, width).contiguous()
    return old, adv


def reference_logps(model, rows, temperature: float = T):
    """log pi(o_t) [B, W] at `temperature` for the sequences `rows`, right-padded with an attention mask (the HF
    model's own padding, not verl's layouts), and the tensors the probe needs."""
    rows = list(rows)
    seqs = [PROMPTS[i] + RESPONSES[i] for i in rows]
    n, width = max(map(len, seqs)), max(len(RESPONSES[i]) for i in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    attn = torch.zeros(len(rows), n, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)], attn[b, : len(s)] = torch.tensor(s), 1
    logits = model(input_ids=ids, attention_mask=attn).logits.float() / temperature
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    completion = torch.zeros(len(rows), width, dtype=torch.long)
    for b, i in enumerate(rows):
        p, r = len(PROMPTS[i]), len(RESPONSES[i])
        mask[b, :r] = True
        positions[b] = p + torch.arange(width).clamp(max=r - 1)
        completion[b, :r] = torch.tensor(RESPONSES[i])
    z = logits.gather(1, (positions - 1)[..., None].expand(-1, -1, logits.shape[-1]))
    logp = torch.log_softmax(z, -1).gather(-1, completion[..., None]).squeeze(-1)
    return logp * mask, mask, positions, completion


def ppo_token_mean(logp, old, adv, mask, n_tokens: int, clip_c: float = 3.0):
    """verl's vanilla PPO loss written out (clip 0.2, dual clip c for A < 0), summed over tokens / n_tokens."""
    ratio = torch.exp(logp - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP))
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * clip_c), pg)
    return (pg * mask).sum() / n_tokens


def verl_batch(rows, old, adv):
    return ve.make_batch(
        [PROMPTS[i] for i in rows], [RESPONSES[i] for i in rows], old_log_probs=old[rows], advantages=adv[rows],
        temperature=T, global_batch_size=len(PROMPTS),
    )  # fmt: skip


def reference_run(model_dir: Path, run_dir: Path, old, adv):
    """The probe on the plain HF model, the whole batch in one step of the hand-written loss: per-token norms."""
    model = ve.load_hf_model(model_dir)
    rows = range(len(PROMPTS))
    with instrument(model, run_dir, temperature=T, **PROBE) as probe:
        logp, mask, positions, completion = reference_logps(model, rows)
        probe.begin_step(0, completion_mask=mask, advantages=adv, old_logp=old, completion_ids=completion,
                         logps=logp, token_positions=positions, temperature=T)  # fmt: skip
        ppo_token_mean(logp, old, adv, mask, int(mask.sum())).backward()
        return probe.end_step()


@pytest.mark.parametrize(
    "rmpad, ckpt",
    [(True, False), (False, False), (True, True)],
    ids=["remove_padding", "padded", "checkpointing"],
)
def test_the_probe_inside_verls_engine_records_what_a_plain_autograd_reference_records(
    model_dir, tmp_path, rmpad, ckpt
):
    """verl's engine, micro-batches of 2 (packed into one row with remove-padding), with and without verl's
    gradient checkpointing, the probe through `probe_engine`: every token's norm and w equal the reference's, the
    run directory's per-bin table equals the reference run's, the exact checks pass, and the per-bin scalars land in
    verl's metrics."""
    old, adv = rollout(model_dir)
    ref = reference_run(model_dir, tmp_path / "ref", old, adv)
    engine = ve.build_engine(
        model_dir, use_remove_padding=rmpad, micro_batch_size=2, lr=0.1, gradient_checkpointing=ckpt
    )
    loss_fn = partial(ppo_loss, config=ve.actor_config(micro_batch_size=2))
    data = verl_batch(range(len(PROMPTS)), old, adv)
    with probe_engine(engine, tmp_path / "verl", **PROBE) as probe:
        metrics = ve.train_step(engine, data, loss_fn)
    assert len(probe.results) == 3  # three micro-batches of two
    norms = torch.cat([r.norms for r in probe.results], dim=1)
    w = torch.cat([r.w for r in probe.results], dim=0)
    mask = torch.arange(norms.shape[2])[None] < torch.tensor(LENGTHS)[:, None]
    floor = 1e-5 * ref.norms[:, mask].abs().amax(
        1, keepdim=True
    )  # float32's floor, relative to each point's largest
    assert ((norms[:, mask] - ref.norms[:, mask]).abs() <= 1e-4 * ref.norms[:, mask].abs() + floor).all()
    torch.testing.assert_close(w[mask], ref.w[mask], rtol=1e-4, atol=1e-7)
    a, b = analyze_run(tmp_path / "ref", write=False), analyze_run(tmp_path / "verl", write=False)
    assert sorted(a["bins"]["tokens"].to_list()) == sorted(b["bins"]["tokens"].to_list())
    assert a["bins"].filter(pl.col("bin") >= 0)["tokens"].min() > 0  # every bin has tokens
    from test_records import assert_frames_close

    assert_frames_close(a["bins"], b["bins"], ["stage", "point", "bin"], BIN_COLS, rtol=1e-4)
    checks = b["checks"]
    assert checks["logits_violations"].to_list() == [0] and checks["head_violations"].to_list() == [0]
    assert checks["micro_batches"].to_list() == [3]
    run = json.loads((tmp_path / "verl" / "run.json").read_text())
    assert run["source"] == "verl" and run["remove_padding"] is rmpad and run["config"]["temperature"] == T
    shares = [metrics[f"{METRIC_PREFIX}token_share/bin{k}"] for k in range(4)]
    counts = (
        a["bins"].filter((pl.col("point") == "final_norm.out") & (pl.col("bin") >= 0)).sort("bin")["tokens"]
    )
    assert shares == pytest.approx((counts / counts.sum()).to_list(), abs=1e-12)
    energy = torch.stack([(ref.norms[-1][mask & (ref.bins == k)] ** 2).sum() for k in range(4)]).double()
    grad_sq = [metrics[f"{METRIC_PREFIX}grad_sq_share/bin{k}"] for k in range(4)]
    assert grad_sq == pytest.approx(
        (energy / energy.sum()).tolist(), rel=1e-4
    )  # the final norm's ||delta||^2
    assert metrics[f"{METRIC_PREFIX}bound_violations"] == 0
    assert 0 <= metrics[f"{METRIC_PREFIX}identity_rel_err_worst"] < 1e-4
    assert not any("max" in k or "min" in k for k in metrics if k.startswith(METRIC_PREFIX))


def _grads(engine) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [
        (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for p in engine.module.parameters()
    ]


@pytest.mark.parametrize("rmpad", [True, False], ids=["remove_padding", "padded"])
def test_verls_loss_and_gradients_are_bitwise_the_same_with_the_probe_on_and_off(model_dir, tmp_path, rmpad):
    """The probe rebuilds the loss's log-probs from a copy of them: the loss and every gradient stay bitwise what
    verl computes without it (SGD at lr 0 keeps the weights, so both steps see the same model)."""
    old, adv = rollout(model_dir)
    engine = ve.build_engine(model_dir, use_remove_padding=rmpad, micro_batch_size=2, lr=0.0)
    cfg = ve.actor_config(micro_batch_size=2, entropy_coeff=0.01)  # the entropy bonus is rebuilt too
    loss_fn = partial(ppo_loss, config=cfg)
    rows = range(len(PROMPTS))
    plain = ve.train_step(engine, verl_batch(rows, old, adv), loss_fn, zero_grad_on_exit=False)
    g_plain = _grads(engine)
    with probe_engine(engine, tmp_path / "run", **PROBE) as probe:
        probed = ve.train_step(engine, verl_batch(rows, old, adv), loss_fn, zero_grad_on_exit=False)
    g_probed = _grads(engine)
    assert "actor/entropy_loss" in plain  # the engine computed the entropies: the bonus is in the loss
    assert probed["loss"] == plain["loss"] and probed["grad_norm"] == plain["grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(g_plain, g_probed, strict=True))
    assert len(probe.results) == 3 and probe.results[0].records["checks"]["logits_violations"] == [0]


def plain_lopti(model_dir: Path, old, adv, *, eta: float, alpha: float, lr: float):
    """Lopti written out from the official semantics on the plain HF model: Reweight, then two SGD steps on the
    hand-written loss, first with A * [pi_old < eta], then from the updated weights with A * [pi_old >= eta]; the
    denominator counts every token both times, pi_old is the rollout's both times."""
    model = ve.load_hf_model(model_dir)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    rows = range(len(PROMPTS))
    _, mask, _, _ = reference_logps(model, rows)
    adv = (alpha * old.exp() + 1 - alpha) * adv  # the paper's Eq. 4 on pi_old
    for keep in (old.exp() < eta, old.exp() >= eta):
        logp = reference_logps(model, rows)[0]
        loss = ppo_token_mean(logp, old, adv * (keep & mask), mask, int(mask.sum()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("rmpad", [True, False], ids=["remove_padding", "padded"])
def test_lopti_through_verls_engine_equals_a_plain_torch_loop(model_dir, tmp_path, rmpad):
    """Reweight + Lopti's two stages, each a full `train_batch` of the tokendyn loss on top of verl's vanilla loss,
    with the probe recording each stage under its name: the weights after both equal the plain loop's."""
    old, adv = rollout(model_dir)
    lr, eta, alpha = 0.5, 0.5, 0.3
    engine = ve.build_engine(model_dir, use_remove_padding=rmpad, micro_batch_size=2, lr=lr)
    cfg = ve.actor_config(
        micro_batch_size=2, policy_loss=glue.TokendynPolicyLossConfig(reweight_alpha=alpha, lopti_eta=eta)
    )
    loss_fn = partial(ppo_loss, config=cfg)
    data = verl_batch(range(len(PROMPTS)), old, adv)
    with probe_engine(engine, tmp_path / "run", **PROBE) as probe:
        out = lopti_update(lambda d: ve.train_step(engine, d, loss_fn), data, cfg, probe=probe)
    assert cfg.policy_loss.lopti_stage == "all"
    assert out["low"][f"{METRIC_PREFIX}stage_token_share"] != out["high"][f"{METRIC_PREFIX}stage_token_share"]
    want = plain_lopti(model_dir, old, adv, eta=eta, alpha=alpha, lr=lr)
    got = ve.full_parameters(engine)
    for name, p in want.items():
        rel = ((got[name] - p).norm() / p.norm()).item()
        assert rel < 1e-5, (name, rel)
    start = dict(ve.load_hf_model(model_dir).named_parameters())
    moved = max(((got[n] - start[n]).norm() / p.norm()).item() for n, p in want.items())
    assert moved > 1e-3  # the update is not a no-op
    checks = analyze_run(tmp_path / "run", write=False)["checks"].sort("stage")
    assert checks["stage"].to_list() == ["high", "low"] and checks["logits_violations"].to_list() == [0, 0]
    tokens = pl.read_parquet(sorted((tmp_path / "run" / "records").glob("tokens-*.parquet")))
    assert tokens.filter(pl.col("stage") == "low")["step"].unique().to_list() == [0]
    assert tokens.filter(pl.col("stage") == "high")["step"].unique().to_list() == [1]


def test_reweight_and_lopti_advantages_through_verl_equal_the_trl_paths_functions():
    """The advantages verl's tokendyn loss optimises, per stage, against `tokendyn.remedies` (what the TRL
    trainer applies) on the same tensors: identical."""
    g = torch.Generator().manual_seed(1)
    old = torch.log(torch.rand(5, 7, generator=g).clamp(min=1e-4))
    adv = torch.randn(5, 1, generator=g).expand(5, 7)
    mask = torch.rand(5, 7, generator=g) > 0.2
    w = reweight_advantages(adv, old, 0.3)
    low, high = lopti_masks(old, mask, eta=0.5)
    assert torch.equal(glue.stage_advantages(adv, old, mask, 0.3, 0.5, "all"), w)
    assert torch.equal(glue.stage_advantages(adv, old, mask, 0.3, 0.5, "low"), w * low)
    assert torch.equal(glue.stage_advantages(adv, old, mask, 0.3, 0.5, "high"), w * high)


def test_bad_engine_and_lopti_options_fail_with_one_line(model_dir, tmp_path):
    engine = ve.build_engine(model_dir, use_remove_padding=True, micro_batch_size=2, lr=0.1)
    force = (
        object.__setattr__
    )  # verl's configs are frozen dataclasses: set the option as a config would have it
    force(engine.model_config, "use_fused_kernels", True)
    with pytest.raises(
        glue.VerlConfigError, match=r"^actor_rollout_ref.model.use_fused_kernels: .*got True$"
    ):
        probe_engine(engine, tmp_path / "x").__enter__()
    force(engine.model_config, "use_fused_kernels", False)
    force(engine.engine_config, "ulysses_sequence_parallel_size", 2)
    with pytest.raises(glue.VerlConfigError, match=r"ulysses_sequence_parallel_size: .*got 2$"):
        probe_engine(engine, tmp_path / "x").__enter__()
    force(engine.engine_config, "ulysses_sequence_parallel_size", 1)
    plain = ve.actor_config(micro_batch_size=2)
    with pytest.raises(glue.VerlConfigError, match=r"loss_mode: Lopti runs under 'tokendyn', got 'vanilla'"):
        lopti_update(lambda d: d, {}, plain)
    lopti = glue.TokendynPolicyLossConfig(lopti_eta=0.5)
    for kw, field in ((dict(use_kl_loss=True), "use_kl_loss"), (dict(entropy_coeff=0.01), "entropy_coeff")):
        cfg = ve.actor_config(micro_batch_size=2, policy_loss=lopti, **kw)
        with pytest.raises(glue.VerlConfigError, match=rf"^actor.{field}: "):
            lopti_update(lambda d: d, {}, cfg)
    cfg = ve.actor_config(micro_batch_size=2, policy_loss=lopti)
    with pytest.raises(glue.VerlConfigError, match=r"^lopti order: must be one of low_first, high_first"):
        lopti_update(lambda d: d, {}, cfg, order="random")
    no_eta = ve.actor_config(micro_batch_size=2, policy_loss=glue.TokendynPolicyLossConfig())
    with pytest.raises(glue.VerlConfigError, match=r"lopti_eta: Lopti needs a threshold"):
        lopti_update(lambda d: d, {}, no_eta)


# ---- two processes -----------------------------------------------------------------------------------------
def dp_worker(model_dir: str, out_dir: str) -> None:
    """One rank of `torchrun --nproc_per_node 2`: half the batch per rank, the probe on, one train_batch."""
    use_responses(Path(model_dir))
    rank, world = ve.setup_distributed()
    torch.set_num_threads(1)
    old, adv = rollout(Path(model_dir))
    engine = ve.build_engine(model_dir, use_remove_padding=True, micro_batch_size=3, lr=0.1)
    loss_fn = partial(ppo_loss, config=ve.actor_config(micro_batch_size=3))
    half = len(PROMPTS) // world
    rows = list(range(rank * half, (rank + 1) * half))
    options = {**PROBE, "sample_sequences": 3, "lr": 0.5, "analyses": ["shares"]}
    with probe_engine(engine, out_dir, analyses_every=1, **options) as probe:
        metrics = ve.train_step(engine, verl_batch(rows, old, adv), loss_fn)
    assert len(probe.results) == 1  # one packed micro-batch of three per rank
    if rank == 0:
        keep = {k: v for k, v in metrics.items() if k.startswith(METRIC_PREFIX)}
        (Path(out_dir) / "metrics.json").write_text(json.dumps(keep))


@pytest.mark.slow_tier  # the slow tier: `make test-slow` (several processes)
def test_two_ranks_under_torchrun_equal_one_process_on_the_global_batch(model_dir, tmp_path):
    """verl's FSDP2 engine on 2 gloo ranks, 3 sequences each packed into one row: the merged records equal the reference on all 6,
    and verl's metrics (all-reduced) equal one process's token shares."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__]
    out = tmp_path / "two"
    proc = subprocess.run(
        [*cmd, str(model_dir), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    teardown_abort = "terminate called without an active exception" in proc.stderr
    done = all((out / f".done-rank{r}").is_file() for r in range(2))
    assert proc.returncode == 0 or (teardown_abort and done), proc.stdout[-3000:] + proc.stderr[-3000:]
    old, adv = rollout(model_dir)
    reference_run(model_dir, tmp_path / "ref", old, adv)
    a, b = analyze_run(tmp_path / "ref", write=False), analyze_run(out, write=False)
    from test_records import assert_frames_close

    assert_frames_close(a["bins"], b["bins"], ["stage", "point", "bin"], BIN_COLS, rtol=1e-4)
    assert b["checks"]["logits_violations"].to_list() == [0]
    tokens = pl.read_parquet(sorted((out / "records").glob("tokens-*.parquet")))
    assert sorted(tokens["rank"].unique().to_list()) == [0, 1]
    metrics = json.loads((out / "metrics.json").read_text())
    counts = (
        a["bins"].filter((pl.col("point") == "final_norm.out") & (pl.col("bin") >= 0)).sort("bin")["tokens"]
    )
    got = [metrics[f"{METRIC_PREFIX}token_share/bin{k}"] for k in range(4)]
    assert got == pytest.approx((counts / counts.sum()).to_list(), abs=1e-12)


if __name__ == "__main__":
    dp_worker(sys.argv[1], sys.argv[2])
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    (out / f".done-rank{os.environ.get('RANK', '0')}").write_text("ok")


# ---- verl's actor worker, configured as a user's run would be -----------------------------------------------------
def _worker_config(run_dir: Path, **policy_loss):
    options = {"bins": "intervals:4", "check_tokens": None, "direct_tokens": 0, "sample_tokens": 4096}
    loss = glue.TokendynPolicyLossConfig(probe_dir=str(run_dir), probe_options=options, **policy_loss)
    return ve.actor_config(micro_batch_size=2, policy_loss=loss)


@pytest.mark.parametrize("rmpad", [True, False], ids=["remove_padding", "padded"])
def test_verls_actor_worker_runs_reweight_lopti_and_the_probe_from_its_config_alone(
    model_dir, tmp_path, rmpad
):
    """`TrainingWorker.train_mini_batch` (wrapped by the plugin's `register`), as `update_actor` calls it, with
    probe_dir, reweight_alpha and lopti_eta in the policy-loss config and nothing else: the weights equal the plain
    Lopti loop's, each stage's records and scalars are there, and a second run without Lopti records stage train."""
    old, adv = rollout(model_dir)
    lr, eta, alpha = 0.5, 0.5, 0.3
    cfg = _worker_config(tmp_path / "run", reweight_alpha=alpha, lopti_eta=eta)
    worker = ve.build_worker(
        model_dir, partial(ppo_loss, config=cfg), use_remove_padding=rmpad, micro_batch_size=2, lr=lr
    )
    metrics = ve.update_actor(worker, verl_batch(range(len(PROMPTS)), old, adv))
    want = plain_lopti(model_dir, old, adv, eta=eta, alpha=alpha, lr=lr)
    got = ve.full_parameters(worker.engine)
    assert max(((got[n] - p).norm() / p.norm()).item() for n, p in want.items()) < 1e-5
    for stage in ("low", "high"):
        shares = [metrics[f"{METRIC_PREFIX}{stage}/token_share/bin{k}"][0] for k in range(4)]
        assert sum(shares) == pytest.approx(1.0) and metrics[f"{METRIC_PREFIX}{stage}/bound_violations"] == [
            0.0
        ]
    assert len(metrics["actor/pg_loss"]) == 2  # verl's own keys: one value per stage
    checks = analyze_run(tmp_path / "run", write=False)["checks"].sort("stage")
    assert checks["stage"].to_list() == ["high", "low"] and checks["logits_violations"].to_list() == [0, 0]

    plain_cfg = _worker_config(tmp_path / "plain")
    worker = ve.build_worker(
        model_dir, partial(ppo_loss, config=plain_cfg), use_remove_padding=rmpad, micro_batch_size=2, lr=lr
    )
    metrics = ve.update_actor(worker, verl_batch(range(len(PROMPTS)), old, adv))
    assert f"{METRIC_PREFIX}token_share/bin0" in metrics
    assert analyze_run(tmp_path / "plain", write=False)["checks"]["stage"].to_list() == ["train"]


def reference_probe_batch(rows, old, adv):
    """The sequences ``rows`` as a `ProbeBatch` built here from the token lists (prompts left-padded, responses
    right-padded), independent of the verl glue's conversion."""
    from tokendyn.probe.tokenloss import ProbeBatch

    rows = list(rows)
    width_p, width_r = max(len(PROMPTS[i]) for i in rows), max(len(RESPONSES[i]) for i in rows)
    ids = torch.zeros(len(rows), width_p + width_r, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros(len(rows), width_r, dtype=torch.bool)
    for b, i in enumerate(rows):
        p, r = PROMPTS[i], RESPONSES[i]
        ids[b, width_p - len(p) : width_p], ids[b, width_p : width_p + len(r)] = (
            torch.tensor(p),
            torch.tensor(r),
        )
        attn[b, width_p - len(p) : width_p + len(r)] = 1
        mask[b, : len(r)] = True
    return ProbeBatch(
        ids, attn, mask, adv[rows, :width_r].double(), old[rows, :width_r].double(), temperature=T
    )


def test_the_analyses_with_verls_own_loss_equal_tokendyns_objective_on_the_plain_model(model_dir, tmp_path):
    """The rebalancing analyses inside verl's engine (FSDP2, remove-padding), on the first 4 sequences, with verl's
    registered vanilla loss as the objective (`VerlObjective`'s first-order terms), against the same analyses on
    the plain HF model with tokendyn's own token-mean PPO objective (clip 0.2, no dual clip binding here) on a
    ProbeBatch built here: update shares per bin, per-token shares and the counterfactual probability change."""
    from tokendyn.effects.rebalance import analyze_batch
    from tokendyn.integrations.verl.objective import VerlObjective
    from tokendyn.probe.tokenloss import Objective

    old, adv = rollout(model_dir)
    engine = ve.build_engine(model_dir, use_remove_padding=True, micro_batch_size=2, lr=0.1)
    loss_fn = partial(ppo_loss, config=ve.actor_config(micro_batch_size=2))
    options = {**PROBE, "sample_sequences": 4, "lr": 0.5}
    with probe_engine(engine, tmp_path / "verl", analyses_every=1, **options) as probe:
        ve.train_step(engine, verl_batch(range(len(PROMPTS)), old, adv), loss_fn)
    got = probe.last_analysis

    batch = reference_probe_batch(range(4), old, adv)
    from tokendyn.config import ProbeConfig
    from tokendyn.hooks.options import rebalance_options

    # the default measured precision on both: verl's FSDP2 shards check against sharded float64 steps, as one
    # process checks against its float64 steps, and this first analysed step reports those
    cfg = ProbeConfig(**options)
    want = analyze_batch(
        ve.load_hf_model(model_dir), batch, step=0, edges=[0, 0.25, 0.5, 0.75, 1.0],
        options=rebalance_options(cfg, 0), objective=Objective(eps_low=CLIP, eps_high=CLIP, loss_type="bnpo"),
    )  # fmt: skip
    # FSDP2 leaves out the per-token shares (their JVP substitutes the parameters FSDP2 gathers); see below
    assert set(want) - set(got) == {"token_shares"} and {"shares", "prob_change", "influence"} <= set(got)
    from test_records import assert_frames_close

    for kind in ("shares", "prob_change", "influence"):
        a, b = (f.with_columns(pl.selectors.float().fill_nan(None)) for f in (want[kind], got[kind]))
        skip = {"lr", "jvp_share"}  # jvp_share: the per-token JVP, absent under FSDP2 (above)
        floats = [c for c, t in a.schema.items() if t in (pl.Float64, pl.Float32) and c not in skip]
        keys = [c for c, t in a.schema.items() if c not in floats and c not in skip and t != pl.List]
        # the probability changes are differences of float32 probabilities: their floor is ~1e-7 absolute
        assert_frames_close(a, b, keys, floats, rtol=1e-4 if kind == "shares" else 2e-3)
        j = a.sort(keys).select(floats).to_numpy(), b.sort(keys).select(floats).to_numpy()
        rel = abs(j[0] - j[1]) / abs(j[0]).clip(min=1e-12)
        print(json.dumps({f"{kind}_max_rel": float(rel[rel == rel].max())}))
    # the per-token shares through verl's loss, on the plain model: VerlObjective's JVP against tokendyn's objective
    mine = analyze_batch(
        ve.load_hf_model(model_dir), batch, step=0, edges=[0, 0.25, 0.5, 0.75, 1.0],
        options=rebalance_options(cfg, 0), objective=VerlObjective(ve.actor_config(micro_batch_size=2)),
    )  # fmt: skip
    a, b = want["token_shares"], mine["token_shares"]
    keys = [c for c, t in a.schema.items() if t in (pl.Int32, pl.Int64, pl.Utf8)]
    a, b = a.sort(keys), b.sort(keys)
    assert a.select(keys).equals(b.select(keys)) and a.height > 0
    share = "share" if "share" in a.columns else [c for c, t in a.schema.items() if t == pl.Float64][0]
    err = ((a[share] - b[share]).abs().max()) / a[share].abs().max()
    print(json.dumps({"token_share_err_over_max": err}))
    assert err < 1e-6


def test_the_analyses_of_a_batch_without_an_advantage_are_one_note(model_dir, tmp_path):
    """Every advantage 0 (every group's rewards equal): no sequence carries a signal, so verl's probe analyses
    nothing (an analysis would measure rounding) and writes one notes record instead, without a warning; the
    first sequences with an advantage are analysed otherwise (`probe_batch`, the trainer's rule)."""
    import warnings

    old, adv = rollout(model_dir)
    engine = ve.build_engine(model_dir, use_remove_padding=True, micro_batch_size=2, lr=0.1)
    loss_fn = partial(ppo_loss, config=ve.actor_config(micro_batch_size=2))
    options = {**PROBE, "sample_sequences": 3, "lr": 0.5, "analyses": ["prob_change"]}
    with probe_engine(engine, tmp_path / "verl", analyses_every=1, **options) as probe:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            probe.analyze(verl_batch(range(len(PROMPTS)), old, torch.zeros_like(adv)), loss_fn)
        assert set(probe.last_analysis) == {"notes"}
        assert probe.last_analysis["notes"]["message"].to_list() == [
            "step 0: no sequence of the sample has a non-zero advantage; analyses skipped"
        ]
        signal = adv.clone()
        signal[[0, 2]] = 0.0  # the first three sequences with an advantage: 1, 3, 4
        frames = probe.analyze(verl_batch(range(len(PROMPTS)), old, signal), loss_fn)
    want = reference_probe_batch([1, 3, 4], old, signal)
    got = frames["prob_change"].filter((pl.col("update") == "counterfactual") & (pl.col("bin") == -1))
    assert got["count"].item() == want.n_tokens
    assert got["n_pos"].item() + got["n_neg"].item() == want.n_tokens
    notes = pl.read_parquet(sorted((tmp_path / "verl" / "records").glob("notes-*.parquet")))
    assert notes["code"].to_list() == ["no_signal_sample_step_0"]


def test_lopti_with_a_quantile_threshold_splits_at_the_batchs_quantile(model_dir, tmp_path):
    """lopti_quantile: both stages split at the q-quantile of pi_old over the batch's response tokens (computed
    here with torch.quantile), and the weights equal the plain loop's at that eta; outside the update the
    config's threshold is unset again."""
    old, adv = rollout(model_dir)
    lr, q, alpha = 0.5, 0.4, 0.0
    mask = torch.arange(old.shape[1])[None] < torch.tensor(LENGTHS)[:, None]
    eta = float(torch.quantile(old.exp()[mask].double(), q))
    engine = ve.build_engine(model_dir, use_remove_padding=True, micro_batch_size=2, lr=lr)
    cfg = ve.actor_config(micro_batch_size=2, policy_loss=glue.TokendynPolicyLossConfig(lopti_quantile=q))
    loss_fn = partial(ppo_loss, config=cfg)
    out = lopti_update(
        lambda d: ve.train_step(engine, d, loss_fn), verl_batch(range(len(PROMPTS)), old, adv), cfg
    )
    assert cfg.policy_loss.lopti_batch_eta is None and cfg.policy_loss.eta is None
    assert set(out) == {"low", "high"}
    want = plain_lopti(model_dir, old, adv, eta=eta, alpha=alpha, lr=lr)
    got = ve.full_parameters(engine)
    assert max(((got[n] - p).norm() / p.norm()).item() for n, p in want.items()) < 1e-5
    with pytest.raises(glue.VerlConfigError, match=r"^policy_loss.lopti_quantile: exclusive with lopti_eta"):
        glue.TokendynPolicyLossConfig(lopti_eta=0.5, lopti_quantile=0.5)


def reference_logp_entropy(model, rows):
    """log pi(o_t) and the entropy H_t of the distribution at T at the position predicting o_t, [B, W], on the
    plain HF model (right-padded rows with an attention mask)."""
    rows = list(rows)
    seqs = [PROMPTS[i] + RESPONSES[i] for i in rows]
    n, width = max(map(len, seqs)), max(len(RESPONSES[i]) for i in rows)
    ids, attn = torch.zeros(len(rows), n, dtype=torch.long), torch.zeros(len(rows), n, dtype=torch.long)
    for b, seq in enumerate(seqs):
        ids[b, : len(seq)], attn[b, : len(seq)] = torch.tensor(seq), 1
    logits = model(input_ids=ids, attention_mask=attn).logits.float() / T
    logp_all = torch.log_softmax(logits, -1)
    logp = torch.zeros(len(rows), width)
    ent = torch.zeros(len(rows), width)
    for b, i in enumerate(rows):
        p, r = len(PROMPTS[i]), len(RESPONSES[i])
        at = torch.arange(p - 1, p + r - 1)
        logp[b, :r] = logp_all[b, at].gather(-1, torch.tensor(RESPONSES[i])[:, None])[:, 0]
        ent[b, :r] = -(logp_all[b, at].exp() * logp_all[b, at]).sum(-1)
    return logp, ent


@pytest.mark.parametrize("rmpad", [True, False], ids=["remove_padding", "padded"])
def test_lopti_with_kl_and_an_entropy_bonus_restricts_both_to_the_active_group(model_dir, rmpad):
    """The official fork's Lopti with a KL term and an entropy bonus: each stage's KL (verl's low_var_kl, k3) and
    entropy restricted to its group, the denominator over every token, through `lopti_ppo_loss` in verl's engine,
    against a plain-torch loop written from those semantics; and plain `ppo_loss` is refused for it."""
    old, adv = rollout(model_dir)
    g = torch.Generator().manual_seed(3)
    ref = (old + 0.2 * torch.randn(old.shape, generator=g)).clamp(max=-1e-3)
    lr, eta, beta, c_h = 0.5, 0.5, 0.1, 0.05
    engine = ve.build_engine(model_dir, use_remove_padding=rmpad, micro_batch_size=2, lr=lr)
    cfg = ve.actor_config(
        micro_batch_size=2, use_kl_loss=True, kl_loss_coef=beta, kl_loss_type="low_var_kl", entropy_coeff=c_h,
        policy_loss=glue.TokendynPolicyLossConfig(lopti_eta=eta),
    )  # fmt: skip
    data = ve.make_batch(
        PROMPTS, RESPONSES, old_log_probs=old, advantages=adv, ref_log_probs=ref, temperature=T,
        global_batch_size=len(PROMPTS),
    )  # fmt: skip
    with pytest.raises(glue.VerlConfigError, match=r"^actor.use_kl_loss: "):
        lopti_update(lambda d: d, data, cfg)
    loss_fn = partial(lopti_ppo_loss, config=cfg)
    lopti_update(lambda d: ve.train_step(engine, d, loss_fn), data, cfg, restricted=True)

    model = ve.load_hf_model(model_dir)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    rows = range(len(PROMPTS))
    mask = (torch.arange(old.shape[1])[None] < torch.tensor(LENGTHS)[:, None]).float()
    n_tokens = int(mask.sum())
    for keep in (old.exp() < eta, old.exp() >= eta):
        keep = keep.float() * mask
        logp, ent = reference_logp_entropy(model, rows)
        d = (ref - logp).clamp(-20, 20)
        kl = (torch.exp(d) - d - 1).clamp(-10, 10)  # verl's low_var_kl
        loss = ppo_token_mean(logp, old, adv * keep, mask.bool(), n_tokens)
        loss = loss + beta * (kl * keep).sum() / n_tokens - c_h * (ent * keep).sum() / n_tokens
        opt.zero_grad()
        loss.backward()
        opt.step()
    got = ve.full_parameters(engine)
    start = dict(ve.load_hf_model(model_dir).named_parameters())
    err = max(
        ((got[n] - p).norm() / (p - start[n]).norm().clamp(min=1e-12)).item()
        for n, p in model.named_parameters()
    )
    print(json.dumps({"lopti_kl_entropy_update_rel_err": err}))
    assert err < 1e-4  # relative to each parameter's update


def test_the_actor_worker_restricts_lopti_kl_and_entropy_from_the_config_alone(model_dir, tmp_path):
    """The same official semantics through `TrainingWorker.train_mini_batch` (wrapped by the plugin), configured with
    use_kl_loss, an entropy bonus and lopti_eta only: the worker trains each stage with `lopti_ppo_loss` and puts
    verl's own loss back afterwards; the weights equal those of the engine-level run of the test above."""
    old, adv = rollout(model_dir)
    g = torch.Generator().manual_seed(3)
    ref = (old + 0.2 * torch.randn(old.shape, generator=g)).clamp(max=-1e-3)
    lr, eta, beta, c_h = 0.5, 0.5, 0.1, 0.05

    def config():
        return ve.actor_config(
            micro_batch_size=2, use_kl_loss=True, kl_loss_coef=beta, kl_loss_type="low_var_kl", entropy_coeff=c_h,
            policy_loss=glue.TokendynPolicyLossConfig(lopti_eta=eta, probe_dir=str(tmp_path / "run")),
        )  # fmt: skip

    def batch():
        return ve.make_batch(
            PROMPTS, RESPONSES, old_log_probs=old, advantages=adv, ref_log_probs=ref, temperature=T,
            global_batch_size=len(PROMPTS),
        )  # fmt: skip

    cfg = config()
    plain_loss = partial(ppo_loss, config=cfg)
    worker = ve.build_worker(model_dir, plain_loss, use_remove_padding=True, micro_batch_size=2, lr=lr)
    metrics = ve.update_actor(worker, batch())
    assert worker.loss_fn is plain_loss and len(metrics["actor/pg_loss"]) == 2
    engine = ve.build_engine(model_dir, use_remove_padding=True, micro_batch_size=2, lr=lr)
    cfg2 = config()
    lopti_update(
        lambda d: ve.train_step(engine, d, partial(lopti_ppo_loss, config=cfg2)),
        batch(),
        cfg2,
        restricted=True,
    )
    got, want = ve.full_parameters(worker.engine), ve.full_parameters(engine)
    start = dict(ve.load_hf_model(model_dir).named_parameters())
    err = max(((got[n] - p).norm() / (p - start[n]).norm().clamp(min=1e-12)).item() for n, p in want.items())
    assert err < 1e-5, err
