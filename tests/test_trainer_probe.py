"""The probe inside the real TRL training loop: records from the training backward, Lopti stages apart,
zero violations of the exact checks, and training itself unchanged bit for bit."""

from __future__ import annotations

import polars as pl
import pytest
import torch
from test_trainer import _config, _trainer
from transformers import TrainerCallback

from tokendyn.analysis import analyze_run
from tokendyn.hooks.rollouts import read_rollouts
from tokendyn.hooks.trainer import stage_name

torch.set_num_threads(1)


def _params(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


@pytest.mark.parametrize("lopti", [False, True])
def test_probe_records_without_changing_training(tiny_model_dir, tmp_path, lopti):
    extra = dict(lopti_eta=0.5) if lopti else {}
    plain = _trainer(tiny_model_dir, _config(tmp_path / "plain", max_steps=4, **extra))
    plain.train()
    probed = _trainer(
        tiny_model_dir,
        _config(tmp_path / "probed", max_steps=4, probe_every=1, probe_dump_rollouts=True, **extra),
    )
    probed.train()
    for a, b in zip(_params(plain), _params(probed), strict=True):
        assert torch.equal(a, b)  # the probe only reads gradients

    run_dir = tmp_path / "probed" / "run"
    tables = analyze_run(run_dir, write=True)
    stages = set(tables["bins"]["stage"].to_list())
    assert stages == ({"low", "high"} if lopti else {"train"})
    checks = tables["checks"]
    assert checks["logits_violations"].sum() == 0 and checks["head_violations"].sum() == 0
    steps = (
        pl.read_parquet(sorted((run_dir / "records").glob("binstats-*.parquet"))).get_column("step").unique()
    )
    assert sorted(steps.to_list()) == [0, 1, 2, 3]  # every optimizer step was probed
    assert (run_dir / "analysis" / "bins.parquet").is_file()

    # the rebalancing analyses ran on the rollout samples, before and after the real update
    shares = pl.read_parquet(sorted((run_dir / "records").glob("shares-*.parquet")))
    per_step = (
        shares.filter((pl.col("group") == "all") & (pl.col("bin") >= 0))
        .group_by("step", "stage")
        .agg(pl.col("share").sum())
    )
    assert per_step.height >= 1 and (per_step["share"] - 1).abs().max() < 1e-6
    # the whole loss at each rollout start; with Lopti also each stage's own update (eta = 0.5: quarter bins 0, 1
    # are stage 1's tokens, 2, 3 stage 2's), stage 2 one optimizer step later, after the real stage-1 update
    staged = shares.filter(pl.col("group") == "all").group_by("stage").agg(pl.col("step").unique().sort())
    steps_of = dict(zip(staged["stage"].to_list(), staged["step"].to_list(), strict=True))
    assert set(steps_of) == ({"train", "low", "high"} if lopti else {"train"})
    if lopti:
        assert steps_of["train"] == steps_of["low"] == [0, 2]
        assert steps_of["high"] == [1, 3]
        rows = shares.filter((pl.col("group") == "all") & (pl.col("bin") >= 0))
        outside = rows.filter(
            ((pl.col("stage") == "low") & (pl.col("bin") >= 2))
            | ((pl.col("stage") == "high") & (pl.col("bin") < 2))
        )
        assert outside.height == 8 and outside["share"].abs().max() == 0 and outside["count"].max() == 0
    change = pl.read_parquet(sorted((run_dir / "records").glob("prob_change-*.parquet")))
    assert set(change["update"].unique()) == {"counterfactual", "real"}
    influence = pl.read_parquet(sorted((run_dir / "records").glob("influence-*.parquet")))
    assert set(influence["update_stage"].unique()) == ({"low", "high"} if lopti else {"train"})
    # the default step precision, measured: the first analysed step made both ways and checked (every 8th again),
    # its records in float64, the later ones in the dtype the check chose
    check = pl.read_parquet(sorted((run_dir / "records").glob("precision_check-*.parquet")))
    first = influence["step"].min()
    assert check["step"].unique().to_list() == [first] and (check["model_dtype"] == "float32").all()
    stepped = influence.filter(~pl.col("no_update"))
    assert (stepped.filter(pl.col("step") == first)["step_dtype"] == "float64").all()
    later = stepped.filter(pl.col("step") > first)
    assert later.height and (later["step_dtype"] == ("float32" if check["agreed"].all() else "float64")).all()
    assert list((run_dir / "records").glob("token_shares-*.parquet"))

    # each probed rollout's first micro-batch is a rollouts file that `tokendyn probe` reads
    dumps = sorted((run_dir / "rollouts").glob("step-*.parquet"))
    assert dumps and read_rollouts(dumps[0]).n == 8


@pytest.mark.parametrize(
    "accumulation, max_steps, expected",
    [
        (2, 2, [(1, 0), (2, 1)]),
        (1, 4, [(1, 0), (2, 2)]),
    ],  # one / two optimizer steps per stage (the demo: two)
)
def test_lopti_stage_two_shares_are_taken_after_the_real_stage_one_update(
    tiny_model_dir, tmp_path, accumulation, max_steps, expected
):
    """The stage-2 decomposition sees the parameters the trainer's stage 2 starts from: those after the last
    optimizer step of stage 1 (a callback snapshots them), not the rollout-start ones."""
    cfg = _config(
        tmp_path / "run", max_steps=max_steps, probe_every=1, lopti_eta=0.5, probe_analyses="shares",
        gradient_accumulation_steps=accumulation, steps_per_generation=2,
    )  # fmt: skip
    trainer = _trainer(tiny_model_dir, cfg)
    after_step: dict[int, list[torch.Tensor]] = {0: _params(trainer)}
    seen: list[tuple[int, int, list[torch.Tensor]]] = []

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            after_step[state.global_step] = _params(trainer)

    trainer.add_callback(Snapshot())
    original = trainer.probe._stage_shares

    def spy(batch, mask, stage):
        seen.append((stage, trainer.state.global_step, _params(trainer)))
        return original(batch, mask, stage)

    trainer.probe._stage_shares = spy
    trainer.train()
    assert [(stage, step) for stage, step, _ in seen] == expected
    for _stage, step, params in seen:
        assert all(torch.equal(a, b) for a, b in zip(params, after_step[step], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(seen[0][2], seen[1][2], strict=True))


def test_stage_names_follow_the_lopti_order():
    assert [stage_name(s, "low_first") for s in (0, 1, 2)] == ["train", "low", "high"]
    assert [stage_name(s, "high_first") for s in (1, 2)] == ["high", "low"]


def test_probe_fields_are_validated(tmp_path):
    with pytest.raises(ValueError, match="probe_every must be an integer >= 0"):
        _config(tmp_path, probe_every=-1)
    with pytest.raises(ValueError, match="probe_bins"):
        _config(tmp_path, probe_every=1, probe_bins="0,2")


@pytest.mark.parametrize("lopti,max_steps", [(False, 1), (True, 2)])
def test_every_probed_micro_batch_is_recorded_the_last_included(tiny_model_dir, tmp_path, lopti, max_steps):
    """The records' token counts per optimizer step equal the completion tokens of every micro-batch the loss saw
    (counted independently, in the loss itself); the run's last micro-batch (GRPO max_steps=1; Lopti's stage 2 as
    the last step) included."""
    from tokendyn.trainers.grpo import TokendynGRPOTrainer

    class Counting(TokendynGRPOTrainer):
        seen: list = []

        def _compute_loss(self, model, inputs):
            mask = inputs["completion_mask"]
            self.seen.append((self.state.global_step, int(mask.sum())))
            return super()._compute_loss(model, inputs)

    extra = dict(lopti_eta=0.5) if lopti else {}
    t = _trainer(tiny_model_dir, _config(tmp_path, max_steps=max_steps, probe_every=1, **extra), cls=Counting)
    t.train()
    want: dict[int, int] = {}
    for step, n in Counting.seen:
        want[step] = want.get(step, 0) + n
    assert sorted(want) == list(range(max_steps))
    rec = pl.read_parquet(sorted((tmp_path / "run" / "records").glob("binstats-*.parquet")))
    got = (
        rec.filter(
            (pl.col("point") == "final_norm.out") & (pl.col("quantity") == "norm") & (pl.col("bin") >= 0)
        )
        .group_by("step")
        .agg(pl.col("count").sum())
    )
    assert dict(zip(got["step"].to_list(), got["count"].to_list(), strict=True)) == want
    stages = set(rec["stage"].unique().to_list())
    assert stages == ({"low", "high"} if lopti else {"train"})


def test_instrument_records_a_step_whose_optimizer_step_raises(tmp_path):
    """A micro-batch whose backward finished is recorded even when the optimizer step after it raises."""
    from _models import completion_logps, make_batch, tiny_qwen2

    from tokendyn.hooks.loop import instrument

    model = tiny_qwen2(0)
    b = make_batch(model)
    with pytest.raises(RuntimeError, match="optimizer exploded"):
        with instrument(model, tmp_path) as probe:
            out = model(input_ids=b.input_ids, attention_mask=b.attention_mask)
            logps = completion_logps(out.logits, b, 1.0)
            probe.begin_step(
                completion_mask=b.completion_mask,
                advantages=b.advantages,
                completion_ids=b.completion_ids,
                logps=logps,
            )
            (-(logps * b.advantages.unsqueeze(1) * b.completion_mask).sum()).backward()
            raise RuntimeError("optimizer exploded")
    files = sorted((tmp_path / "records").glob("binstats-*.parquet"))
    assert files, "the finished micro-batch was dropped"
    rec = pl.read_parquet(files)
    n = rec.filter(
        (pl.col("quantity") == "norm") & (pl.col("bin") >= 0) & (pl.col("point") == "final_norm.out")
    )
    assert int(n["count"].sum()) == int(b.completion_mask.sum())


def test_an_entropy_bonus_is_part_of_the_identity(tiny_model_dir, tmp_path):
    """An entropy bonus adds e_t dH_t/dh to the head-input gradient (TRL's fused head returns the entropies, which
    the probe reads like the log-probs): the identity predicts it, so its error stays at float32 rounding whatever
    the coefficient (scaled error before: 6.5e-5, 6.5e-4, 6.5e-3 at 0.01, 0.1, 1), and the bound, on the policy-gradient part,
    holds. The must-hold table holds no unscaled error (those are diagnostics)."""
    from tokendyn.analysis.tables import checks_violations

    for coef in (0.0, 0.01, 1.0):
        run = tmp_path / f"coef{coef}"
        t = _trainer(
            tiny_model_dir, _config(run, max_steps=1, probe_every=1, loss_type="bnpo", entropy_coef=coef)
        )
        t.train()
        tables = analyze_run(run / "run", write=False)
        checks = tables["checks"]
        assert not {"identity_max_rel_err", "identity_logits_max_rel_err"} & set(checks.columns)
        raw = pl.read_parquet(sorted((run / "run" / "records").glob("checks-*.parquet")))
        assert int(checks["identity_n"].sum()) > 0 and checks_violations(checks) == 0
        checked = raw.filter(pl.col("n_checked") > 0)  # the micro-batches the check budget afforded
        assert checked.height >= 1 and checked["entropy_term"].to_list() == [coef != 0.0] * checked.height
        assert (
            raw.filter(pl.col("n_checked") == 0)["entropy_term"].null_count() == raw.height - checked.height
        )
        assert float(raw["identity_max_scaled_err"].max()) < 1e-5, coef  # scaled: |w| sigma_max / T
        assert float((raw["head_ratio_max"] / raw["head_bound"]).max()) <= 1.0


@pytest.mark.parametrize("lora", [False, True])
def test_the_gpu_recipe_bf16_autocast_has_no_violations(tiny_model_dir, tmp_path, lora):
    """The GPU recipe (docs/gpus.md) on CPU: ``bf16=True`` (float32 weights, bf16 autocast, TRL's fused head
    computing in bf16), the probe and the analyses on every step, with and without a LoRA adapter. Before, the checks
    took their tolerance from the float32 gradient while the head ran in bf16 (122 of 576 tokens reported as
    violations); now they are told the head's dtype, round the prediction as the head does, and report none."""
    from datasets import Dataset
    from test_trainer import PROMPTS, vowel_reward
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from tokendyn.analysis.tables import checks_violations
    from tokendyn.trainers.grpo import TokendynGRPOTrainer

    extra = {}
    if lora:
        peft = pytest.importorskip("peft")
        extra["peft_config"] = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0
        )
    cfg = _config(tmp_path, max_steps=2, probe_every=1, probe_sample_sequences=4, bf16=True)
    trainer = TokendynGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=vowel_reward, args=cfg,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=PreTrainedTokenizerFast.from_pretrained(tiny_model_dir), **extra,
    )  # fmt: skip
    trainer.train()
    run = tmp_path / "run"
    tables = analyze_run(run, write=False)
    raw = pl.read_parquet(sorted((run / "records").glob("checks-*.parquet")))
    assert raw.height >= 2 and set(raw["head_dtype"]) == {"bfloat16"} and raw["identity_rounded"].all()
    assert checks_violations(tables["checks"]) == 0 and int(raw["identity_n"].sum()) > 0
    shares = pl.read_parquet(sorted((run / "records").glob("shares-*.parquet")))
    per_step = (
        shares.filter((pl.col("group") == "all") & (pl.col("bin") >= 0))
        .group_by("step")
        .agg(pl.col("share").sum())
    )
    assert per_step.height >= 1 and float((per_step["share"] - 1).abs().max()) < 1e-3


