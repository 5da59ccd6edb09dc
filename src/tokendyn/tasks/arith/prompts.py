"""The arithmetic prompt: one user message rendered by the policy's own chat template, and the assistant's turn
pre-filled with the equation (as K&K's prompt pre-fills ``<think>``), so that the completion is the number.

Why the pre-fill: asked "What is 9 + 8? Answer with the number only.", SmolLM2-135M-Instruct mostly restates the
sum ("9 + 8 = 17") or starts explaining; with the turn opened by "9 + 8 = " it answers "17" (docs/arith.md).
"""

from __future__ import annotations

QUESTION = "What is {a} + {b}? Answer with the number only."
ANSWER_PREFIX = "{a} + {b} = "
# what the chat template of a tokenizer without one would be: ChatML, no system message (the embedded default's)
CHATML = "<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


def question(a: int, b: int) -> str:
    """The user message: ``"What is {a} + {b}? Answer with the number only."``."""
    return QUESTION.format(a=a, b=b)


def messages(a: int, b: int) -> list[dict[str, str]]:
    """The conversation: ``[{"role": "user", "content": question(a, b)}]``."""
    return [{"role": "user", "content": question(a, b)}]


def render_prompt(a: int, b: int, tokenizer=None) -> str:
    """The prompt string: ``tokenizer.apply_chat_template(messages(a, b), add_generation_prompt=True)`` as text
    (SmolLM2's template adds its default system message), or, with no tokenizer or one without a chat template, the
    ChatML string `CHATML` (identical to the embedded default's template); then the pre-filled start of the
    assistant's answer, ``"{a} + {b} = "``."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        chat = tokenizer.apply_chat_template(messages(a, b), tokenize=False, add_generation_prompt=True)
    else:
        chat = CHATML.format(content=question(a, b))
    return chat + ANSWER_PREFIX.format(a=a, b=b)
