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
    all_reduce_sum,
    at_tokens,
    completion_positions,
    gather_completion,
    in_backward,
)
from tokendyn.probe.direct import DirectMemoryError
from tokendyn.probe.head import HeadShard, logits_identity_error, sigma_max_gram
from tokendyn.probe.head_entropy import entropy_direction
from tokendyn.probe.inputs import StepInputs, validate_inputs
from tokendyn.probe.points import (
    FINAL_NORM,
    discover_points,
    head_transform_supported,
    logit_softcap,
    output_head,
    replay_chain,
    select_points,
    unwrap_model,
)
from tokendyn.probe.reduce import HeadCheckData, StepData, StepResult, reduce_step
from tokendyn.probe.replay import LayerCall, replay_direct_norms
from tokendyn.probe.rounding import LOW_PRECISION, head_compute_dtype, rounded_head_gradient
from tokendyn.probe.stats import LogHistogram, bottom_k_sample
from tokendyn.records import process_rank

Sink = Callable[[dict[str, dict[str, list]]], None]


_ATTACHED = "_tokendyn_probe"  # the model's attribute naming its attached probe


class GradientProbe:
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

    # ---- hooks -----------------------------------------------------------------------------------------------
    def _on_root_pre(self, module, args) -> None:
        if (
            not self.enabled
            or not torch.is_grad_enabled()
            or torch.is_inference_mode_enabled()
            or in_backward()
        ):
            return
        if self._pending is None and not self.auto:
            return
        cur = self._pass
        if cur is not None:
            if cur.inputs is not None and cur.backward_seen:
                self.end_step()
            elif cur.inputs is not None:
                raise RuntimeError(
                    f"probe: a second forward with gradients inside step {cur.inputs.step} before its backward; "
                    "one probe step is one forward + one backward (call end_step() between micro-batches)"
                )
            else:
                cur.release()
        p = Pass()
        p.inputs, self._pending = self._pending, None
        self._pass, self._forwarding = p, True

    def _on_module_input(self, name: str, module, args, kwargs) -> None:
        p = self._pass
        if p is None or not self._forwarding or not args or not torch.is_tensor(args[0]):
            return
        p.calls[name] = LayerCall.record(name, module, args, kwargs)

    def _on_point_forward(self, name: str, module, args, output) -> None:
        p = self._pass
        if p is None:
            return
        t = output if torch.is_tensor(output) else output[0]
        if not torch.is_tensor(t):
            return
        if not self._forwarding:
            # a checkpointed module recomputed in the backward: hook the recomputed output of a point whose forward
            # output carried no gradient (its forward ran inside a reentrant checkpoint, under no_grad)
            if name in p.unhooked and t.requires_grad and in_backward():
                p.unhooked.discard(name)
                p.handles.append(t.register_hook(partial(self._on_point_grad, p, name)))
            return
        p.shape = (int(t.shape[0]), int(t.shape[1]))
        if not t.requires_grad:
            p.unhooked.add(name)
            return
        if name == FINAL_NORM:
            p.hidden[name] = t
            p.autocast = (torch.is_autocast_enabled(t.device.type), torch.get_autocast_dtype(t.device.type))
        p.handles.append(t.register_hook(partial(self._on_point_grad, p, name)))

    def _on_root_post(self, module, args, output) -> None:
        if not self._forwarding:
            return
        self._forwarding = False
        p = self._pass
        p.forward_done = True
        lp = getattr(output, "log_probs", None)
        if torch.is_tensor(lp) and lp.requires_grad:
            p.logp_seq = lp
            p.handles.append(lp.register_hook(partial(self._on_logp_grad, p, "seq")))
        ent = getattr(output, "entropy", None)
        if torch.is_tensor(ent) and ent.requires_grad:
            p.entropy_seq = ent
            p.handles.append(ent.register_hook(partial(self._on_entropy_grad, p, "seq")))
        logits = getattr(output, "logits", None)
        if torch.is_tensor(logits) and logits.requires_grad:
            p.logits = logits
        if p.inputs is not None:
            self._prepare(p)

    def _on_point_grad(self, p: Pass, name: str, grad: torch.Tensor | None) -> None:
        if self._guard or grad is None:
            return
        p.backward_seen = True
        p.norms[name] = torch.linalg.vector_norm(
            grad.detach(), dim=-1, dtype=torch.promote_types(grad.dtype, torch.float32)
        )
        if name == FINAL_NORM:
            p.grad_dtype = grad.dtype
            if p.check_at is not None:
                p.delta_check = grad.detach()[p.check_at].float()
            if p.check is not None and p.e_grad is not None:
                p.check.entropy_weight = self._at_checks(p, p.e_grad, p.e_kind).to(torch.float64)
            if p.rounded is not None and p.check is not None and p.w_grad is not None:
                # a 16-bit head: its rounding predicted here, in the training backward (W is still the forward's)
                h, targets, shard, temperature = p.rounded
                p.check.rounded = rounded_head_gradient(
                    h, shard, targets, self._at_checks(p, p.w_grad, p.w_kind), temperature, p.head_dtype,
                    e=p.check.entropy_weight,
                )  # fmt: skip

    # A tensor hook gets None for an output of a multi-output node that received no gradient while another did
    # (seen under DDP with LoRA and bf16: the fused head's entropy when the loss has no entropy term): no gradient.
    def _on_logp_grad(self, p: Pass, kind: str, grad: torch.Tensor | None) -> None:
        if grad is not None and not self._guard and kind == p.w_kind:
            p.w_grad = grad.detach().clone()

    def _on_entropy_grad(self, p: Pass, kind: str, grad: torch.Tensor | None) -> None:
        if grad is not None and not self._guard and kind == p.e_kind:
            p.e_grad = grad.detach().clone()

    @staticmethod
    def _at_checks(p: Pass, grad: torch.Tensor, kind: str) -> torch.Tensor:
        """A per-token gradient (w or e, [B, C] "completion" or [b, S-1] "seq") at the check tokens, flat [Kc]."""
        if kind != "completion":
            grad = at_tokens(grad, p.positions, p.rows)
        return grad.reshape(-1)[p.sample[0][: p.check.direction.shape[0]]]

    def _on_logits_grad(self, p: Pass, idx: torch.Tensor, at: tuple, head: tuple, grad: torch.Tensor) -> None:
        """The logits-level identity error of the check tokens, computed here, in the training backward (W is still
        the forward's): the gradient rows are streamed against pi chunk by chunk, nothing tokens x V is kept."""
        if self._guard:
            return
        if p.w_grad is None:
            p.logits_grad_check = None
            return
        w = p.w_grad
        if p.w_kind != "completion":
            w = at_tokens(w, p.positions, p.rows)
        h, lse, targets, shard, temperature = head
        g = grad.detach()
        p.logits_grad_check = logits_identity_error(
            lambda a, b: g[at[0], at[1], a:b], w.reshape(-1)[idx], h, lse, shard, targets, temperature
        )  # per-token relative errors [Kc], not the gradient rows

    # ---- work ------------------------------------------------------------------------------------------------
    def _prepare(self, p: Pass) -> None:
        """Forward done and inputs known: align positions, pick the token sample, keep what the checks need, run
        the direct gradients; then release the live activations."""
        inp = p.inputs
        if p.shape is None:
            return
        b, seq = p.shape
        n_rows, c_len = inp.completion_mask.shape
        pos = completion_positions(b, seq, inp.completion_mask, inp.token_positions, inp.token_rows)
        device = next(iter(p.hidden.values())).device if p.hidden else inp.completion_mask.device
        pos = pos.to(device)
        fwd_rows = None if inp.token_rows is None else inp.token_rows.to(device)
        if inp.logps is not None:
            p.w_kind = "completion"
            p.logp_value = inp.logps.detach()
            p.handles.append(inp.logps.register_hook(partial(self._on_logp_grad, p, "completion")))
        elif p.logp_seq is not None:
            p.w_kind = "seq"
            p.logp_value = at_tokens(p.logp_seq.detach(), pos, fwd_rows)
        else:
            return  # wait for watch_logps
        if inp.entropy is not None:
            p.e_kind = "completion"
            p.handles.append(inp.entropy.register_hook(partial(self._on_entropy_grad, p, "completion")))
        elif p.entropy_seq is not None:
            p.e_kind = "seq"
        p.positions, p.rows, p.prepared = pos, fwd_rows, True
        n_check = c_len * n_rows if self.check_tokens is None else self.check_tokens
        k = max(self.sample_tokens, self.direct_tokens, n_check)
        idx, ok = bottom_k_sample(inp.completion_mask, k, self.generator)
        idx, ok = idx.to(device), ok.to(device)
        p.sample = (idx, ok)
        rows, cols = idx // c_len, idx % c_len
        spos = pos[rows, cols]
        if fwd_rows is not None:
            rows = fwd_rows[rows, cols]  # from here on: the forward's rows
        h_final = p.hidden.get(FINAL_NORM)
        if self.head_ok and h_final is not None and inp.completion_ids is not None:
            shard = parallel.head_shard(output_head(self.model))  # FSDP2: this rank's vocabulary rows only
            shard.softcap = self.softcap
            kc = budget.check_tokens_within(
                n_check,
                idx.shape[0],
                self._flop_params,
                b * seq,
                shard.hidden,
                shard.vocab,
                self.check_budget,
            )
            kd = self._direct_due(min(self.direct_tokens, idx.shape[0]), rows, b, seq, shard)
            kc = self._checks_due(kc, b, seq, shard)
            kh = max(kc, kd or 0)
            targets = inp.completion_ids.to(device).reshape(-1)[idx[:kh]]
            h = h_final.detach()[rows[:kh], spos[:kh]]
            q, sigma_lower = parallel.head_sample_quantities(h, shard, targets, inp.temperature)
            p.check_at = (rows[:kc], spos[:kc])
            sigma, sigma_step = self._sigma_max(shard, inp.step, sigma_lower, checking=kc > 0)
            p.head_dtype = head_compute_dtype(shard.weight.dtype, h_final.dtype, p.autocast)
            p.check = HeadCheckData(
                vocab_size=shard.vocab,
                sigma_max=sigma,
                sigma_step=sigma_step,
                direction=q.direction[:kc],
                logits_ratio=q.logits_ratio[:kc],
                head_dtype=p.head_dtype,
            )
            # the head's rounding is modelled for a plain affine head (a soft cap's 16-bit tanh is not: 8 eps)
            if p.head_dtype in LOW_PRECISION and shard.group is None and shard.softcap is None and kc > 0:
                p.rounded = (h[:kc], targets[:kc], shard, inp.temperature)
            if p.e_kind is not None and kc > 0:
                if shard.group is None:
                    p.check.entropy_direction = entropy_direction(h[:kc], shard, inp.temperature)
                else:
                    self.note(
                        "entropy_sharded",
                        "an entropy bonus with a vocabulary-sharded LM head: its gradient is not in the identity "
                        "check's prediction (identity errors include it)",
                        inp.step,
                    )
            if p.logits is not None and kc > 0 and shard.group is None:
                off = seq - p.logits.shape[1]
                at = (rows[:kc], (spos[:kc] - off).clamp(min=0))
                head = (h[:kc], q.lse[:kc], targets[:kc], shard, inp.temperature)
                p.handles.append(p.logits.register_hook(partial(self._on_logits_grad, p, idx[:kc], at, head)))
            if kd is not None:
                p.direct = self._direct(p, rows[:kd], spos[:kd], q.direction[:kd])
        p.hidden, p.logp_seq, p.logits, p.calls = {}, None, None, {}

    def _direct_due(self, kd: int, rows: torch.Tensor, b: int, seq: int, shard: HeadShard) -> int | None:
        """How many of the first ``kd`` sampled tokens (forward ``rows``) get direct gradients on this micro-batch,
        None for no replay: one on every `direct_every`-th probed micro-batch with a credit >= 0 (`budget.Credit`:
        each micro-batch earns direct_budget x its training flops, a replay spends its estimated flops,
        `budget.direct_flops`); with a budget, on the longest prefix whose replay costs at most `budget.REPLAY_STEPS`
        of this micro-batch's training flops (`budget.direct_tokens_within`: at least one). Under FSDP2 the ranks
        agree (one replays: all do, a rank without a token with none, its replay's collectives matched)."""
        self._n_prepared += 1
        step = budget.step_flops(self._flop_params, b * seq)
        self._direct_credit.earn(step)
        if self.direct_tokens <= 0:  # (off on every rank)
            return None
        due = kd > 0 and (self._n_prepared - 1) % self.direct_every == 0 and self._direct_credit.affordable()
        if not parallel.agree_max(int(due), self.model, rows.device):
            return None
        if kd <= 0:
            return 0
        layer_params = max(self._flop_params - shard.vocab * shard.hidden, 0)
        sampled = rows[:kd].tolist()
        if self._direct_credit.budget is not None:
            kd = budget.direct_tokens_within(sampled, layer_params, seq, budget.REPLAY_STEPS * step)
        self._direct_credit.spend(budget.replay_flops(sampled[:kd], layer_params, seq))
        return kd

    def _checks_due(self, kc: int, b: int, seq: int, shard: HeadShard) -> int:
        """The tokens checked exactly at the LM head on this micro-batch: kc when the checks' credit allows
        (`budget.Credit`, `budget.check_flops`), else 0; under FSDP2 the ranks agree (one checks: all do)."""
        self._check_credit.earn(budget.step_flops(self._flop_params, b * seq))
        due = kc > 0 and self._check_credit.affordable()
        if not bool(parallel.agree_max(int(due), self.model, shard.weight.device)):
            return 0
        refresh = self._sigma is None or self._n_checks % self.sigma_every == 0
        self._check_credit.spend(budget.check_flops(kc, shard.hidden, shard.vocab, refresh))
        return kc

    def _direct(self, p: Pass, rows, spos, direction) -> torch.Tensor | None:
        """[P, Kd] ||d log pi_t / d h_l[p(t)]|| on the first Kd sampled tokens (NaN for points not captured), from
        u = d log pi_t / dh at the LM-head input (`direction` [Kd, H]).

        By replaying the layers from their recorded inputs (`replay_direct_norms`), only the rows that hold sampled
        tokens, in groups under the `direct_memory_mb` cap: its memory does not grow with the micro-batch's rows, and
        it works under FSDP2 and every kind of activation checkpointing. A micro-batch over the cap gets None (and a
        warning); a forward that did not call every layer switches the direct gradients off (and warns)."""
        cap = None if self.direct_memory_mb is None else self.direct_memory_mb * 2**20
        full = torch.full(
            (len(self.point_names), rows.shape[0]), float("nan"), dtype=torch.float32, device=rows.device
        )
        calls = [p.calls.get(q.name) for q in self._chain]
        self._guard = True  # the probe's own tensor hooks must ignore these backwards
        try:
            if any(c is None for c in calls):
                missing = [q.name for q, c in zip(self._chain, calls, strict=True) if c is None]
                raise RuntimeError(f"the forward never called {', '.join(missing)}")
            agree = partial(parallel.agree_max, model=self.model, device=rows.device)
            d = replay_direct_norms(
                calls, self.point_names, rows, spos, direction, self.direct_chunk, cap, agree
            )
            for i, n in enumerate(self.point_names):
                full[i] = d[n]
            return full
        except (DirectMemoryError, torch.OutOfMemoryError) as exc:
            self.note(
                "direct_memory",
                f"no direct gradients on micro-batches over the memory they may use (first at step "
                f"{p.inputs.step}): {exc} (direct_memory_mb={self.direct_memory_mb}; raise it, or None for no cap)",
                step=p.inputs.step,
            )
            return None
        except RuntimeError as exc:
            self.note(
                "direct_disabled",
                f"direct gradients disabled for {type(self.model).__name__} "
                f"({'FSDP2 fully_shard, ' if parallel.is_fully_sharded(self.model) else ''}layer replay): {exc}",
                step=p.inputs.step,
            )
            self.direct_tokens = 0
            return None
        finally:
            self._guard = False

    def sigma_state(self) -> dict:
        """What the probe's schedules carry from step to step, for a checkpoint: the checks and probed micro-batches
        counted, the two budgets' credits and, once computed, sigma_max, its right singular vector (CPU) and the
        step it was computed at. A resumed probe given
        it back (`load_sigma_state`) refreshes on the same schedule and records what an uninterrupted run does."""
        base = {
            "n_checks": self._n_checks,
            "n_prepared": self._n_prepared,
            "direct_credit": self._direct_credit.credit,
            "check_credit": self._check_credit.credit,
        }
        if self._sigma is None:
            return base
        sigma, v, step = self._sigma
        return base | {"sigma": sigma, "vector": v.detach().cpu(), "step": step}

    def load_sigma_state(self, state: dict) -> None:
        self._n_checks = int(state["n_checks"])
        self._n_prepared = int(state.get("n_prepared", self._n_prepared))
        self._direct_credit.credit = float(state.get("direct_credit", self._direct_credit.credit))
        self._check_credit.credit = float(state.get("check_credit", self._check_credit.credit))
        if "sigma" in state:
            self._sigma = (float(state["sigma"]), state["vector"].to(torch.float64), int(state["step"]))

    def _sigma_max(self, shard: HeadShard, step: int, lower: float, checking: bool) -> tuple[float, int]:
        """(sigma, the step it was computed at): sigma_max(W) = sqrt(lambda_max(W^T W)) from the H x H Gram matrix
        (`head.sigma_max_gram`: one float64 pass over the head, exact to float64 rounding), recomputed on the first
        call and then on every `sigma_every`-th call that checks tokens (`checking`; a collective under a sharded
        head: every rank calls it as often, `_checks_due` agrees on `checking`). In
        between, the W of the last refresh stands in for the current one, and the value is raised to `lower` (a
        lower bound of the current sigma_max from this micro-batch's tokens), so that a head grown since the
        refresh cannot make the bound check count tokens above a bound the current W allows them to reach."""
        due = checking and self._n_checks % self.sigma_every == 0
        self._n_checks += int(checking)
        fresh = self._sigma is None or self._sigma[1].shape[0] != shard.hidden
        if fresh or due:
            sigma, v = sigma_max_gram(shard, parallel.all_reduce_in(shard.group))
            self._sigma = (sigma, v, step)
        sigma, _, at = self._sigma
        return max(sigma, lower), at

    def _step_data(self, p: Pass, micro: int) -> StepData:
        """The step's tensors; the gradients divided by the data-parallel size n (see `data_parallel_size`)."""
        inp = p.inputs
        device = p.positions.device
        n = self.data_parallel_size
        scale = (lambda t: t) if n == 1 else (lambda t: None if t is None else t / n)  # noqa: E731
        norms, w = gather_completion(p, self.point_names)
        norms, w = scale(norms), scale(w)
        check = p.check
        if check is not None:
            check.delta, check.logits_identity_err, check.grad_dtype = (
                scale(p.delta_check),
                p.logits_grad_check,  # relative errors: the same at any scale
                p.grad_dtype,
            )
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        return StepData(
            step=inp.step,
            stage=inp.stage,
            rank=self.rank,
            micro=micro,
            points=self.point_names,
            norms=norms,
            valid=to(inp.completion_mask),
            w=w,
            logp=p.logp_value.to(device),
            pi_old=to(inp.pi_old),
            advantages=to(inp.advantages),
            completion_ids=to(inp.completion_ids),
            temperature=inp.temperature,
            bins=self.bins,
            sample_idx=p.sample[0],
            sample_valid=p.sample[1],
            n_record=self.sample_tokens,
            direct=p.direct,
            check=check,
            final_index=self.point_names.index(FINAL_NORM) if self.has_final else None,
            reached=[n in p.norms for n in self.point_names],
            reduce_fn=all_reduce_sum,
            hist=self.hist,
        )
