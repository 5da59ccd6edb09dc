"""The K&K reward, rule for rule as the official scorer (AR-Lopti ``verl/utils/reward_score/kk.py``).

Totals: 3 (format valid, every role right), -0.5 (valid, parses, some role wrong), -1 (valid,
answer empty or unparseable), -3 (format invalid). Accuracy means reward == 3. The scorer reads
the decoded ``prompt + response`` string (the prompt pre-fills ``<think>``), ``docs/kk.md`` §3.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

FORMAT_REWARD = 1.0
ANSWER_CORRECT, ANSWER_WRONG, ANSWER_UNPARSEABLE = 2.0, -1.5, -2.0
MAX_SCORE = FORMAT_REWARD + ANSWER_CORRECT

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_GT_LINE_RE = re.compile(r"\b([A-Za-z]+)\b.*?\b(knight|knave)\b", re.IGNORECASE)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


@dataclass(frozen=True)
class Score:
    """One scored response: the total and its two parts."""

    total: float
    format_ok: bool
    answer: str | None
    parsed: dict[str, str] | None

    @property
    def correct(self) -> bool:
        return self.total == MAX_SCORE


def extract_solution(solution_str: str) -> tuple[str | None, str]:
    """(answer, processed text): the text after the first "Assistant:" or else after
    "<|im_start|>assistant" (else the whole string and no answer); the answer is the last
    non-greedy ``<answer>(.*?)</answer>`` match, stripped."""
    if "Assistant:" in solution_str:
        processed = solution_str.split("Assistant:", 1)[1]
    elif "<|im_start|>assistant" in solution_str:
        processed = solution_str.split("<|im_start|>assistant", 1)[1]
    else:
        return None, solution_str
    matches = list(_ANSWER_RE.finditer(processed))
    if not matches:
        return None, processed
    return matches[-1].group(1).strip(), processed


def parse_ground_truth(solution_text_format: str) -> dict[str, str]:
    """{name: "knight"|"knave"} from lines such as "(1) Amelia is a knight"."""
    status: dict[str, str] = {}
    for line in solution_text_format.split("\n"):
        m = _GT_LINE_RE.search(line.strip())
        if m:
            status[m.group(1)] = m.group(2).lower()
    return status


def validate_structure(processed: str) -> bool:
    """Each of <think>, </think>, <answer>, </answer> exactly once, first positions in that order."""
    if any(processed.count(tag) != 1 for tag in _TAGS):
        return False
    pos = [processed.find(tag) for tag in _TAGS]
    return pos[0] <= pos[1] <= pos[2] <= pos[3]


def parse_answer(answer: str, expected_names: Sequence[str]) -> dict[str, str] | None:
    """Roles from the answer text, or None when it does not parse: the count of "knight" plus
    "knave" substrings (any case) must equal N, and every name must match
    ``\\bNAME\\b\\s+is\\s+a\\s+\\b(knight|knave)\\b`` (first match, any case)."""
    low = answer.lower()
    if low.count("knight") + low.count("knave") != len(expected_names):
        return None
    status: dict[str, str] = {}
    for name in expected_names:
        m = re.search(rf"\b{re.escape(name)}\b\s+is\s+a\s+\b(knight|knave)\b", answer, re.IGNORECASE)
        if m is None:
            return None
        status[name] = m.group(1).lower()
    return status


def compute_score(solution_str: str, ground_truth: str | Mapping[str, str]) -> Score:
    """Score the decoded ``prompt + response`` against ``solution_text_format`` (or the
    official ground-truth dict holding it)."""
    gt_text = ground_truth["solution_text_format"] if isinstance(ground_truth, Mapping) else ground_truth
    expected = parse_ground_truth(gt_text)
    answer, processed = extract_solution(solution_str)
    format_ok = validate_structure(processed)
    format_score = FORMAT_REWARD if format_ok else -abs(FORMAT_REWARD)
    parsed = None
    if format_ok and answer:
        parsed = parse_answer(answer, list(expected))
        if parsed:
            answer_score = ANSWER_CORRECT if parsed == expected else ANSWER_WRONG
        else:
            answer_score = ANSWER_UNPARSEABLE
    else:
        answer_score = ANSWER_UNPARSEABLE
    return Score(format_score + answer_score, format_ok, answer, parsed)


def score(prompt: str, response: str, ground_truth: str | Mapping[str, str]) -> float:
    """The official total for ``response`` appended to ``prompt``."""
    return compute_score(prompt + response, ground_truth).total


def kk_reward(
    prompts: Sequence[str], completions: Sequence[str], ground_truth: Sequence[str], **_
) -> list[float]:
    """TRL reward function: ``reward_funcs=[kk_reward]`` with a dataset holding a
    ``ground_truth`` column (``solution_text_format``) and raw-text prompts."""
    return [score(p, c, g) for p, c, g in zip(prompts, completions, ground_truth, strict=True)]
