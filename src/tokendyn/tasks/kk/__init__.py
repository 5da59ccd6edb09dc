"""Knights-and-Knaves: the official generator, prompts, reward and data sets."""

from .datasets import fresh_puzzles, heldout, kk_dataset, official_split, puzzles
from .prompts import render_prompt
from .reward import compute_score, kk_reward, score

__all__ = [
    "compute_score",
    "fresh_puzzles",
    "heldout",
    "kk_dataset",
    "kk_reward",
    "official_split",
    "puzzles",
    "render_prompt",
    "score",
]
