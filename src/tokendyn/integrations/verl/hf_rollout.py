"""A Hugging Face ``generate`` rollout for verl 0.9 (``actor_rollout_ref.rollout.name=hf``): for a laptop, CI, or a
first try of tokendyn's plugin before a GPU run, where verl's own rollouts (vLLM, SGLang, TensorRT-LLM) need GPUs.
Registered by `backend.register_backend` through verl's rollout extension points (``docs/extend_guide.rst``).

Three parts, as verl's server rollouts have:

- `HFRolloutServer`, one Ray actor per rollout replica holding the model (in verl's ``rollout.dtype``, SDPA
  attention, one torch thread): ``async generate(prompt_ids, sampling_params, request_id, ...) -> TokenOutput``
  samples a response with ``model.generate`` (temperature, top-k, top-p as verl's agent loop sends them, at most
  ``rollout.response_length`` tokens, stopping at the generation config's EOS; each request seeded from the rollout
  seed, the prompt and its repeat count, so the responses do not depend on the order requests arrive in) and
  returns each sampled token's log-probability under the temperature-scaled logits, log softmax(z / T)[o_t]
  (unfiltered by top-k / top-p), the quantity verl's actor recomputes as ``old_log_probs``
  (``rollout.calculate_log_probs=True`` puts both in verl's ``training/rollout_probs_diff_*`` metrics); the memory
  hooks (wake_up, sleep, kv-cache) do nothing; `update_weights` loads a state dict (cast to the server's dtype).

The dtype is verl's own ``actor_rollout_ref.rollout.dtype`` (the field verl's vLLM and SGLang servers read; verl's
default ``bfloat16``; ``float32`` / ``fp32``, ``bfloat16`` / ``bf16``, ``float16`` / ``fp16``): the model is held,
sampled and scored in it, as vLLM holds a float32 checkpoint in bf16, so both the sampled tokens and the returned
log-probs are the low-precision model's (its logits cast to float32 before the temperature and the log-softmax, as
vLLM's sampler casts them). Under ``bfloat16`` the rollout's log-probs differ from a float32 actor's
``old_log_probs`` as a bf16 vLLM sampler's do (``docs/verl.md``): the training-inference mismatch verl's
``algorithm.rollout_correction`` corrects. ``float32`` makes them the actor's (``examples/verl_main_ppo.sh`` sets it).
A config without the field (a partial one, in tests) is read as float32.
- `HFReplica`, the replica class verl's `LLMServerManager` builds per replica: `launch_servers` starts the server
  actor, named ``tokendyn_hf_server_<rank>``.
- `HFServerAdapter`, the rollout adapter in each actor worker process: verl's weight sync (the "naive" checkpoint
  backend its trainer uses) hands it the full parameters by name; every rank consumes them (gathering an FSDP2
  shard is collective), the replica's first rank sends them to its server.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections import Counter
from typing import TYPE_CHECKING, Any

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

if TYPE_CHECKING:
    from collections.abc import Iterable

ROLLOUT_NAME = "hf"
SERVER_NAME = "tokendyn_hf_server_{rank}{suffix}"
logger = logging.getLogger(__name__)


def _model_path(model_config) -> str:
    """The local model directory of verl's model config (an `HFModelConfig` or the Hydra node)."""
    path = model_config.get("local_path", None) or model_config.get("path", None)
    if not path:
        raise ValueError("actor_rollout_ref.model.path: the hf rollout needs a model path")
    return str(path)


DTYPE_FIELD = "actor_rollout_ref.rollout.dtype"
DTYPES = {
    **dict.fromkeys(("float32", "fp32"), torch.float32),
    **dict.fromkeys(("bfloat16", "bf16"), torch.bfloat16),
    **dict.fromkeys(("float16", "fp16"), torch.float16),
}


def rollout_dtype(config) -> torch.dtype:
    """The torch dtype of verl's ``rollout.dtype`` (float32 where the config has no such field); a name outside
    `DTYPES` is a one-line error naming the field."""
    name = getattr(config, "dtype", None)
    if name is None:
        return torch.float32
    dtype = DTYPES.get(str(name).lower())
    if dtype is None:
        raise ValueError(
            f"{DTYPE_FIELD}: the hf rollout holds the model in one of {', '.join(DTYPES)}, got {name!r}"
        )
    return dtype


def _replica_world_size(config) -> int:
    return config.tensor_model_parallel_size * config.data_parallel_size * config.pipeline_model_parallel_size


def response_log_probs(
    logits: Iterable[torch.Tensor], tokens: torch.Tensor, temperature: float
) -> list[float]:
    """log softmax(z_t / T)[o_t] per generated token, from ``generate``'s raw logits (one (1, V) tensor per
    step); T <= 0 (greedy) is read as T = 1."""
    t = temperature if temperature and temperature > 0 else 1.0
    out = []
    for step, token in zip(logits, tokens.tolist(), strict=False):
        z = step[0].to(torch.float32) / t
        out.append(float(torch.log_softmax(z, dim=-1)[token]))
    return out


