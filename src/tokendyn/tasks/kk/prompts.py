"""Prompt templates of the official preprocessing (``examples/data_preprocess/kk.py``).

``qwen-instruct`` is the complete, already chat-templated string that the paper's data stores
as the single user message; it is tokenised as raw text (no chat template is applied again)
and the assistant turn is pre-filled with ``<think>``. Quirks kept exactly (both templates): ``and<answer>``
without a space, two spaces before "Now", a newline before each ``<|im_end|>``;
no space in "solves it.The assistant" of ``base``.
"""

from __future__ import annotations

SYSTEM_BLOCK = (
    "<|im_start|>system\nYou are a helpful assistant. The assistant first thinks about the reasoning process "
    "in the mind and then provides the user with the answer. The reasoning process and answer are enclosed "
    "within <think> </think> and<answer> </answer> tags, respectively, i.e., <think> reasoning process here "
    "</think><answer> answer here </answer>.  Now the user asks you to solve a logical reasoning problem. "
    "After thinking, when you finally reach a conclusion, clearly state the identity of each character within "
    "<answer> </answer> tags. i.e., <answer> (1) Zoey is a knight\n(2) ... </answer>.\n<|im_end|>\n"
)

TEMPLATES = {
    "qwen-instruct": SYSTEM_BLOCK + "<|im_start|>user\n{quiz}\n<|im_end|>\n<|im_start|>assistant\n<think>",
    "base": (
        "The user asks a question, and the Assistant solves it.The assistant first thinks about the reasoning "
        "process in the mind and then provides the user with the final answer. The reasoning process and answer "
        "are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning "
        "process here </think><answer> answer here </answer>. Now the user asks you to solve a logical reasoning "
        "problem. After thinking, when you finally reach a conclusion, clearly state the identity of each "
        "character within <answer> </answer> tags. List the identity of each person one by one, for example, "
        "<answer> (1) Zoey is a knight\n(2) Oliver is a knight\n(3)... </answer>.\n\nUser:{quiz}\nAssistant: <think>"
    ),
}


def render_prompt(quiz: str, template: str = "qwen-instruct") -> str:
    """The prompt string for ``quiz``; ``template`` is one of :data:`TEMPLATES`."""
    if template not in TEMPLATES:
        raise ValueError(f"template: must be one of {sorted(TEMPLATES)}, got {template!r}")
    return TEMPLATES[template].format(quiz=quiz)
