"""Shared test fixtures: a real, tiny, locally built Qwen2 policy and its tokenizer (no network); and no test leaves a
process group or a distributed launch's environment behind for the next test in the same worker (verl's engine
runs in process on a one-rank gloo group: Accelerate would then wrap a later TRL trainer in DDP)."""

from __future__ import annotations

import os

import pytest
import torch
import trl  # noqa: F401  (lazy: before tokendyn, so this process keeps TRL's vLLM)

# the suite's subprocesses (torchrun ranks, CLI runs, verl's workers) sample with generate: TRL need not import vLLM
# in each of them (`tokendyn/trainers/__init__.py`); the in-process vLLM tests are unaffected (TRL imported first)
os.environ["TOKENDYN_NO_VLLM"] = "1"

TINY_CORPUS = [
    "A very special island is inhabited only by knights and knaves.",
    "Knights always tell the truth, and knaves always lie.",
    "You meet 3 inhabitants: Zoey, Oliver and Emma.",
    "Zoey says that Oliver is a knave. Oliver says that Emma is a knight.",
    "<think> Assume Zoey is a knight, then Oliver is a knave. </think>",
    "<answer> (1) Zoey is a knight (2) Oliver is a knave (3) Emma is a knight </answer>",
    "the quick brown fox jumps over the lazy dog 0 1 2 3 4 5 6 7 8 9",
    "count: one two three four five six seven eight nine ten",
]


def _train_tokenizer(out_dir):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TINY_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(out_dir)
    return fast


LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_distributed_leftovers():
    import os

    import torch.distributed as dist

    had_group = dist.is_available() and dist.is_initialized()
    env = {key: os.environ.get(key) for key in LAUNCH_ENV}
    yield
    if not had_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A directory with a saved random ``Qwen2ForCausalLM`` (hidden 48, 2 layers) and its BPE tokenizer
    (``<|endoftext|>`` pad, ``<|im_end|>`` eos). The LM head is scaled up so that sampled-token probabilities (T=0.7)
    spread over (0, 1), about half of them >= 0.5, instead of sitting near 1/V. Load the tokenizer with ``PreTrainedTokenizerFast.from_pretrained``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("tiny_qwen2")
    tok = _train_tokenizer(out)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)
    # sharpen: pi of sampled tokens spreads over (0, 1); ~40% of completions end with eos
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
        model.lm_head.weight[tok.eos_token_id].mul_(1.5)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def gpt2_dir(tiny_model_dir, tmp_path_factory):
    """A random tiny GPT-2 (2 layers, hidden 32) with transformers' default dropouts, conftest's tokenizer, its
    (untied) head scaled so that the sampled tokens' pi spreads over (0, 1) (both Lopti groups hold tokens)."""
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny_gpt2_dropout")
    tok = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tok),
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        tie_word_embeddings=False,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def pytest_terminal_summary(terminalreporter):
    """Say plainly when the browser test did not run (no Chromium or no Playwright here)."""
    skipped = [
        r for r in terminalreporter.stats.get("skipped", []) if "test_browser.py" in getattr(r, "nodeid", "")
    ]
    if skipped:
        reason = (
            skipped[0].longrepr[-1] if isinstance(skipped[0].longrepr, tuple) else str(skipped[0].longrepr)
        )
        terminalreporter.write_line(
            f"browser tests: NOT RUN ({len(skipped)} skipped): {reason.removeprefix('Skipped: ')}",
            yellow=True,
        )
