"""The policy: a tokenizer trained on the task's text, a small Qwen2 built from a config, and
one loader for it and for any Hugging Face causal LM.

The tokenizer keeps the official prompt string unchanged: the chat markup tokens are special,
the ``<think>``/``<answer>`` tags and the constant system block are added (non-special) tokens,
so decoding, even with ``skip_special_tokens=True`` as TRL does, gives back the text the
official reward reads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

PAD, BOS_CHAT, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TAGS = ("<think>", "</think>", "<answer>", "</answer>")
MARKER = "tokendyn.json"  # written next to a tokendyn-built policy


@dataclass(frozen=True)
class ModelPreset:
    """Architecture of a warm-start policy (a ``Qwen2Config``)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int = 1024
    vocab_size: int = 1024  # BPE target; the trained vocabulary may be smaller


def train_tokenizer(texts: Iterable[str], vocab_size: int, system_block: str):
    """Byte-level BPE on ``texts``; returns a ``PreTrainedTokenizerFast`` (left padding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS_CHAT, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (*TAGS, system_block)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=None,
        padding_side="left",
        model_max_length=1024,
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return fast


def build_model(preset: ModelPreset, tokenizer, seed: int):
    """A freshly initialised ``Qwen2ForCausalLM`` (tied embeddings, fp32)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS_CHAT),
        attn_implementation="sdpa",
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(cfg)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_policy(model, tokenizer, out_dir: str | os.PathLike, meta: dict) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / MARKER).write_text(json.dumps(meta, indent=2, default=lambda o: asdict(o)) + "\n")
    return out


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of a policy directory or hub id.

    A tokendyn-built folder is loaded with ``PreTrainedTokenizerFast`` (``AutoTokenizer`` would
    swap in Qwen2's pre-tokenizer and change the ids); anything else with
    ``AutoTokenizer``.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (Path(path) / MARKER).is_file():
        tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    else:
        tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def check_model_source(path: str | os.PathLike, field: str = "model"):
    """The model's config (no weights loaded), or a ValueError naming ``field``: a local directory must exist and
    hold config.json; a packaged model's name or a .gguf file is its converted directory (`tokendyn.packaged`);
    anything else is taken as a hub id and must be resolvable, a bare one (no ``owner/``) only from the local
    Hugging Face cache (a typo fails at once instead of retrying the network)."""
    import re

    from transformers import AutoConfig

    from tokendyn.packaged import PACKAGED, is_model_source, resolve

    if is_model_source(str(path)):
        path = resolve(path, field)  # a packaged model or a .gguf file: its converted directory
    text = str(path)
    p = Path(text).expanduser()
    looks_local = p.exists() or text.startswith((".", "/", "~", os.sep)) or text.count("/") > 1
    if looks_local:
        if not p.exists():
            raise ValueError(f"{field}: {text!r} does not exist (give a model directory or a hub id)")
        if not (p / "config.json").is_file():
            raise ValueError(f"{field}: {text!r} holds no config.json (not a model directory)")
    elif not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", text):
        raise ValueError(f"{field}: {text!r} is neither a local directory nor a hub id (org/name)")
    elif "/" not in text and not _in_hub_cache(text):
        # a bare name (no owner) that is not downloaded: most likely a typo, and asking the hub for it would retry
        # the network for half a minute where there is none (legacy bare ids such as gpt2 have an owner/name form)
        raise ValueError(
            f"{field}: {text!r} is neither a local directory, a .gguf file, a packaged model "
            f"({', '.join(PACKAGED)}) nor a hub id (owner/name)"
        )
    try:
        return AutoConfig.from_pretrained(str(p) if looks_local else text)
    except (OSError, ValueError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{field}: cannot read the model config of {text!r} ({first})") from None


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the hub model ``repo_id`` has its config.json in the local Hugging Face cache (no network)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


def load_policy(path: str | os.PathLike | None = None, dtype=None, attn_implementation: str | None = None):
    """(model, tokenizer) from a directory, a hub id, a packaged model's name (``smollm2-135m``) or a ``.gguf`` file
    (`tokendyn.packaged`); ``None`` means the embedded default."""
    from transformers import AutoModelForCausalLM

    from tokendyn.packaged import resolve

    path = default_policy_dir() if path is None else resolve(path)
    kwargs = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    tok = load_tokenizer(path)
    if (Path(path) / MARKER).is_file() and tok.bos_token_id is None:
        # a tokendyn-built policy's tokenizer has no BOS token (its config names the chat's): set here what
        # transformers' Trainer would set, and warn about, when it aligns the model with the tokenizer
        model.config.bos_token_id = None
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.bos_token_id = None
    return model, tok


EMBEDDED_DIR = Path(__file__).parent / "default_policy"


def default_policy_dir() -> Path:
    """The embedded default policy shipped as package data (``tokendyn warmstart --preset cpu --seed 1``)."""
    if not (EMBEDDED_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the embedded default policy is missing from {EMBEDDED_DIR}; "
            "rebuild it with `tokendyn warmstart --preset cpu --seed 1 --out DIR` and pass --model DIR"
        )
    return EMBEDDED_DIR
