"""Resuming a model whose LM head is tied to its input embeddings: the checkpoint holds the tied matrix once, and the
resume says nothing about a missing key; a key the checkpoint really lacks is still reported."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from tokendyn.trainers.runner import train
from tokendyn.trainers.train_cli import parse

torch.set_num_threads(1)
MISSING = "missing keys"


def vowel_reward(completions, **kwargs):
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


@pytest.fixture(scope="module")
def tied_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Qwen2 of conftest with ``tie_word_embeddings=True`` (lm_head.weight is the embedding matrix)."""
    out = tmp_path_factory.mktemp("tied_qwen2")
    config = Qwen2Config.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(out)
    PreTrainedTokenizerFast.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def _argv(model_dir, out) -> list[str]:
    argv = ["--model_name_or_path", str(model_dir), "--output_dir", str(out), "--people", "3"]
    argv += ["--train_puzzles_per_size", "4", "--eval_n", "0", "--rollouts", "2", "--save_steps", "1"]
    argv += ["--per_device_train_batch_size", "4", "--num_generations", "4", "--steps_per_generation", "1"]
    argv += ["--max_completion_length", "4", "--temperature", "1.0", "--disable_tqdm", "true"]
    return argv


def _run(argv) -> None:
    train(*parse(argv), progress=False, reward=vowel_reward)


def _resume(out, caplog) -> list[str]:
    """Resume ``out`` from checkpoint-1 and return the messages it logged about missing keys (transformers' logger:
    what the user sees on stderr)."""
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _run([*_argv(out.parent / "model", out), "--resume_from_checkpoint", str(out / "checkpoint-1")])
    return [r.getMessage() for r in caplog.records if MISSING in r.getMessage()]


def test_resume_reports_only_keys_that_are_really_missing(tied_model_dir, tmp_path, caplog):
    shutil.copytree(tied_model_dir, tmp_path / "model")
    out = tmp_path / "run"
    _run(_argv(tmp_path / "model", out))
    saved = out / "checkpoint-1" / "model.safetensors"
    weights = load_file(saved)
    assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights  # stored once

    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    assert _resume(out, caplog) == []

    # a checkpoint that really lacks a tensor (the final norm's weight): reported, by name
    weights.pop("model.norm.weight")
    save_file(weights, broken / "checkpoint-1" / "model.safetensors", metadata={"format": "pt"})
    messages = _resume(broken, caplog)
    assert len(messages) == 1 and "model.norm.weight" in messages[0], messages
    assert "lm_head.weight" not in messages[0]
