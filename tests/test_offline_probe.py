"""`tokendyn probe`: a rollouts file from any RL stack, probed offline into the records a training run writes.

The reference is the real thing: a rollouts file dumped from a real TokendynGRPOTrainer micro-batch gives, offline on
the same initial weights, the per-bin statistics the in-training probe recorded on that micro-batch."""

from __future__ import annotations

import json
import math

import polars as pl
import pytest
import torch
from test_trainer import _config, _trainer
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from tokendyn.cli import main
from tokendyn.hooks.offline import probe_rollouts
from tokendyn.hooks.rollouts import RolloutsError, dump_rollouts, read_rollouts
from tokendyn.probe.batch import signal_rows
from tokendyn.probe.tokenloss import Objective
from tokendyn.remedies import grpo_advantages
from tokendyn.trainers.grpo import TokendynGRPOTrainer

torch.set_num_threads(1)

# Sampling temperature of the reference run. Training reads pi through TRL's fused LM head, the offline probe through
# a plain one: both in float32, where pi near 1 leaves 1 - pi resolved only to ~1e-7 / (1 - pi) (2.5e-4 relative at
# pi = 0.9998, which T = 0.7 samples on this model). At T = 1.1 every sampled pi is < 0.95 and every bin is populated,
# so per-bin min/max can be compared at 1e-5. (A float64 run would remove the limit; see the report.)
T_PROBE = 1.1


class _FirstBatch(TokendynGRPOTrainer):
    """Keeps a copy of the loss inputs of the first training micro-step (step 0, micro-batch 0) and of the first
    rollout batch as generated (before TRL shuffles it into micro-batches)."""

    first_inputs: dict | None = None
    first_rollout: dict | None = None

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.first_rollout is None and self.model.training:
            self.first_rollout = {
                k: v.detach().clone() if torch.is_tensor(v) else v for k, v in output.items()
            }
        return output

    def _compute_loss(self, model, inputs):
        if self.first_inputs is None and model.training:
            self.first_inputs = {
                k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()
            }
        return super()._compute_loss(model, inputs)


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """One probed GRPO step (analyses on), its first micro-batch dumped as a rollouts file, and the sequences its
    analyses ran on (the first 8 of the rollout batch as generated that have a non-zero advantage, as the trainer's
    probe takes them) as another."""
    tmp = tmp_path_factory.mktemp("offline")
    trainer = _trainer(
        tiny_model_dir, _config(tmp, max_steps=1, probe_every=1, temperature=T_PROBE), cls=_FirstBatch
    )
    trainer.train()
    inputs = trainer.first_inputs
    path = dump_rollouts(inputs, tmp / "batch.parquet", temperature=T_PROBE)
    first = trainer.first_rollout
    rows = signal_rows(first["advantages"], first["completion_mask"]).nonzero().squeeze(1)[:8]
    rollout = {k: v[rows] if torch.is_tensor(v) and v.dim() else v for k, v in first.items()}
    sample = dump_rollouts(rollout, tmp / "sample.parquet", temperature=T_PROBE)
    return inputs, path, tmp / "run" / "records", trainer.args, sample