class HFRolloutServer:
    """A rollout server holding a Hugging Face causal LM (see the module docstring). ``config``: verl's
    `RolloutConfig` (``response_length``, ``prompt_length``, ``seed``, ``dtype``: `rollout_dtype`); ``model_path``:
    the model directory."""

    def __init__(self, config, model_path: str, replica_rank: int = 0) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        torch.set_num_threads(1)
        self.config = config
        self.replica_rank = replica_rank
        self.dtype = rollout_dtype(config)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=self.dtype, attn_implementation="sdpa"
        ).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        try:
            generation = GenerationConfig.from_pretrained(model_path)
        except OSError:
            generation = self.model.generation_config
        eos = generation.eos_token_id if generation.eos_token_id is not None else tokenizer.eos_token_id
        self.eos_token_ids = sorted({eos} if isinstance(eos, int) else set(eos or []))
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        )
        self.seed = int(getattr(config, "seed", 0) or 0)
        self._requests: Counter = Counter()
        self._lock = asyncio.Lock()
        self.weight_version = 0

    def ready(self) -> bool:
        return True

    def request_seed(self, prompt_ids: list[int]) -> int:
        """The sampling seed of a request: from the rollout seed, the prompt and how many times this server has
        sampled that prompt, so a run samples the same responses whatever order its requests arrive in."""
        key = zlib.crc32(torch.tensor(prompt_ids, dtype=torch.int64).numpy().tobytes())
        count = self._requests[key]
        self._requests[key] += 1
        return (self.seed * 1_000_003 + key * 7_919 + count) % (2**63 - 1)

    def _generate(self, prompt_ids: list[int], params: dict[str, Any]) -> TokenOutput:
        max_new = params.pop("max_tokens", None) or params.pop("max_new_tokens", None)
        max_new = min(int(max_new or self.config.response_length), int(self.config.response_length))
        temperature = float(params.get("temperature", 1.0) or 0.0)
        top_k = int(params.get("top_k", -1) or -1)
        top_p = float(params.get("top_p", 1.0) or 1.0)
        sample = temperature > 0
        kwargs: dict[str, Any] = {"do_sample": sample}
        if sample:
            kwargs.update(temperature=temperature, top_k=top_k if top_k > 0 else 0, top_p=top_p)
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        torch.manual_seed(self.request_seed(prompt_ids))
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                eos_token_id=self.eos_token_ids or None,
                pad_token_id=self.pad_token_id,
                output_logits=True,
                return_dict_in_generate=True,
                **kwargs,
            )
        tokens = out.sequences[0, ids.shape[1] :]
        log_probs = response_log_probs(out.logits, tokens, temperature)
        return TokenOutput(
            token_ids=tokens.tolist(),
            log_probs=log_probs,
            stop_reason="completed",
            extra_fields={"global_steps": self.weight_version},
        )

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """One response to ``prompt_ids`` (text only: images and videos are refused)."""
        if image_data or video_data or kwargs.get("audio_data"):
            raise ValueError("the hf rollout generates from text prompts only")
        async with self._lock:  # one generate at a time: the model is not shared between threads
            return await asyncio.to_thread(self._generate, list(prompt_ids), dict(sampling_params))

    def update_weights(self, state: dict[str, torch.Tensor], global_steps: int | None = None) -> int:
        """Load the actor's parameters (by Hugging Face name; cast to the server's dtype); a tied LM head may be
        absent. Returns how many tensors were loaded."""
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        if unexpected or set(missing) - tied:
            raise ValueError(
                f"hf rollout: weights do not fit the model: missing {missing}, unexpected {unexpected}"
            )
        if global_steps is not None:
            self.weight_version = global_steps
        return len(state)

    def parameters_digest(self) -> dict[str, float]:
        """Each parameter's sum, for tests that compare the server's weights with the actor's."""
        return {name: float(p.detach().double().sum()) for name, p in self.model.named_parameters()}

    # verl's server interface: memory management and profiling have nothing to do here
    async def wake_up(self) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def release(self) -> None:
        return None

    async def resume(self, tags: list[str] | None = None) -> None:
        return None

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        return None

    async def resume_generation(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


class HFReplica(RolloutReplica):
    """verl's rollout replica for the hf rollout: one `HFRolloutServer` actor (no GPU asked: the actor ranks hold
    the logical ones)."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self) -> None:
        rollout_dtype(self.config)  # a bad dtype fails here, in one line, before the server actor starts
        name = SERVER_NAME.format(rank=self.replica_rank, suffix=self.name_suffix)
        server = (
            ray.remote(HFRolloutServer)
            .options(name=name, num_cpus=0, max_concurrency=self.max_concurrency)
            .remote(self.config, _model_path(self.model_config), self.replica_rank)
        )
        await server.ready.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{ROLLOUT_NAME}://{name}"


class HFServerAdapter(BaseRollout):
    """The hf rollout's adapter in verl's actor worker (built by `get_rollout_class`): weight sync to the server
    of this rank's replica (replica = rank // (tp x dp x pp of the rollout config); its first rank sends)."""

    def __init__(self, config, model_config, device_mesh, *args, **kwargs) -> None:
        super().__init__(config, model_config, device_mesh, *args, **kwargs)
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        size = _replica_world_size(self.config)
        self.replica_rank = rank // size
        self.is_leader = rank % size == 0
        self._server = None

    def _server_handle(self):
        if self._server is None:
            self._server = ray.get_actor(SERVER_NAME.format(rank=self.replica_rank, suffix=""))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs) -> None:
        """Send the parameters (``(name, full tensor)`` pairs) to this replica's server; every rank iterates."""
        if wire_format != "named_tensors":
            raise ValueError(
                f"hf rollout: weight format {wire_format!r} is not supported (named_tensors only)"
            )
        if kwargs.get("peft_config") is not None:
            raise ValueError(
                "hf rollout: LoRA adapters are not supported (merge them: model.lora.merge=True)"
            )
        state = {}
        for name, tensor in weights:
            if self.is_leader:
                state[name] = tensor.detach().to("cpu", torch.float32, copy=True)
        if self.is_leader:
            await self._server_handle().update_weights.remote(state, kwargs.get("global_steps"))
