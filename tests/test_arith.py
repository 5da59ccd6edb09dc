"""The arithmetic task: the generator is deterministic, the held-out split is fixed and disjoint (by unordered pair)
from every training stream, the scorer's rule on a table of edge cases and on generated text, the TRL rows, and a
tiny `tokendyn train --task arith` on the embedded default writing its records and held-out accuracy."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokendyn.tasks.arith import (
    HELDOUT_SIZE,
    arith_dataset,
    arith_problems,
    arith_reward,
    first_integer,
    heldout,
    render_prompt,
    score,
    train_problems,
)
from tokendyn.tasks.arith.generator import MAX_DIGITS, MIN_DIGITS, operand_range

DIGITS = list(range(MIN_DIGITS, MAX_DIGITS + 1))


# ---- generator ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", DIGITS)
def test_heldout_is_fixed_sized_distinct_and_in_range(d):
    h = heldout(d)
    assert len(h) == HELDOUT_SIZE[d]
    assert len({p.key for p in h}) == len(h)  # one orientation per unordered pair
    lo, hi = operand_range(d)
    assert all(lo <= p.a <= hi and lo <= p.b <= hi and p.answer == p.a + p.b for p in h)
    heldout.cache_clear()
    assert heldout(d) == h  # drawn again from scratch: the same problems in the same order


def test_heldout_first_problems_are_pinned():
    """The split is part of the task's definition: a change to the generator that moves it fails here."""
    assert [(p.a, p.b) for p in heldout(1)[:5]] == [(1, 1), (8, 4), (9, 0), (9, 8), (0, 7)]
    assert [(p.a, p.b) for p in heldout(2)[:3]] == [(24, 85), (67, 55), (84, 98)]


@pytest.mark.parametrize("d", DIGITS)
@pytest.mark.parametrize("seed", [0, 7, 1234])
def test_training_streams_are_deterministic_and_never_hold_a_heldout_pair(d, seed):
    train = train_problems(d, seed, 500)
    assert train == train_problems(d, seed, 500)
    assert train[:100] == train_problems(d, seed, 100)  # a prefix of the same stream
    held = {p.key for p in heldout(d)}
    ordered = {(p.a, p.b) for p in heldout(d)} | {(p.b, p.a) for p in heldout(d)}
    assert not {p.key for p in train} & held
    assert not {(p.a, p.b) for p in train} & ordered  # checked by pairs, both orders
    lo, hi = operand_range(d)
    assert all(lo <= p.a <= hi and lo <= p.b <= hi for p in train)


def test_one_digit_training_covers_every_key_that_is_not_held_out():
    keys = {(a, b) for a in range(10) for b in range(a, 10)}
    assert len(keys) == 55
    assert {p.key for p in train_problems(1, 7, 2000)} == keys - {p.key for p in heldout(1)}


