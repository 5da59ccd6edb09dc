"""Addition a + b: seeded generator with fixed held-out splits per difficulty, chat prompt, exact reward."""

from .datasets import arith_dataset, arith_problems, trl_rows
from .generator import HELDOUT_SIZE, Problem, heldout, train_problems
from .prompts import render_prompt
from .reward import arith_accuracy, arith_reward, first_integer, score

__all__ = [
    "HELDOUT_SIZE",
    "Problem",
    "arith_accuracy",
    "arith_dataset",
    "arith_problems",
    "arith_reward",
    "first_integer",
    "heldout",
    "render_prompt",
    "score",
    "train_problems",
    "trl_rows",
]
