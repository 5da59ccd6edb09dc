"""tokendyn's Hugging Face rollout server as a bf16 sampler (verl's ``rollout.dtype=bfloat16``): the server holds the
embedded default policy in bfloat16, and its log-probs are the bf16 model's own (its cached decoding, written out
here), differing from the float32 model's as a bf16 engine's do."""

from __future__ import annotations

import asyncio

import pytest
import torch
from omegaconf import OmegaConf

from tokendyn.integrations import verl as glue
from tokendyn.integrations.verl.hf_rollout import HFRolloutServer
from tokendyn.policy import default_policy_dir

glue.register()
T = 0.7
PROMPTS = [[5, 17, 33, 8, 91], [12, 40, 7, 66], [23, 9, 81, 30, 44, 3]]


def server(dtype: str | None, length: int) -> HFRolloutServer:
    fields = {"response_length": length, "seed": 3, **({"dtype": dtype} if dtype else {})}
    threads = torch.get_num_threads()
    try:
        return HFRolloutServer(OmegaConf.create(fields), str(default_policy_dir()))
    finally:
        torch.set_num_threads(threads)


def sample(srv: HFRolloutServer, prompt: list[int], temperature: float = T):
    params = {"temperature": temperature, "top_p": 1.0, "top_k": -1, "logprobs": True}
    threads = torch.get_num_threads()
    try:
        return asyncio.run(srv.generate(prompt_ids=prompt, sampling_params=params, request_id="r"))
    finally:
        torch.set_num_threads(threads)


def cached_decoding_log_probs(
    model, prompt: list[int], tokens: list[int], temperature: float
) -> torch.Tensor:
    """log softmax(z_t / T)[o_t] from the model's forward over the prompt, then one token at a time on its KV cache
    (how a sampler scores what it samples), the logits cast to float32 first."""
    from transformers import DynamicCache

    out, logp = None, []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), past_key_values=DynamicCache(), use_cache=True)
        for token in tokens:
            logp.append(torch.log_softmax(out.logits[0, -1].float() / temperature, -1)[token])
            out = model(
                input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True
            )
    return torch.stack(logp)


def test_the_hf_rollout_in_bf16_samples_and_scores_with_the_bf16_model():
    """``rollout.dtype=bfloat16``: the server holds the model in bf16 (also after a weight sync of float32
    tensors), and its log-probs are the bf16 model's own at T (its cached decoding: exactly), not the float32
    model's: a mean |difference| from a float32 forward like a bf16 engine's (MISMATCH.md: 3.8e-2 on
    SmolLM2-135M), where float32 on both sides gives ~1e-7."""
    from transformers import AutoModelForCausalLM

    path = str(default_policy_dir())
    srv = server("bfloat16", length=24)
    assert srv.model.dtype == torch.bfloat16
    bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    diffs = []
    for prompt in PROMPTS:
        out = sample(srv, prompt)
        got = torch.tensor(out.log_probs)
        torch.testing.assert_close(
            got, cached_decoding_log_probs(bf16, prompt, out.token_ids, T), rtol=0, atol=1e-6
        )
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            z = fp32(input_ids=ids).logits[0, len(prompt) - 1 : -1] / T
        diffs.append(got - torch.log_softmax(z, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0])
    mismatch = torch.cat(diffs).abs()
    print(f"bf16 server vs float32 model: mean |dlogp| {mismatch.mean():.2e}, max {mismatch.max():.2e}")
    assert 1e-3 < float(mismatch.mean()) < 0.1
    state = {n: p.detach() * 0.5 for n, p in fp32.named_parameters()}
    srv.update_weights(state)
    norm = srv.model.get_parameter("model.norm.weight")
    assert norm.dtype == torch.bfloat16 and torch.equal(norm, state["model.norm.weight"].to(torch.bfloat16))


def test_a_rollout_dtype_outside_the_list_fails_in_one_line():
    from tokendyn.integrations.verl.hf_rollout import rollout_dtype

    assert rollout_dtype(OmegaConf.create({"dtype": "bf16"})) is torch.bfloat16
    assert rollout_dtype(OmegaConf.create({})) is torch.float32
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.dtype: .* got 'int8'") as err:
        rollout_dtype(OmegaConf.create({"dtype": "int8"}))
    assert "\n" not in str(err.value)
