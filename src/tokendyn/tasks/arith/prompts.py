"""The arithmetic prompt: one user message, rendered by the policy's own chat template."""

from __future__ import annotations

QUESTION = "What is {a} + {b}? Answer with the number only."
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
    ChatML string `CHATML` (identical to the embedded default's template)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages(a, b), tokenize=False, add_generation_prompt=True)
    return CHATML.format(content=question(a, b))
