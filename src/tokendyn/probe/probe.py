"""GradientProbe: per-token activation-gradient norms read from the real training backward.

Hooks: a forward hook on each probed module registers a tensor hook on its output hidden state (this also works
inside TRL's fused-LM-head forward, where `lm_head` hooks never fire); a tensor hook on the per-token log-probs
reads w_t = dL/dlog pi_t. Hooks only read gradients (they return None), so training gradients are unchanged bit for
bit. Alignment: p(t) = the position whose output predicts o_t, one before o_t; by default the completion occupies
the last C positions of each row (prompt + completion, as TRL builds it), so p(t_j) = S - C - 1 + j.

Activation checkpointing: where a probed module's forward ran inside a reentrant checkpoint (under no_grad), its
gradient is read from the recomputation in the backward. Data parallelism (DDP, FSDP2): gradients are recorded
divided by the number of processes that average them (`data_parallel_size`, `tokendyn.probe.parallel`).

Driving it (one micro-batch = one forward + one backward):
    begin_step(...) -> forward -> backward -> end_step()      (trainer: inputs known before the forward)
    forward -> begin_step(..., logps=logps) -> backward        (custom loop, auto=True; the step ends by itself)

Loud, not silent: every condition that switches a check off (a scaled LM head, a backbone without a
final norm, a step without completion ids) warns once and becomes a `notes` record (`tokendyn analyze` lists them).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from tokendyn.config import ProbeConfig
from tokendyn.config import resolve as resolve_config
from tokendyn.probe import budget, parallel
from tokendyn.probe.bins import BinSpec
from tokendyn.probe.capture import (
    Pass,
)
from tokendyn.probe.inputs import StepInputs, validate_inputs
from tokendyn.probe.points import (
    FINAL_NORM,
    discover_points,
    head_transform_supported,
    logit_softcap,
    replay_chain,
    select_points,
    unwrap_model,
)
from tokendyn.probe.probe_hooks import ProbeHooks
from tokendyn.probe.probe_work import ProbeWork
from tokendyn.probe.reduce import StepResult, reduce_step
from tokendyn.probe.stats import LogHistogram
from tokendyn.records import process_rank

Sink = Callable[[dict[str, dict[str, list]]], None]


_ATTACHED = "_tokendyn_probe"  # the model's attribute naming its attached probe


class GradientProbe(ProbeHooks, ProbeWork):
    """Probe per-token activation gradients of a causal LM during training; see the module docstring.

    Args:
        model: a Hugging Face causal LM (DDP / PEFT wrappers are unwrapped; FSDP2 `fully_shard` is supported).
        config: the probe's options (`tokendyn.ProbeConfig`: points, bins, sample_tokens, direct_tokens,
            direct_every, direct_chunk, direct_memory_mb, check_tokens, sigma_every, ...); default `ProbeConfig()`.
        temperature: default sampling temperature T (logits are divided by T in the loss).
        seed: seed of the token samples (per rank).
        auto: capture every forward with gradients even without a prior `begin_step` (custom loops).
        sink: called with the records (kind -> column -> list) of every finished micro-batch.
        rank: this process's rank (default `tokendyn.records.process_rank()`).
        data_parallel_size: n, the number of processes whose gradients are averaged (DDP, FSDP2); w and the
            norms are recorded as d/d of the averaged loss L = (1/n) sum_r L_r, i.e. this process's gradient / n,
            so that merged records equal one process on the global batch (`tokendyn.probe.parallel`). None: the
            DDP group's size when `model` is a DistributedDataParallel, the world size when it is sharded with
            `fully_shard`, else 1. Pass 1 when each process's loss already carries the global normalisation and
            nothing averages the gradients.
        **options: ProbeConfig fields overriding ``config`` (``GradientProbe(model, direct_tokens=0)``).
    """

    def __init__(
        self,
        model: nn.Module,
        config: ProbeConfig | None = None,
        *,
        temperature: float = 1.0,
        seed: int = 0,
        auto: bool = False,
        sink: Sink | None = None,
        rank: int | None = None,
        hist: LogHistogram | None = None,
        data_parallel_size: int | None = None,
        **options,
    ) -> None:
        cfg = self.config = resolve_config(config, options)
        if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not temperature > 0:
            raise ValueError(f"probe: temperature must be a number > 0, got {temperature!r}")
        parallel.check_supported(model)
        self.data_parallel_size = parallel.resolve_data_parallel_size(model, data_parallel_size)
        self.model = unwrap_model(model)
        self._all_points = discover_points(self.model)  # every layer and the LM head's input
        self._chain = replay_chain(
            self.model
        )  # the module calls the direct gradients replay, in forward order
        self.points = select_points(self._all_points, cfg.points)
        self.point_names = [p.name for p in self.points]
        self.bins = BinSpec.parse(cfg.bins)
        self.sample_tokens, self.direct_tokens = cfg.sample_tokens, cfg.direct_tokens
        self.direct_every, self.direct_chunk = cfg.direct_every, cfg.direct_chunk
        self.direct_memory_mb, self.sigma_every = cfg.direct_memory_mb, cfg.sigma_every
        self._n_prepared = 0
        # check_tokens None (every token) is an explicit request: no budget cuts it
        self.check_tokens = cfg.check_tokens
        self.check_budget = None if cfg.check_tokens is None else cfg.check_budget
        params, emb = budget.flop_parameters(self.model)
        self._flop_params = params - emb  # arithmetic per token (`budget.py`)
        self._direct_credit = budget.Credit(cfg.direct_budget)
        self._check_credit = budget.Credit(self.check_budget)
        self.temperature = float(temperature)
        self.auto, self.sink, self.enabled = auto, sink, True
        self.rank = process_rank() if rank is None else rank
        self.hist = hist or LogHistogram()
        self.generator = torch.Generator().manual_seed(int(seed) * 1_000_003 + self.rank)
        self.has_final = FINAL_NORM in self.point_names
        self.head_ok = self.has_final and head_transform_supported(self.model, softcap=True)
        self.softcap = logit_softcap(self.model)
        self._notes: list[dict] = []  # notes not yet handed to the sink
        self._noted: set[str] = set()
        self._note_disabled_checks()
        self.last: StepResult | None = None
        self._handles: list = []
        self._pass: Pass | None = None
        self._pending: StepInputs | None = None
        self._forwarding = False
        self._guard = False
        self._next_step = 0
        self._micro: dict[tuple[int, str], int] = defaultdict(int)
        self._sigma: tuple[float, torch.Tensor, int] | None = None  # (sigma_max, its singular vector, step)
        self._n_checks = 0

    # ---- notes: conditions that switch a check off -----------------------------------------------------------
    def _note_disabled_checks(self) -> None:
        name = type(self.model).__name__
        if FINAL_NORM not in {p.name for p in self._all_points}:
            self.note(
                "no_final_norm",
                f"{name} has no final norm or projection before its LM head that the probe recognises, and its "
                "config does not say that the last layer's output feeds the head (do_layer_norm_before=False): "
                "the exact checks at the LM head and the direct gradients are off",
            )
        elif not self.has_final:
            self.note(
                "final_norm_not_probed",
                f"{FINAL_NORM} is not among the probed points: the exact checks at the LM head and the direct "
                "gradients are off",
            )
        elif not self.head_ok:
            self.note(
                "head_transform",
                f"{name}'s logits are not a plain affine map of the final hidden state, nor a soft-capped one (a "
                "scaled LM head): the exact checks at the LM head and the direct gradients are off",
            )

    def note(self, code: str, message: str, step: int | None = None, warn: bool = True) -> None:
        """Warn once per ``code`` (``warn=False``: no warning, the record alone) and keep the note for the records
        (kind ``notes``, handed to the sink with the next finished micro-batch, or at detach)."""
        if code in self._noted:
            return
        self._noted.add(code)
        if warn:
            warnings.warn(f"probe: {message}", stacklevel=3)
        self._notes.append({"step": step, "rank": self.rank, "code": code, "message": message})

    @property
    def notes(self) -> list[str]:
        """The codes of every note so far (`note`)."""
        return sorted(self._noted)

    def _flush_notes(self) -> None:
        if self._notes and self.sink is not None:
            rows, self._notes = self._notes, []
            self.sink({"notes": {k: [r[k] for r in rows] for k in ("step", "rank", "code", "message")}})

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def attach(self) -> GradientProbe:
        """Register the hooks. A model carries at most one attached probe: a second one would read every gradient
        twice, so attaching it raises."""
        if self._handles:
            return self
        other = getattr(self.model, _ATTACHED, None)
        if other is not None and other is not self and other.attached:
            raise RuntimeError(
                "probe: this model already has an attached GradientProbe; detach it (or leave its `with` block) "
                "before attaching another"
            )
        setattr(self.model, _ATTACHED, self)
        self._handles.append(self.model.register_forward_pre_hook(self._on_root_pre))
        self._handles.append(self.model.register_forward_hook(self._on_root_post))
        for p in self.points:
            self._handles.append(p.module.register_forward_hook(partial(self._on_point_forward, p.name)))
        if self.direct_tokens > 0:
            for p in self._chain:
                self._handles.append(
                    p.module.register_forward_pre_hook(
                        partial(self._on_module_input, p.name), with_kwargs=True
                    )
                )
        return self

    def detach(self) -> None:
        self._flush_notes()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if getattr(self.model, _ATTACHED, None) is self:
            delattr(self.model, _ATTACHED)
        if self._pass is not None:
            self._pass.release()
        self._pass, self._pending, self._forwarding = None, None, False

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def __enter__(self) -> GradientProbe:
        return self.attach()

    def __exit__(self, exc_type, exc, tb) -> None:
        """Ends the open step if its backward ran, also when the block raises (an optimizer step that fails after
        the backward does not lose the micro-batch), then removes every hook."""
        try:
            p = self._pass
            if p is not None and p.inputs is not None and p.backward_seen and p.w_grad is not None:
                self.end_step()
        finally:
            self.detach()

    # ---- driving ---------------------------------------------------------------------------------------------
    def begin_step(self, step: int | None = None, stage: str = "train", **fields) -> None:
        """Announce a micro-batch: completion_mask (required), advantages, old_logp (log pi_old; None: on-policy),
        completion_ids, temperature, token_positions, token_rows (the forward's row of each token, when several
        sequences share a row: a packed layout), logps, entropy (the per-token entropies [B, C] of an entropy
        bonus in the loss: its gradient is then part of the exact checks; a fused head's ``output.entropy`` is read by
        itself). Call before the forward (or after it, before the backward); a custom loop with ``auto=True`` may
        call it after the forward with ``logps=``. A finished previous step (backward seen) is ended first."""
        step = self._next_step if step is None else step
        temperature = fields.pop("temperature", None)
        inputs = validate_inputs(
            step=step,
            stage=stage,
            temperature=self.temperature if temperature is None else temperature,
            **fields,
        )
        if inputs.completion_ids is None and self.head_ok:
            self.note(
                "no_completion_ids",
                "a step without completion_ids: the exact checks at the LM head and the direct gradients are off "
                "for such steps",
                step,
            )
        cur = self._pass
        if cur is not None and cur.inputs is not None:
            if not cur.backward_seen:
                raise RuntimeError(
                    f"probe: step {cur.inputs.step} ({cur.inputs.stage}) is still open without a backward; "
                    "call end_step() (or run its backward) before starting another step"
                )
            self.end_step()
            cur = self._pass
        self._next_step = step + 1
        if cur is not None and cur.forward_done and cur.inputs is None:
            cur.inputs = inputs
            self._prepare(cur)
        else:
            self._pending = inputs

    def watch_logps(self, logps: torch.Tensor) -> None:
        """Read w = dL/dlogps from this per-token log-prob tensor [B, C] of the current step (before backward)."""
        p = self._pass
        if p is None or p.inputs is None:
            raise RuntimeError("probe: watch_logps needs a begun step whose forward has run")
        if p.prepared:
            raise RuntimeError("probe: this step already has its log-probs (the fused head output or logps=)")
        p.inputs.logps = validate_inputs(
            step=0, stage="x", completion_mask=p.inputs.completion_mask, logps=logps
        ).logps
        self._prepare(p)

    def end_step(self) -> StepResult | None:
        """Reduce the finished micro-batch, hand its records to the sink, and return them (None if nothing usable)."""
        p, self._pass = self._pass, None
        if p is None or p.inputs is None:
            if self._pending is not None:
                warnings.warn(
                    "probe: end_step() without a forward with gradients; nothing recorded", stacklevel=2
                )
                self._pending = None
            if p is not None:
                p.release()
            return None
        p.release()
        inp = p.inputs
        if not p.prepared and p.shape is None:
            warnings.warn(
                f"probe: step {inp.step}: no probed hidden state required grad; nothing recorded",
                stacklevel=2,
            )
            return None
        if not p.prepared:
            warnings.warn(
                f"probe: step {inp.step}: the per-token log-probs were never seen (pass logps=... to begin_step() or "
                "watch_logps()); nothing recorded",
                stacklevel=2,
            )
            return None
        if not p.backward_seen or p.w_grad is None:
            warnings.warn(
                f"probe: step {inp.step}: no backward reached the log-probs; nothing recorded", stacklevel=2
            )
            return None
        key = (inp.step, inp.stage)
        micro = self._micro[key]
        self._micro[key] += 1
        unreached = [n for n in self.point_names if n not in p.norms]
        if unreached and bool(inp.completion_mask.any()):
            warnings.warn(
                f"probe: step {inp.step} ({inp.stage}): no gradient reached {', '.join(unreached)} although tokens "
                "were scored; recorded as unreached (an error in `tokendyn analyze`)",
                stacklevel=2,
            )
        result = reduce_step(self._step_data(p, micro))
        self.last = result
        if self.sink is not None:
            self.sink(result.records)
        self._flush_notes()
        return result