@pytest.mark.slow_tier  # the slow tier: `make test-slow` (several processes)
def test_the_gpu_recipe_with_lora_under_a_one_process_ddp_launch():
    """The same run as torchrun launches it with one process (RANK / WORLD_SIZE / MASTER_* set: Accelerate wraps the
    model in DDP with find_unused_parameters): the fused head's entropy then gets a None gradient in the backward,
    which crashed the probe's hook (an AttributeError) before; now no gradient is recorded as no gradient."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = "29561"
    test = f"{__file__}::test_the_gpu_recipe_bf16_autocast_has_no_violations[True]"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout


def _prompt_reward(constant):
    """The vowel reward, but a constant one on the prompts in ``constant``: their groups carry no signal."""
    from test_trainer import vowel_reward

    def reward(prompts, completions, **kwargs):
        graded = vowel_reward(completions)
        return [1.0 if p in constant else g for p, g in zip(prompts, graded, strict=True)]

    return reward


def _capturing_rollouts(trainer):
    seen = []
    original = trainer.probe.rollout

    def rollout(output):
        original(output)
        seen.append((output, trainer.probe._sample_rows))

    trainer.probe.rollout = rollout
    return seen


def test_the_analysis_sample_is_the_first_sequences_with_a_signal(tiny_model_dir, tmp_path):
    """Half the prompts give their group one reward (advantage 0): the analysed rows are the first
    probe_sample_sequences rows of the batch with a non-zero advantage, in the batch's order, not its first rows."""
    from test_trainer import PROMPTS

    args = _config(tmp_path, max_steps=2, probe_every=1, probe_sample_sequences=6)
    trainer = _trainer(tiny_model_dir, args)
    trainer.reward_funcs = [_prompt_reward(set(PROMPTS[::2]))]
    seen = _capturing_rollouts(trainer)
    trainer.train()
    assert seen
    for output, sample in seen:
        adv = output["advantages"]
        has = adv.reshape(adv.size(0), -1).ne(0).any(dim=1).tolist()
        assert 0 < sum(has) < len(has)  # both kinds of rows in the batch
        want = [i for i, h in enumerate(has) if h][:6]
        assert want != list(range(len(want)))  # the first rows would not have been the sample
        assert torch.equal(sample["completion_ids"], output["completion_ids"][want])
        assert torch.equal(sample["advantages"], output["advantages"][want])


def test_a_rollout_without_signal_is_noted_and_not_analysed(tiny_model_dir, tmp_path, recwarn):
    """Every group's rewards equal: one `notes` row says so, no analysis record is written, no warning printed."""
    from test_trainer import PROMPTS

    args = _config(tmp_path, max_steps=1, probe_every=1, probe_sample_sequences=4)
    trainer = _trainer(tiny_model_dir, args)
    trainer.reward_funcs = [_prompt_reward(set(PROMPTS))]
    trainer.train()
    records = tmp_path / "run" / "records"
    notes = pl.read_parquet(sorted(records.glob("notes-*.parquet")))
    assert notes["code"].to_list() == ["no_signal_sample_step_0"]
    assert "no sequence of the rollout batch has a non-zero advantage" in notes["message"][0]
    for kind in ("shares", "prob_change", "influence"):
        assert not list(records.glob(f"{kind}-*.parquet"))
    assert list(records.glob("binstats-*.parquet"))  # the recorder itself still ran
    assert not [w for w in recwarn if "probe:" in str(w.message)]