def test_seeds_and_difficulties_give_different_streams():
    assert train_problems(2, 7, 50) != train_problems(2, 8, 50)
    assert [(p.a, p.b) for p in train_problems(2, 7, 50)] != [(p.a, p.b) for p in train_problems(3, 7, 50)]


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: heldout(0), "digits"),
        (lambda: heldout(MAX_DIGITS + 1), "digits"),
        (lambda: heldout(True), "digits"),
        (lambda: train_problems(1, 7, 0), "count"),
        (lambda: arith_problems([1], "test"), "split"),
        (lambda: arith_problems([], "train"), "digits"),
    ],
)
def test_bad_values_name_their_field(call, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        call()


# ---- scorer ------------------------------------------------------------------------------------------------------
TABLE = [
    ("8", 8, 1.0),
    (" 8", 8, 1.0),
    ("8.", 8, 1.0),
    ("8<|im_end|>", 8, 1.0),
    ("The answer is 8", 8, 1.0),
    ("The answer is 8.", 8, 1.0),
    ("8\n\nExplanation: 3 + 5 = 8", 8, 1.0),
    ("08", 8, 1.0),
    ("**8**", 8, 1.0),
    ("18", 8, 0.0),
    ("80", 8, 0.0),
    ("-8", 8, 0.0),
    ("8.5", 8, 0.0),
    ("8.0", 8, 0.0),
    ("3 + 5 = 8", 8, 0.0),  # the first integer is 3
    ("eight", 8, 0.0),
    ("", 8, 0.0),
    ("   ", 0, 0.0),
    ("0", 0, 1.0),
    ("-0", 0, 1.0),
    ("198", 198, 1.0),
    ("1,998", 1998, 0.0),  # no thousands separators: the first integer is 1
    ("\u0668", 8, 0.0),  # an Arabic-Indic digit is not an ASCII digit
]


@pytest.mark.parametrize(("completion", "answer", "reward"), TABLE)
def test_scorer_table(completion, answer, reward):
    assert score(completion, answer) == reward


def test_first_integer_table():
    assert first_integer("8.") == 8
    assert first_integer("x-12y") == -12
    assert first_integer("8.5 or 9") is None  # the first number is not an integer: no fallback to the next
    assert first_integer("no digits") is None


@given(
    st.integers(0, 1998),
    st.text(alphabet=st.characters(blacklist_categories=("Nd",), blacklist_characters="-."), max_size=20),
    st.text(max_size=20),
)
def test_the_answer_after_digit_free_text_scores_one_and_any_other_integer_zero(n, before, after):
    tail = "" if not after or not after[0].isdigit() and after[0] != "." else " "
    assert score(f"{before}{n}{tail}{after}", n) == 1.0
    assert score(f"{before}{n + 1}{tail}{after}", n) == 0.0


def test_trl_reward_reads_the_answer_column():
    rewards = arith_reward(["8", "9", "The answer is 8."], answer=[8, 8, 8], prompts=["p"] * 3)
    assert rewards == [1.0, 0.0, 1.0]


# ---- rows --------------------------------------------------------------------------------------------------------
def test_prompt_is_the_chat_template_of_one_user_message_then_the_equation(tiny_model_dir):
    from tokendyn.policy import load_tokenizer

    user = "What is 3 + 5? Answer with the number only."
    assert render_prompt(3, 5) == f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n3 + 5 = "
    tok = load_tokenizer(tiny_model_dir)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )
    assert render_prompt(3, 5, tok) == chat + "3 + 5 = "  # the assistant's turn opened with the equation


def test_dataset_rows():
    train = arith_dataset([1, 2], "train", seed=7, count=20)
    assert len(train) == 40 and train["digits"] == [1] * 20 + [2] * 20
    row = train[25]
    assert row["answer"] == row["a"] + row["b"] and row["question"] in row["prompt"]
    assert row["prompt"] == render_prompt(row["a"], row["b"])
    held = arith_dataset([1, 2], "heldout", count=10)
    assert [(r["a"], r["b"]) for r in held] == [(p.a, p.b) for d in (1, 2) for p in heldout(d)[:10]]
    assert len(arith_dataset([1], "heldout")) == HELDOUT_SIZE[1]


# ---- tokendyn train --task arith ---------------------------------------------------------------------------------
SMALL = ["--task", "arith", "--arith_digits", "1", "2", "--arith_train_problems", "8", "--eval_n", "4"]
SMALL += ["--rollouts", "2", "--eval_steps", "1", "--save_strategy", "no", "--disable_tqdm", "true"]
SMALL += ["--per_device_train_batch_size", "4", "--num_generations", "4", "--steps_per_generation", "1"]


def _main(argv):
    import torch

    from tokendyn.cli import main

    before = torch.get_num_threads()
    try:
        return main(argv)
    finally:
        torch.set_num_threads(before)


