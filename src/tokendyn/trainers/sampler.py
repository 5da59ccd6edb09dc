"""What samples a TRL run's rollouts: TRL's own ``generate`` or its colocated vLLM engine.

`sampling_engine` wraps ``GRPOTrainer.__init__``: with ``use_vllm`` in colocate mode the engine is built through
`tokendyn.integrations.vllm_cpu.colocated_engine` (vLLM's CPU build made to sync weights; the config's
``vllm_dtype``); otherwise it does nothing. `sampler_info` says what was built, for run.json.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from tokendyn.integrations.vllm_cpu import colocated_engine, engine_info, release_engine


def sampling_engine(args: Any):
    """The context TRL's trainer is built in: the colocated vLLM engine's, or nothing."""
    if args is None or not getattr(args, "use_vllm", False) or getattr(args, "vllm_mode", None) != "colocate":
        return nullcontext()
    return colocated_engine(
        getattr(args, "vllm_dtype", "auto"),
        threads=torch.get_num_threads(),
        enforce_eager=bool(getattr(args, "vllm_enforce_eager", False)),
    )


def sampler_info(trainer: Any) -> dict[str, Any]:
    """The engine that samples this trainer's rollouts and the dtype it computes in: vLLM's as built (colocate),
    vLLM's server (its dtype is the server's, not known here), or the trainer's own ``generate`` in the model's
    dtype."""
    args = trainer.args
    if getattr(args, "use_vllm", False):
        llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
        if llm is not None:
            return {**engine_info(llm), "mode": args.vllm_mode}
        return {"engine": "vllm", "mode": args.vllm_mode, "dtype": None}
    dtype = next(trainer.model.parameters()).dtype
    return {"engine": "generate", "dtype": str(dtype).removeprefix("torch.")}


def release_sampler(trainer: Any) -> None:
    """Shut the trainer's colocated vLLM engine down once training is done (`release_engine`); nothing otherwise."""
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
    if llm is not None and getattr(trainer.args, "vllm_mode", None) == "colocate":
        release_engine(llm)