def _load(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return model, PreTrainedTokenizerFast.from_pretrained(model_dir)


def _frame(records_dir, kind):
    return pl.read_parquet(sorted(records_dir.glob(f"{kind}-*.parquet")))


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def test_dump_rebuilds_the_training_micro_batch(trained):
    inputs, path, _, _, _ = trained
    r = read_rollouts(path)
    assert r.n == inputs["completion_ids"].shape[0] and r.temperature == T_PROBE
    batch = r.batch(range(r.n), pad_id=0)
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
        assert torch.equal(batch[key], inputs[key].long()), key
    assert torch.equal(batch["loss_mask"], inputs["completion_mask"].long())
    assert torch.equal(batch["advantages"].to(inputs["advantages"].dtype), inputs["advantages"])
    assert ("old_per_token_logps" in batch) == (inputs.get("old_per_token_logps") is not None)
    assert bool(
        (inputs["prompt_mask"] == 0).any()
    )  # the batch really is padded: padding was kept, not rebuilt


def test_offline_probe_matches_the_in_training_probe(trained, tiny_model_dir, tmp_path):
    inputs, path, train_records, args, sample = trained
    model, tok = _load(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    objective = Objective(
        eps_low=args.epsilon, eps_high=args.epsilon, beta=0.0
    )  # as the trainer (epsilon_high unset)
    # TRL's training forward passes no position ids: "model" reproduces it (the default, "mask", follows the sampler)
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
    assert res.micro_batches == 1 and res.tokens == int(inputs["completion_mask"].sum())

    # the model is left as it was
    assert model.training and all(p.requires_grad and p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    off_records = tmp_path / "off" / "records"
    key = ["point", "bin", "quantity"]
    train = _frame(train_records, "binstats").filter(
        (pl.col("step") == 0) & (pl.col("micro") == 0) & (pl.col("stage") == "train")
    )
    off = _frame(off_records, "binstats")
    assert off["step"].unique().to_list() == [0] and off["stage"].unique().to_list() == ["train"]
    assert train.height == off.height > 0
    both = train.join(off, on=key, suffix="_off")
    assert both.height == train.height
    assert (both["count"] == both["count_off"]).all()
    assert both.filter(pl.col("quantity") == "norm")["count"].sum() == res.tokens * 3  # 2 layers + final norm
    pi = _frame(train_records, "tokens").filter((pl.col("step") == 0) & (pl.col("micro") == 0))["pi"]
    assert pi.max() < 0.95, "precondition: no sampled pi so close to 1 that float32 cannot resolve 1 - pi"
    checked = 0
    for row in both.filter(
        pl.col("quantity").is_in(["norm_per_w", "ratio"]) & (pl.col("count") > 0)
    ).iter_rows(named=True):
        for stat in ("sum", "min", "max"):
            assert _rel(row[stat], row[f"{stat}_off"]) < 1e-5, (
                row["point"],
                row["bin"],
                row["quantity"],
                stat,
            )
            checked += 1
    assert checked >= 2 * 3 * 3 * 2  # at least two non-empty bins at every point

    # the same record kinds as training (less the real update's change), the same analyses on the same sample
    off_records = tmp_path / "sample" / "records"
    probe_rollouts(
        model, tok, sample, off_records.parent, batch_size=64, sample_sequences=8, objective=objective,
        positions="model",
    )  # fmt: skip
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the analyses left it too
    kinds = {p.name.split("-rank")[0] for p in off_records.glob("*.parquet")}
    # (less the trainer's floor: its micro-batch recomputed in two splits, a training-loop record)
    assert kinds == {p.name.split("-rank")[0] for p in train_records.glob("*.parquet")} - {"floor"}
    key = ["bin", "group"]
    shares = (
        _frame(train_records, "shares")
        .filter(pl.col("step") == 0)
        .join(_frame(off_records, "shares"), on=key)
    )
    assert shares.height == _frame(off_records, "shares").height
    for a, b in zip(shares["share"], shares["share_right"], strict=True):
        assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    change = _frame(train_records, "prob_change").filter(pl.col("update") == "counterfactual")
    change = change.join(_frame(off_records, "prob_change"), on=["update_stage", "source_bin", "bin"])
    assert change.height > 0 and (change["count"] == change["count_right"]).all()
    for a, b in zip(change["mean"], change["mean_right"], strict=True):
        assert a is None and b is None or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)
    meta = json.loads((tmp_path / "off" / "run.json").read_text())
    assert meta["method"] == "offline probe" and meta["rollouts"] == str(path)


def test_text_rollouts_with_rewards_get_grpo_advantages(tiny_model_dir, tmp_path):
    model, tok = _load(tiny_model_dir)
    prompts = {"a": "Zoey says that", "b": [{"role": "user", "content": "Knights always"}]}
    completions = [" Oliver is a knave", " tell the truth", " lie", " count: one two"]
    rewards = {"a": [1.0, 0.0, 0.5, 0.25], "b": [0.0, 0.0, 1.0, 3.0]}
    rows = [  # groups interleaved: advantages must be computed per group whatever the row order
        {"prompt": prompts[g], "completion": completions[k], "reward": rewards[g][k], "group": g}
        for k in range(4)
        for g in ("a", "b")
    ]
    r = read_rollouts(rows)
    expected = {g: grpo_advantages(torch.tensor(rewards[g], dtype=torch.float64), 4) for g in rewards}
    for i, row in enumerate(rows):
        assert r.advantages[i] == pytest.approx(float(expected[row["group"]][i // 2]), rel=1e-12)
    assert r.advantage_source == "grpo(reward, group)"

    enc = r.encode(tok)
    assert (
        enc.prompt_ids[0].tolist() == tok(text=prompts["a"])["input_ids"]
    )  # plain prompt, as TRL tokenizes it
    chat = tok.apply_chat_template(prompts["b"], add_generation_prompt=True, tokenize=True, return_dict=True)
    assert enc.prompt_ids[1].tolist() == chat["input_ids"]
    assert enc.completion_ids[2].tolist() == tok(text=completions[1], add_special_tokens=False)["input_ids"]

    probe_rollouts(model, tok, enc, tmp_path / "run", temperature=0.7, analyses="none", batch_size=8)
    tokens = _frame(tmp_path / "run" / "records", "tokens")
    assert tokens.height > 0
    for row, adv in tokens.select("row", "advantage").unique().iter_rows():
        assert adv == pytest.approx(float(r.advantages[row]), rel=1e-12)
    assert not list((tmp_path / "run" / "records").glob("shares-*"))  # analyses off


def test_token_rollouts_with_per_token_advantages_and_loss_mask(tiny_model_dir, tmp_path):
    model, tok = _load(tiny_model_dir)
    df = pl.DataFrame(
        {
            "prompt_ids": [[5, 6, 7], [0, 8, 9]],
            "prompt_mask": [[1, 1, 1], [0, 1, 1]],
            "completion_ids": [[10, 11, 12, 13], [14, 15, 0, 0]],
            "completion_mask": [[1, 1, 1, 1], [1, 1, 0, 0]],
            "loss_mask": [
                [1, 0, 1, 1],
                [1, 1, 0, 0],
            ],  # e.g. a tool-output token that is attended, not scored
            "advantage": [[0.5, 9.0, -1.0, 2.0], [1.0, -0.5, 0.0, 0.0]],
            "old_logp": [[-0.5, -1.0, -2.0, -0.1], [-0.3, -0.2, 0.0, 0.0]],
        }
    )
    f = tmp_path / "r.parquet"
    df.write_parquet(f)
    res = probe_rollouts(model, tok, f, tmp_path / "run", analyses="none")
    assert res.tokens == 5
    bins = _frame(tmp_path / "run" / "records", "binstats").filter(
        (pl.col("quantity") == "norm") & (pl.col("point") == "final_norm.out")
    )
    # binned by the file's pi_old = exp(old_logp) on the scored tokens: 0.61, 0.14, 0.90 | 0.74, 0.82
    assert dict(zip(bins["bin"], bins["count"], strict=True)) == {0: 1, 1: 0, 2: 2, 3: 2}


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = [
    {"prompt_ids": [5, 6], "completion_ids": [7, 8, 9], "advantage": 1.0, "old_logp": [-1.0, -0.5, -0.2]},
    {"prompt_ids": [5, 6], "completion_ids": [7, 9, 10], "advantage": -1.0, "old_logp": [-1.0, -0.7, -0.3]},
]


def _bad(tmp_path, name):
    """(file, expected message fragments) of one malformed rollouts file."""
    if name == "missing column":
        rows = [{k: v for k, v in r.items() if k != "advantage"} | {"advantages": 1.0} for r in GOOD]
        return _write_jsonl(tmp_path / "r.jsonl", rows), [
            "no advantages",
            "'reward' + 'group'",
            "rename 'advantages' -> 'advantage'",
        ]
    if name == "missing completion_ids":
        rows = [{k: v for k, v in r.items() if k != "completion_ids"} for r in GOOD]
        return _write_jsonl(tmp_path / "r.jsonl", rows), [
            "'prompt_ids' is given but 'completion_ids' is missing"
        ]
    if name == "wrong type (parquet)":
        f = tmp_path / "r.parquet"
        pl.DataFrame({"prompt": ["a", "b"], "completion": ["c", "d"], "advantage": ["x", "y"]}).write_parquet(
            f
        )
        return f, ["column 'advantage' must be a number", "String"]
    if name == "wrong type (jsonl)":
        rows = [GOOD[0], GOOD[1] | {"completion_ids": [7, "eight", 9]}]
        return _write_jsonl(tmp_path / "r.jsonl", rows), [
            "column 'completion_ids' must be a list of integers",
            "row 1 (line 2)",
        ]
    if name == "ragged old_logp":
        rows = [GOOD[0], GOOD[1] | {"old_logp": [-1.0, -0.7]}]
        return _write_jsonl(tmp_path / "r.jsonl", rows), [
            "row 1 (line 2): old_logp has 2 entries but completion_ids has 3"
        ]
    if name == "probabilities as old_logp":
        rows = [GOOD[0] | {"old_logp": [0.3, 0.5, 0.9]}, GOOD[1]]
        return _write_jsonl(tmp_path / "r.jsonl", rows), ["old_logp must be finite log-probabilities <= 0"]
    if name == "bad group sizes":
        groups = ["p1", "p1", "p1", "p2", "p2", "p3", "p3", "p3"]
        rows = [
            {"prompt": "a", "completion": "b", "reward": 1.0 * i, "group": g} for i, g in enumerate(groups)
        ]
        return _write_jsonl(tmp_path / "r.jsonl", rows), [
            "column 'group': every group must have the same number",
            "most groups have 3, but 'p2' has 2",
        ]
    if name == "unknown file type":
        f = tmp_path / "r.csv"
        f.write_text("prompt,completion,advantage\na,b,1\n")
        return f, ["unknown file type '.csv'; use .parquet or .jsonl"]
    raise AssertionError(name)


CASES = [
    "missing column",
    "missing completion_ids",
    "wrong type (parquet)",
    "wrong type (jsonl)",
    "ragged old_logp",
    "probabilities as old_logp",
    "bad group sizes",
    "unknown file type",
]


@pytest.mark.parametrize("case", CASES)
def test_malformed_rollouts_fail_clearly_and_write_nothing(case, tiny_model_dir, tmp_path, capsys):
    path, fragments = _bad(tmp_path, case)
    with pytest.raises(RolloutsError) as info:
        read_rollouts(path)
    for fragment in fragments:
        assert fragment in str(info.value)
    out = tmp_path / "out"
    rc = main(["probe", "--model", str(tiny_model_dir), "--rollouts", str(path), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("tokendyn probe: error: rollouts ") and fragments[0] in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_bad_options_fail_before_writing(tiny_model_dir, tmp_path, capsys):
    path = _write_jsonl(tmp_path / "r.jsonl", GOOD)
    base = ["probe", "--model", str(tiny_model_dir), "--rollouts", str(path)]
    cases = [
        (["--out", str(tmp_path / "a"), "--batch_size", "0"], "--batch_size: must be >= 1"),
        (["--out", str(tmp_path / "a"), "--analyses", "shares,bogus"], "--analyses: unknown ['bogus']"),
        (["--out", str(tmp_path / "a"), "--bins", "0,2"], "--bins:"),
        (["--out", str(tmp_path / "a"), "--beta", "0.1"], "needs a 'ref_logp' column"),
        (["--out", str(tmp_path / "a"), "--points", "nope.*"], "nope"),  # found only once the model is loaded
    ]
    for extra, fragment in cases:
        assert main(base + extra) == 2
        assert fragment in capsys.readouterr().err
        assert not (tmp_path / "a").exists()
    full = tmp_path / "full"
    (full / "records").mkdir(parents=True)
    (full / "records" / "keep.txt").write_text("earlier run")
    assert main(base + ["--out", str(full)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert [p.name for p in full.rglob("*")] == ["records", "keep.txt"]


def test_cli_end_to_end_then_analyze(tiny_model_dir, tmp_path, capsys):
    rows = [
        {
            "prompt": p,
            "completion": c,
            "reward": float(len(c) % 3),
            "group": g,
            "temperature": 0.7,
            "source": "x",
        }
        for g, p in enumerate(["Zoey says that", "Knights always", "the quick brown"])
        for c in [" Oliver is a knave", " tell the truth", " lie", " count: one two"]
    ]
    path = _write_jsonl(tmp_path / "rollouts.jsonl", rows)
    out = tmp_path / "probe_run"
    argv = ["probe", "--model", str(tiny_model_dir), "--rollouts", str(path), "--out", str(out)]
    extra = ["--compare_rules", "reweight,lopti"]  # the paired comparison too (equal_norm: no run optimizer)
    rc = main(argv + ["--batch_size", "4", "--sample_sequences", "4", "--device", "cpu", *extra])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert f"to {out / 'records'}" in captured.out and f"tokendyn analyze {out}" in captured.out
    assert "ignored columns: source" in captured.err
    kinds = {p.name.split("-rank")[0] for p in (out / "records").glob("*.parquet")}
    assert {"binstats", "checks", "shares", "token_shares", "prob_change", "influence", "paired"} <= kinds
    paired = _frame(out / "records", "paired")
    assert set(paired["rule"]) == {"base", "reweight", "lopti"} and set(paired["mode"]) == {"equal_norm"}
    assert _frame(out / "records", "binstats")["micro"].unique().sort().to_list() == [0, 1, 2]
    meta = json.loads((out / "run.json").read_text())
    assert meta["options"]["temperature"] == 0.7 and meta["advantages"] == "grpo(reward, group)"
    assert not [p for p in tmp_path.iterdir() if "staging" in p.name]
    assert main(["analyze", str(out)]) == 0
    assert (out / "analysis" / "bins.parquet").is_file() and (out / "analysis" / "paired.parquet").is_file()
    assert "Paired comparison" in capsys.readouterr().out


def test_probe_cli_takes_the_trained_loss_options_and_names_a_bad_one(tmp_path, capsys):
    """`tokendyn probe` builds the same Objective as the trainer: a bad loss option is one line naming the flag."""
    import argparse

    from tokendyn.hooks import offline_cli

    parser = argparse.ArgumentParser()
    offline_cli.register(parser.add_subparsers())
    base = ["probe", "--model", "m", "--rollouts", "r.parquet", "--out", str(tmp_path / "o")]
    args = parser.parse_args([*base, "--loss_type", "grpo", "--importance_sampling_level", "sequence",
                              "--use_bias_correction_kl", "--beta", "0.1", "--lr_sweep", "1e-3", "1"])  # fmt: skip
    _, objective = offline_cli._check_args(args)
    assert (objective.loss_type, objective.importance_sampling_level, objective.bias_correction_kl) == (
        "grpo", "sequence", True)  # fmt: skip
    for flags, name in ((["--loss_type", "vespo", "--importance_sampling_level", "sequence"], "--loss_type"),
                        (["--loss_type", "dr_grpo"], "--loss_type"),
                        (["--loss_type", "sapo", "--sapo_temperature_neg", "0"], "--sapo_temperature_neg"),
                        (["--top_entropy_quantile", "0"], "--top_entropy_quantile"),
                        (["--lr_sweep", "0"], "--lr_sweep")):  # fmt: skip
        with pytest.raises(ValueError, match=name):
            offline_cli._check_args(parser.parse_args([*base, *flags]))
