"""The reward, rule for rule as the official scorer: the edge cases of docs/kk.md §3."""

import json

import pytest

from tokendyn.cli import main
from tokendyn.tasks.kk.datasets import official_split
from tokendyn.tasks.kk.prompts import render_prompt
from tokendyn.tasks.kk.reward import compute_score, score

PUZZLE = official_split(3, "test")[0]  # Amelia knight, Penelope knight, Evelyn knave
PROMPT = render_prompt(PUZZLE.quiz)
GT = PUZZLE.solution_text_format
RIGHT = "(1) Amelia is a knight\n(2) Penelope is a knight\n(3) Evelyn is a knave"


def r(response: str) -> float:
    return score(PROMPT, response, GT)


@pytest.mark.parametrize(
    "response, expected",
    [
        (f"reasoning</think><answer>{RIGHT}</answer><|im_end|>", 3),
        ("x</think><answer>evelyn IS a   knave, AMELIA is a knight, penelope is  a knight</answer>", 3),
        (f"x</think><answer>{RIGHT}</answer> and then some text<|im_end|>", 3),
        (f"<think>x</think><answer>{RIGHT}</answer>", -3),  # writes <think> itself: 2x <think>
        (f"x</think><answer>{RIGHT.replace('Evelyn is a knave', 'Evelyn is a knight')}</answer>", -0.5),
        (
            "x</think><answer>(1) Amelia is a knave\n(2) Penelope is a knave\n(3) Evelyn is a knight</answer>",
            -0.5,
        ),
        (f"x</think><answer>{RIGHT}\nKnights tell the truth.</answer>", -1),  # role-word count != N
        ("x</think><answer>(1) Amelia is a knight\n(2) Penelope is a knight</answer>", -1),  # one missing
        ("x</think><answer>Amelia is a knight, Penelope is a knight, Evelyn is not a knave</answer>", -1),
        ("x</think><answer></answer>", -1),  # empty answer
        ("x</think><answer>Amelia is a knight, Amelia is a knight, Evelyn is a knave</answer>", -1),
        (f"x</think><answer>{RIGHT}</answer><answer>{RIGHT}</answer>", -3),  # two answer blocks
        (f"x<answer>{RIGHT}</answer>", -3),  # missing </think>
        (f"x<answer>{RIGHT}</answer></think>", -3),  # <answer> before </think>
        (f"x</think><answer>{RIGHT}", -3),  # truncated
        (f"Assistant: x</think><answer>{RIGHT}</answer>", -3),  # literal "Assistant:"
    ],
)
def test_official_edge_cases(response, expected):
    assert r(response) == expected


def test_names_match_on_word_boundaries():
    # "Ella" must not match inside "Isabella"
    gt = "(1) Isabella is a knight\n(2) Ella is a knave"
    prompt = "<|im_start|>assistant\n<think>"
    assert score(prompt, "x</think><answer>Isabella is a knight, Ella is a knave</answer>", gt) == 3
    assert score(prompt, "x</think><answer>Isabella is a knight, Isabella is a knave</answer>", gt) == -1


def test_official_ground_truth_dict_and_parts():
    s = compute_score(
        PROMPT + f"x</think><answer>{RIGHT}</answer>", {"solution_text_format": GT, "statements": ""}
    )
    assert (s.total, s.format_ok, s.correct) == (3, True, True)
    assert s.parsed == {"Amelia": "knight", "Penelope": "knight", "Evelyn": "knave"}


def test_cli_score(tmp_path, capsys):
    rows = [
        {"prompt": PROMPT, "ground_truth": GT, "response": f"x</think><answer>{RIGHT}</answer>"},
        {
            "prompt": [{"content": PROMPT, "role": "user"}],
            "reward_model": {"ground_truth": {"solution_text_format": GT}},
            "response": "no tags",
        },
    ]
    inp = tmp_path / "rows.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in rows))
    assert main(["kk", "score", "--input", str(inp)]) == 0
    out = [json.loads(line) for line in (tmp_path / "rows.scores.jsonl").read_text().splitlines()]
    assert [o["reward"] for o in out] == [3, -3]
    assert "mean reward 0.000, accuracy 50.0%" in capsys.readouterr().out


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "input line 1: not valid JSON"),
        (json.dumps({"prompt": "p", "ground_truth": "g"}), "input line 1: field 'response' must be a string"),
        (json.dumps({"prompt": 3, "ground_truth": "g", "response": "r"}), "field 'prompt' must be a string"),
        (json.dumps([1, 2]), "input line 1: expected a JSON object"),
    ],
)
def test_cli_score_rejects_malformed_rows(line, message, tmp_path, capsys):
    inp = tmp_path / "bad.jsonl"
    inp.write_text(line + "\n")
    assert main(["kk", "score", "--input", str(inp)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bad.scores.jsonl").exists()
