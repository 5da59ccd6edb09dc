"""Held-out evaluation of a policy on the arithmetic task: one row per (difficulty, problem, sample), greedy or
sampled, scored by the task's exact reward; Wilson intervals for the rates."""

from __future__ import annotations

import math

# the answer is a few tokens: the default length of an arithmetic completion (training and evaluation)
ARITH_MAX_NEW_TOKENS = 16


def arith_outcomes(
    model,
    tokenizer,
    digits: list[int],
    n: int,
    temperature: float | None = None,
    samples: int = 1,
    max_new_tokens: int = ARITH_MAX_NEW_TOKENS,
    seed: int = 0,
    batch_size: int = 64,
) -> list[dict]:
    """The first ``min(n, split size)`` held-out problems of each difficulty, each answered ``samples`` times
    (greedy: ``temperature`` None, then ``samples`` must be 1), ``max_new_tokens`` at most: rows {"digits",
    "problem" (index in the split), "sample", "a", "b", "completion", "correct" (the reward, 0 or 1)}."""
    from ..tasks.arith.generator import heldout
    from ..tasks.arith.prompts import render_prompt
    from ..tasks.arith.reward import score
    from .evaluate import generate

    if temperature is None and samples != 1:
        raise ValueError(f"samples: greedy decoding gives one answer per problem, got samples={samples}")
    rows = []
    for d in digits:
        items = list(heldout(d))[:n]
        prompts = [render_prompt(p.a, p.b, tokenizer) for p in items for _ in range(samples)]
        texts, _ = generate(model, tokenizer, prompts, max_new_tokens, temperature, batch_size, seed)
        for k, text in enumerate(texts):
            p = items[k // samples]
            rows.append(
                {
                    "digits": d,
                    "problem": k // samples,
                    "sample": k % samples,
                    "a": p.a,
                    "b": p.b,
                    "completion": text,
                    "correct": score(text, p.answer),
                }
            )
    return rows


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a binomial rate at ``z`` (95 % by default): (centre ± half) / (1 + z²/n) with
    centre = p̂ + z²/2n, half = z·sqrt(p̂(1-p̂)/n + z²/4n²); (0, 1) when n = 0."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (max(0.0, (centre - half) / denom), min(1.0, (centre + half) / denom))
