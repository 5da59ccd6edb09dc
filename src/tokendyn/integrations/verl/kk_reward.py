"""The K&K reward as a verl reward function (``reward.custom_reward_function.path=<this file>``, name
``compute_score``), for a ``main_ppo`` run on K&K rows in verl's format (``tokendyn kk generate``).

verl's reward manager hands the function the decoded response alone; the official scorer reads the decoded prompt +
response and looks only past the prompt's last ``<|im_start|>assistant`` (the ``qwen-instruct`` prompt ends with
that header and a pre-filled ``<think>``), so the response is scored after that tail: the same total, 3 / -0.5 /
-1 / -3, as `tokendyn.tasks.kk.reward.score` on the whole string.
"""

from __future__ import annotations

from tokendyn.tasks.kk.prompts import TEMPLATES
from tokendyn.tasks.kk.reward import score

ASSISTANT = "<|im_start|>assistant"
PROMPT_TAIL = ASSISTANT + TEMPLATES["qwen-instruct"].rsplit(ASSISTANT, 1)[1]


def compute_score(data_source, solution_str: str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl's reward-function signature: the official K&K total of `solution_str` (a response to a
    ``qwen-instruct`` prompt) against `ground_truth` (``solution_text_format`` or the dict holding it)."""
    return score(PROMPT_TAIL, solution_str, ground_truth)
