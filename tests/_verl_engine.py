"""Test helpers around verl's engine on CPU (`tokendyn.integrations.verl.cpu`, re-exported here): a tiny locally
built Qwen2 (`save_tiny_qwen2`), the plain Hugging Face model as the reference (`load_hf_model`,
`hf_response_log_probs`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tokendyn.integrations.verl.cpu import (  # noqa: F401  (re-exported for the tests)
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    CPUPlatform,
    actor_config,
    build_engine,
    build_worker,
    cpu_platform,
    full_parameters,
    infer_log_probs,
    make_batch,
    setup_distributed,
    train_step,
    update_actor,
)

if TYPE_CHECKING:
    from tensordict import TensorDict
    from transformers import PreTrainedModel


def save_tiny_qwen2(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    vocab_size: int = 64,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    max_position_embeddings: int = 128,
) -> Path:
    """A randomly initialised float32 `Qwen2ForCausalLM` (seeded, untied embeddings, sdpa attention) and a
    word-level tokenizer over its ids (``<pad>`` = 0, ``<eos>`` = 1, ``<bos>`` = 2, then ``t3`` ...), both saved
    under `path` with `save_pretrained`. Returns `path`."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=PAD_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        attn_implementation="sdpa",
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)

    special = {"<pad>": PAD_TOKEN_ID, "<eos>": EOS_TOKEN_ID, "<bos>": BOS_TOKEN_ID}
    vocab = {**special, **{f"t{i}": i for i in range(len(special), vocab_size)}}
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<pad>"
    )
    tokenizer.save_pretrained(path)
    return path


def load_hf_model(path: str | os.PathLike, *, attn_implementation: str = "eager") -> PreTrainedModel:
    """The saved model as plain Hugging Face float32 in eval mode (the reference for the engine's numbers)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn_implementation
    ).eval()


def hf_response_log_probs(model: PreTrainedModel, data: TensorDict) -> torch.Tensor:
    """The same response log-probs from a plain Hugging Face model, one sequence at a time with no padding at all
    (the reference for `infer_log_probs`); differentiable, so call it under `torch.no_grad()` when not needed."""
    response_mask = data["response_mask"]
    width = response_mask.shape[1]
    rows = []
    for ids, mask in zip(data["input_ids"].unbind(), response_mask, strict=True):
        n_resp = int(mask.sum())
        logits = model(input_ids=ids.unsqueeze(0)).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)
        rows.append(torch.nn.functional.pad(logp[-n_resp:], (0, width - n_resp)))
    return torch.stack(rows)
