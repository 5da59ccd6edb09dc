"""Live probe metrics through ``--report_to wandb``: a real tiny TRL run (`tokendyn train`'s path: the probe on, its
live metrics attached because report_to names an integration) logs to an offline W&B run (every W&B folder under
tmp, nothing sent); its transaction log is read back with W&B's own reader and checked against the records the same
run wrote to disk and against the run's training log (metrics.parquet). verl's ``main_ppo`` with
``trainer.logger=['console','wandb']``: tests/test_verl_main_ppo.py, on the one run that file already makes."""

from __future__ import annotations

import math

import polars as pl
import pytest
import torch
from _wandb_history import exit_code, history, log_records, offline_env, run_file

import tokendyn
from tokendyn.trainers.runner import train
from tokendyn.trainers.train_cli import parse
from tokendyn.vocab import FULL_UPDATES

wandb = pytest.importorskip("wandb")  # installed with verl (pyproject.toml's verl and dev extras)

PROBE = "train/probe/"  # transformers' W&B callback prefixes the Trainer's log keys with train/


def vowel_reward(completions, **kwargs):
    """A reward that differs within a group (the tiny model never answers a K&K puzzle: zero advantages)."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


@pytest.fixture(scope="module")
def wandb_run(tiny_model_dir, tmp_path_factory):
    """Two GRPO steps of the tiny model, probed at each, with the analyses (update shares, probability change),
    reported to W&B offline; the run directory and W&B's history rows of the run."""
    root = tmp_path_factory.mktemp("wandb")
    out, env = root / "run", offline_env(root / "wandb_dir")
    argv = ["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out), "--people", "3"]
    argv += ["--train_puzzles_per_size", "4", "--eval_n", "0", "--rollouts", "2", "--save_strategy", "no"]
    argv += ["--per_device_train_batch_size", "4", "--num_generations", "4", "--steps_per_generation", "1"]
    argv += ["--max_completion_length", "6", "--temperature", "1.0", "--disable_tqdm", "true"]
    argv += ["--probe_every", "1", "--probe_sample_sequences", "4", "--probe_flush_seconds", "0"]
    argv += ["--probe_analyses", "shares,prob_change"]
    argv += ["--report_to", "wandb", "--run_name", "tiny"]
    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {**env, "WANDB_PROJECT": "tokendyn-tests"}.items():
            mp.setenv(key, value)
        try:
            train(*parse(argv), progress=False, reward=vowel_reward)
            wandb.finish()  # what the end of the script does (W&B's exit hook); transformers leaves the run open
        finally:
            torch.set_num_threads(before)
            wandb.teardown()  # the W&B service of this process, and its settings, gone with the test
    records = log_records(run_file(root / "wandb_dir"), env)
    assert exit_code(records) == 0  # the run finished
    return out, history(records)


def _by_step(rows: list[dict]) -> dict[int, dict]:
    """The W&B rows that carry probe numbers, by the Trainer's global step (one row per step)."""
    out: dict[int, dict] = {}
    for row in rows:
        if any(k.startswith(PROBE) for k in row):
            step = int(row["train/global_step"])
            assert step not in out
            out[step] = row
    return out


def test_wandb_gets_the_probe_numbers_of_the_records(wandb_run):
    out, rows = wandb_run
    assert any("train/reward" in r for r in rows)  # TRL's own scalars are there too
    logged = _by_step(rows)
    assert sorted(logged) == [1, 2]  # both optimizer steps, probed at each
    run = tokendyn.load_run(out)

    # token shares per bin at the final norm, over the step's micro-batches: records step s -> global step s + 1
    norms = run["binstats"].filter(
        (pl.col("quantity") == "norm") & (pl.col("point") == "final_norm.out") & (pl.col("bin") >= 0)
    )
    counts = norms.group_by("step", "bin").agg(pl.col("count").sum()).collect()
    assert sorted(counts["step"].unique().to_list()) == [0, 1]
    for step in (0, 1):
        per_bin = dict(counts.filter(pl.col("step") == step).select("bin", "count").iter_rows())
        total = sum(per_bin.values())
        assert sorted(per_bin) == [0, 1, 2, 3] and total > 0  # the paper's four bins
        shares = {k: v for k, v in logged[step + 1].items() if k.startswith(f"{PROBE}token_share/")}
        assert set(shares) == {f"{PROBE}token_share/bin{k}" for k in per_bin}
        for k, c in per_bin.items():
            assert shares[f"{PROBE}token_share/bin{k}"] == pytest.approx(c / total, rel=1e-12, abs=0)

    # the exact checks: violations summed (0), the LM-head identity's largest error
    checks = run["checks"].collect()
    for step in (0, 1):
        c = checks.filter(pl.col("step") == step)
        assert c.height >= 1
        violations = int(c["logits_violations"].sum() + c["head_violations"].sum())
        assert violations == 0
        assert logged[step + 1][f"{PROBE}bound_violations"] == violations
        assert logged[step + 1][f"{PROBE}identity_max_rel_err"] == pytest.approx(
            float(c["identity_max_rel_err"].max()), rel=1e-12
        )

    # the analyses of a step (before its update) are logged with that step's row
    shares = (
        run["shares"].filter((pl.col("group") == "all") & (pl.col("bin") >= 0) & (pl.col("stage") == "train"))
    ).collect()
    assert sorted(shares["step"].unique().to_list()) == [0, 1]
    columns = ("step", "bin", "share", "grad_norm", "total_norm")
    for step, b, share, norm, total in shares.select(columns).rows():
        row = logged[step + 1]
        assert row[f"{PROBE}update_share/bin{b}"] == pytest.approx(share, rel=1e-12, abs=1e-15)
        assert row[f"{PROBE}grad_norm_rel/bin{b}"] == pytest.approx(norm / total, rel=1e-12)
    for step in (0, 1):  # s_b sums to 1 over the bins
        s = [v for k, v in logged[step + 1].items() if k.startswith(f"{PROBE}update_share/bin")]
        assert len(s) == 4 and sum(s) == pytest.approx(1.0, abs=1e-6)

    change = (
        run["prob_change"]
        .filter(
            (pl.col("update") == "counterfactual")
            & (pl.col("source_bin") == -1)
            & pl.col("update_stage").is_in(FULL_UPDATES)
            & (pl.col("bin") >= 0)
        )
        .collect()
    )
    assert sorted(change["step"].unique().to_list()) == [0, 1]
    seen = 0
    for r in change.iter_rows(named=True):
        for col in ("correct_pos", "correct_neg", "tie_pos", "tie_neg"):
            key = f"{PROBE}{col}/bin{r['bin']}"
            if r[col] is not None and math.isfinite(r[col]):
                assert logged[r["step"] + 1][key] == pytest.approx(r[col], rel=1e-12)
                seen += 1
            else:  # no tokens of that sign in the bin: nothing logged
                assert key not in logged[r["step"] + 1]
    assert seen >= 8


def test_every_live_number_of_the_training_log_reaches_wandb_unchanged(wandb_run):
    """metrics.parquet holds the Trainer's log rows as the integrations get them: each probe number of each row is
    in W&B's row of the same step, with the same value, and W&B has no probe number the log lacks."""
    out, rows = wandb_run
    logged = _by_step(rows)
    metrics = pl.read_parquet(out / "metrics.parquet")
    probe_cols = [c for c in metrics.columns if c.startswith("probe/")]
    assert len(probe_cols) >= 4 + 2 + 4 + 4 + 4  # token and update shares, checks, norms, correct ratios
    n = 0
    for row in metrics.iter_rows(named=True):
        live = {c: row[c] for c in probe_cols if row[c] is not None}
        if not live:
            continue
        got = logged[int(row["step"])]
        assert {k for k in got if k.startswith(PROBE)} == {f"train/{c}" for c in live}
        for c, v in live.items():
            assert got[f"train/{c}"] == v, c
            n += 1
    assert n >= 2 * 18
