"""Nothing the probe turns on by default changes training, through the configuration matrix: on every architecture
of `_matrix` (llama, mistral, qwen2, qwen3, gemma, gemma2, phi, gpt2, OPT pre-LN / post-LN with and without
`project_out`), each with every dropout its config has at 0.1 (transformers' GPT-2 default; a LoRA's dropout too),
under every dtype (float32; bf16 autocast, the GPU recipe; bf16 weights), adapter (full; LoRA) and accumulation mode
(one micro-batch; two), and both objectives (GRPO; Lopti, two stages per rollout), a run of TRL's trainer with every
default-on feature (the probe, the noise floor, every analysis, the paired comparison, the token view, the sampler
records, the rollout dumps) ends with every parameter equal bit for bit to the probe-off run's.

The cells (`cells`): every architecture x dtype pair once; along them the adapter, the accumulation and the objective
rotate, so that each value of each meets every architecture and every dtype. One cell per architecture runs in
`make test`; the other 24 are the slow tier (marker ``matrix_extra``; `.ci/run` runs them). The same comparison's
first two cells, and why one extra RNG draw would show: tests/test_defaults_bitwise.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from _matrix import ARCHS, DTYPES, build
from _sampler import rollout_sampler
from test_defaults_bitwise import ALL_ON, KINDS, MAX_COMPLETION, PROMPTS, _max_diff
from test_trainer import TEMPERATURE, _config, vowel_reward
from transformers import PreTrainedTokenizerFast

from tokendyn.trainers.grpo import TokendynGRPOTrainer

torch.set_num_threads(1)
DROPOUT = 0.1


def cells() -> list:
    """(arch, dtype, adapter, micro, objective) for every architecture x dtype pair: the three binary axes take
    (0,0,1), (1,1,0), (0,1,0), rotated by the pair and complemented on every other architecture; the first dtype of
    each architecture's rotation runs in `make test`, the other two under ``matrix_extra``."""
    base = ((0, 0, 1), (1, 1, 0), (0, 1, 0))
    axes = (("full", "lora"), ("one", "accumulate"), ("grpo", "lopti"))
    out = []
    for a, arch in enumerate(ARCHS):
        for k in range(len(DTYPES)):
            d = (a + k) % len(DTYPES)
            bits = [b ^ (a % 2) for b in base[(a + d) % 3]]
            values = (arch, DTYPES[d], *(axis[b] for axis, b in zip(axes, bits, strict=True)))
            marks = () if k == 0 else (pytest.mark.matrix_extra,)
            out.append(pytest.param(*values, id="-".join(values), marks=marks))
    return out


@pytest.fixture(scope="module")
def arch_dirs(tiny_model_dir, tmp_path_factory):
    """Each architecture saved once, with the suite's tokenizer (its vocabulary and special tokens) and dropout."""
    tok = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    saved = {}

    def get(arch: str):
        if arch not in saved:
            ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
            model = build(arch, vocab=len(tok), dropout=DROPOUT, **ids)
            saved[arch] = tmp_path_factory.mktemp(f"dropout_{arch}")
            model.save_pretrained(saved[arch])
            tok.save_pretrained(saved[arch])
        return saved[arch]

    return get


def _train(model_dir, out, dtype: str, adapter: str, micro: str, objective: str, **probe) -> dict:
    """Three optimizer steps of one cell (Lopti: a rollout's two stages, then the next rollout's first); the final
    trainable parameters by name (a LoRA's adapters)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    extra = {}
    if adapter == "lora":
        peft = pytest.importorskip("peft")
        extra["peft_config"] = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=DROPOUT
        )
    args = _config(
        out,
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2 if micro == "accumulate" else 1,
        max_completion_length=MAX_COMPLETION,
        bf16=dtype == "bf16_autocast",
        **({"lopti_eta": 0.5} if objective == "lopti" else {}),
        **probe,
    )
    weights = torch.bfloat16 if dtype == "bf16" else torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (GPT-2's Conv1D under LoRA: fan_in_fan_out is set for it)
        trainer = TokendynGRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=weights),
            reward_funcs=vowel_reward,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir),
            rollout_func=rollout_sampler(TEMPERATURE, MAX_COMPLETION),
            **extra,
        )
        trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(("arch", "dtype", "adapter", "micro", "objective"), cells())
def test_every_default_on_feature_trains_bit_for_bit_as_the_probe_off(
    arch, dtype, adapter, micro, objective, arch_dirs, tmp_path
):
    cell = (dtype, adapter, micro, objective)
    off = _train(arch_dirs(arch), tmp_path / "off", *cell, probe_every=0)
    on = _train(arch_dirs(arch), tmp_path / "on", *cell, **ALL_ON)
    kinds = {p.name.split("-")[0] for p in (tmp_path / "on" / "run" / "records").glob("*.parquet")}
    assert KINDS <= kinds, f"no records of {sorted(KINDS - kinds)}"  # each feature ran
    assert off.keys() == on.keys() and off
    # the run trained: a LoRA's B matrices start at 0, full fine-tuning's weights at the saved ones
    start = {} if adapter == "lora" else _initial(arch_dirs(arch), dtype)
    moved = [
        n
        for n, w in off.items()
        if ("lora_B" in n and w.any()) or (n in start and not torch.equal(w, start[n]))
    ]
    assert moved, "the probe-off run did not train"
    assert all(torch.equal(off[n], on[n]) for n in off), (
        f"max |dweight| {_max_diff(list(off.values()), list(on.values())):.3g} with every default-on feature"
    )


def _initial(model_dir, dtype: str) -> dict:
    """The saved parameters by name, in the cell's weight dtype."""
    from transformers import AutoModelForCausalLM

    weights = torch.bfloat16 if dtype == "bf16" else torch.float32
    return dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=weights).named_parameters())