def test_train_arith_on_the_embedded_default_writes_records_and_heldout_accuracy(tmp_path):
    import json

    import polars as pl
    import torch

    from tokendyn.policy import load_policy
    from tokendyn.records import shard_files
    from tokendyn.trainers.arith_eval import arith_outcomes

    out = tmp_path / "run"
    assert _main(["train", "--output_dir", str(out), *SMALL, "--probe_every", "1", "--threads", "1"]) == 0
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "finished" and meta["run"]["task"] == "arith"
    assert meta["config"]["max_completion_length"] == 16  # arith's default, not K&K's 264
    m = pl.read_parquet(out / "metrics.parquet")
    train = m.filter(pl.col("loss").is_not_null())
    assert train["step"].to_list() == [1, 2]  # one optimizer step per rollout
    # the accuracy is the reward (logged twice: weight 1 and weight 0)
    assert train["rewards/arith_reward/mean"].to_list() == train["rewards/arith_accuracy/mean"].to_list()
    assert all(0.0 <= r <= 1.0 for r in train["reward"].to_list())
    held = m.filter(pl.col("heldout/accuracy").is_not_null()).sort("step")
    assert held["step"].to_list() == [0, 1, 2]
    for row in held.iter_rows(named=True):
        one, two = row["heldout/accuracy_1digit"], row["heldout/accuracy_2digit"]
        assert row["heldout/accuracy"] == (one + two) / 2
        assert row["heldout/accuracy_1digit"] in {0.0, 0.25, 0.5, 0.75, 1.0}
    assert meta["summary"]["mean_train_accuracy"] is not None
    assert meta["summary"]["last_heldout"]["heldout/accuracy"] == held["heldout/accuracy"][-1]
    assert shard_files(out, "binstats")  # the probe's records of the run
    # the last held-out accuracy is the final policy's, measured again here on the same problems
    model, tok = load_policy(out / "final", dtype=torch.float32)
    rows = arith_outcomes(model, tok, [1, 2], 4, max_new_tokens=16)
    for d in (1, 2):
        again = sum(r["correct"] for r in rows if r["digits"] == d) / 4
        assert again == held[f"heldout/accuracy_{d}digit"][-1]
    # every problem's outcome at every evaluated step, the logged rates their means
    per = pl.read_parquet(out / "heldout.parquet")
    assert per.columns == ["step", "digits", "problem", "correct"] and per.height == 3 * 2 * 4
    for row in held.iter_rows(named=True):
        for d in (1, 2):
            mine = per.filter((pl.col("step") == row["step"]) & (pl.col("digits") == d)).sort("problem")
            assert mine["problem"].to_list() == [0, 1, 2, 3]
            assert mine["correct"].mean() == row[f"heldout/accuracy_{d}digit"]
    final = per.filter(pl.col("step") == 2).sort("digits", "problem")["correct"].to_list()
    assert final == [r["correct"] for r in sorted(rows, key=lambda r: (r["digits"], r["problem"]))]


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--task", "sums"], "task"),
        (["--task", "arith", "--arith_digits", "4"], "arith_digits"),
        (["--task", "arith", "--arith_digits", "1", "1"], "arith_digits"),
        (["--task", "arith", "--arith_eval_digits", "0"], "arith_eval_digits"),
        (["--task", "arith", "--arith_train_problems", "0"], "arith_train_problems"),
        (["--task", "arith", "--eval_n", "201"], "eval_n"),
        (["--eval_n", "101"], "eval_n"),  # K&K's bound unchanged
    ],
)
def test_bad_arith_values_are_one_line_naming_the_field(tmp_path, capsys, flags, field):
    out = tmp_path / "run"
    assert _main(["train", "--output_dir", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err, err
    assert not out.exists()


def test_arith_flags_parse_and_kk_keeps_its_defaults():
    from tokendyn.trainers.train_cli import parse

    run, cfg = parse(["--task", "arith", "--arith_digits", "2", "--max_completion_length", "8"])
    assert run.arith_digits == [2] and cfg.max_completion_length == 8  # an explicit length wins
    run, cfg = parse([])
    assert run.task == "kk" and cfg.max_completion_length == 264
