"""Counterfactual optimizer steps on the model's own trainable parameters, undone exactly (`InPlaceUpdate`)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

import torch
from torch import nn

from tokendyn.effects.probs import completion_probs
from tokendyn.effects.resolution import (
    Resolution,
    policy_signal,
    unit_roundoff,
)
from tokendyn.effects.shares import dot64
from tokendyn.effects.snapshot import HostSnapshot, Saved, _state_to_host
from tokendyn.effects.step_mode import (
    OptimizerFactory,
    _like,
    _plain_sgd,
    _sharded,
    _step_scales,
    _swap_in,
    step_mode,
    swaps_steps,
)
from tokendyn.probe.float64 import as_float64
from tokendyn.probe.parallel import check_wholly_sharded, gradients, local, reshard, sum_over_ranks
from tokendyn.probe.tokenloss import (
    Objective,
    ProbeBatch,
    eval_mode,
    token_loss,
    trainable_parameters,
)
from tokendyn.vocab import FLOAT64, FLOAT64_STEP, STEP_PRECISIONS


class InPlaceUpdate:
    """Counterfactual optimizer steps on the model's own trainable parameters, undone exactly.

    Use as a context manager: on entry the trainable parameters theta_0 are copied to host memory (`HostSnapshot`;
    not when nothing will write them: float64 copies or plain SGD swapped in, below), on exit (also on an exception)
    they are put back, so every parameter is bitwise what it was. `step(batch,
    mask)` makes one step of the analysis optimizer on L_mask = sum_{t in mask} l_t at the current parameters (the
    gradient by ``torch.autograd.grad``; ``.grad`` of each parameter is set aside and put back), `probs(batch)`
    measures pi at the current parameters, `save()` / `load(saved)` go back to an earlier point (parameters and
    optimizer state; Lopti's stage 2 starts from one, the influence sources restart from it). Memory on the device:
    no parameter copy, one gradient during a step, and the analysis optimizer's state (none for plain SGD).
    Each step also decides whether it carried a policy-gradient signal (`tokendyn.effects.resolution.policy_signal`,
    from the step's own log pi, no extra pass): ``step_signal`` (the last step), ``signal`` (any step since entry or
    the last `load`), which `resolution` turns into a "no update".
    The in-place steps bump the parameters' version counters: run it before a training forward or after its
    backward, never while a training graph that saved the weights is alive (its backward would then refuse them).

    ``precision`` "float64" (the default): inside the context float64 copies of the model's parameters and buffers
    stand in for them in their modules and every op computes in float64 (`tokendyn.probe.float64.as_float64`: 8
    bytes a parameter on the device; the model's own parameters are not touched, and are its again on exit; they
    are theta_0 itself, no host copy is made), so a
    step far below the float32 (or bf16) rounding of theta is applied and measured whole; pi is measured there too
    (`probs`, `pi_start`), so every delta pi compares float64 with float64. "model": the steps on the model's own
    parameters in their dtype (a step below their rounding is partly lost, which `resolution` states); for
    parameters in host memory (`swaps_steps`) plain SGD (`_plain_sgd`, the analyses' own) then writes nothing: each
    step's theta - lr g is a new tensor swapped into the parameter (``.data``, same dtype and device: ``.grad``,
    hooks and gradient accumulators untouched), and every restart puts theta_0's own tensors back, so no copy of
    theta_0 is made (on a CPU, where host and device memory are one, the peak holds one parameter-sized buffer less;
    on a GPU the in-place step keeps a single copy on the device). "float64_step" (plain SGD; another optimizer falls back to "float64"): the gradient is the model's own, in
    its dtype, at the current point rounded to that dtype; the step theta - lr g is made in float64 (theta and g
    upcast exactly) and kept beside the model, and pi is measured in float64 there (`probs`: the float64 model with
    that point standing in for the parameters, `tokendyn.probe.float64.as_float64`): what a float64 step of the
    model-dtype gradient does, at the memory of the model's own backward plus 8 bytes a parameter per float64 point
    held (one off theta_0 for the influence sources; two during Lopti's second stage, its start kept; the point
    rounded to the model's dtype where a gradient is taken there) and the float64 forward's transients, no float64
    activations kept for a backward (`tokendyn.effects.precision`'s check of float32 weights).

    FSDP2-sharded parameters: "model" steps their shards in their own dtype, in place; "float64" and "float64_step"
    are both "float64_step" there (no float64 backward of a sharded model), with the float64 point kept as this
    rank's float64 shards (8 bytes a parameter / world size) and pi measured by a float64 forward that gathers each
    `fully_shard` unit's float64 parameters only while it runs (`tokendyn.probe.float64.as_float64`); the rounded
    point where a
    gradient is taken is written into the shards in place, theta_0's shards kept in host memory and put back on
    exit. Another optimizer than plain SGD is refused there with float64 steps.

    FSDP2: every rank makes the same steps on the same batch (each step's forward and backward are collectives);
    each rank saves and restores its own shards, the gradient is FSDP2's reduce-scattered one
    (`tokendyn.probe.parallel.gradients`), and the model is resharded whenever its parameters change in place."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerFactory,
        objective: Objective | None = None,
        precision: str = "float64",
    ) -> None:
        if precision not in STEP_PRECISIONS:
            raise ValueError(
                f"change: precision must be one of {', '.join(STEP_PRECISIONS)}, got {precision!r}"
            )
        self.model, self.objective, self.precision = model, objective, precision
        self.params = trainable_parameters(model)
        self.optimizer_factory = optimizer
        self.start: HostSnapshot | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.last_gradient: HostSnapshot | None = None
        self._moved = False
        self._stack: ExitStack | None = None
        self._copied = False
        self._pi_start: tuple[ProbeBatch, torch.Tensor] | None = None
        self.step_signal: bool | None = None
        self.signal = False
        # float64_step: the current point in float64 (None: theta_0, the model's own), and whether the model's
        # parameters hold it rounded to their dtype (where the next gradient is taken)
        self._theta64: dict[str, torch.Tensor] | None = None
        self._rounded, self._mode = True, precision
        self._sharded = False

    def __enter__(self) -> InPlaceUpdate:
        check_wholly_sharded(self.model)
        reshard(self.model)  # FSDP2: the registered parameters are the shards (`parallel.reshard`)
        self.params = trainable_parameters(self.model)
        self.start_norm2 = self._sum_over_ranks(sum(dot64(local(p), local(p)) for p in self.params.values()))
        mode, sharded = step_mode(self.model, self.optimizer_factory, self.precision), _sharded(self.model)
        self._sharded = sharded
        copy64, self._mode = mode == FLOAT64, mode
        self.step_dtype = torch.float64 if mode == FLOAT64_STEP else None
        self.step_signal, self.signal = None, False
        self._stack = ExitStack()
        self._copied, self._swap, self._theta64, self._rounded = False, False, None, True
        own = dict(self.params)  # (the model's own parameters, before any float64 copy stands in for them)
        try:
            if copy64:
                self._stack.enter_context(as_float64(self.model))  # the steps on float64 copies
                self.params, self._copied = trainable_parameters(self.model), True
            if self.step_dtype is None:
                self.step_dtype = max(
                    (p.dtype for p in self.params.values()), key=unit_roundoff, default=torch.float64
                )
            self.optimizer = self.optimizer_factory(list(self.params.values()))
            self._fresh_state = _state_to_host(self.optimizer.state_dict())
            if mode == "model" and swaps_steps(self.model):
                self._swap = _plain_sgd(self.optimizer)
            # theta_0: with float64 copies stepping, or plain SGD steps swapped in as new tensors (`_swap`), the
            # model's own weights are never written (no copy of them: 4 or 2 bytes a parameter of host memory
            # saved, and each restore is the weights themselves); else a host copy
            never_written = copy64 or self._swap or (mode == FLOAT64_STEP and not sharded)
            self.start = HostSnapshot.borrowed(own) if never_written else HostSnapshot(own)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            swapped = self._swap or (self._step64() and not self._sharded)
            if self.start is not None and swapped:  # (theta_0's own tensors back in place)
                _swap_in(self.params, self.start.tensors)
            elif self.start is not None and not self._copied:  # (copies stepped: the model's own untouched)
                self.start.restore(self.params)
        finally:
            if self._stack is not None:
                self._stack.close()
            if self.start is not None:
                reshard(self.model)
            self.start, self.optimizer, self._moved, self.last_gradient = None, None, False, None
            self._swap, self._theta64, self._rounded, self._mode = False, None, True, self.precision
            self._stack, self._pi_start = None, None
            self.params = trainable_parameters(self.model)

    def _sum_over_ranks(self, x: float) -> float:
        return float(sum_over_ranks(torch.tensor([x], dtype=torch.float64), self.model))

    def step(
        self,
        batch: ProbeBatch,
        mask: torch.Tensor | None = None,
        *,
        gradient: HostSnapshot | None = None,
        keep_gradient: bool = False,
        inspect: Callable[[list[torch.Tensor | None]], None] | None = None,
    ) -> float:
        """One optimizer step on L_mask = sum_{t in mask} l_t (mask None: every token), in place. Returns L_mask.
        ``keep_gradient``: a host copy of the step's gradient is left in ``last_gradient`` (a `HostSnapshot`,
        name -> tensor), for a later step from the same point: given as ``gradient``, that step skips the forward
        and backward (Lopti's first stage from theta_0 again, at another learning rate) and returns NaN; its signal
        is the kept step's.
        ``inspect``: called with the gradient (one tensor or None per trainable parameter, in `params` order; FSDP2:
        this rank's shards) before the step, e.g. to reduce it to norms (`tokendyn.effects.influence`)."""
        tensors = list(self.params.values())
        reshard(self.model)
        loss = torch.tensor(float("nan"))
        if (
            gradient is not None
        ):  # (copied for an optimizer's own step: it may write .grad; a swapped step only reads)
            fresh = not (self._swap or self._step64())
            grads = [gradient.tensors[n].to(local(p).device, copy=fresh) for n, p in self.params.items()]
            signal = getattr(gradient, "signal", True)
        else:
            self._round_in()
            with eval_mode(self.model):
                tl = token_loss(self.model, batch, self.objective)
                terms = tl.terms
                loss = terms.sum() if mask is None else (terms * mask.to(terms.device, terms.dtype)).sum()
                signal = policy_signal(tl.logp, batch, mask, self.objective, tl.entropy)
                grads = gradients(self.model, loss, tensors)
            del terms, tl
        self.step_signal = signal
        self.signal = self.signal or signal
        if inspect is not None:
            inspect(grads)
        if keep_gradient:
            named = zip(self.params.items(), grads, strict=True)
            self.last_gradient = HostSnapshot(
                {n: torch.zeros_like(local(p)) if g is None else g for (n, p), g in named}
            )
            self.last_gradient.signal = signal
        self._moved = True
        if self._swap or self._step64():
            # theta <- theta - lr g as new tensors, the old ones never written (`_plain_sgd`); float64_step: in
            # float64 from the current float64 point, the gradient upcast (exactly), the model's dtype rounded in
            # only when a gradient is next taken there
            lr = _step_scales(self.optimizer, tensors, grads)
            step64 = not self._swap
            current = self.current() if step64 else {n: p.detach() for n, p in self.params.items()}
            with torch.no_grad():
                stepped = {}
                for (n, p), g in zip(self.params.items(), grads, strict=True):
                    theta, scale = current[n], lr.get(id(p))  # (a parameter no group holds: not stepped)
                    if step64:  # (FSDP2's theta_0: its shards' host copy)
                        theta = theta.to(local(p).device, torch.float64)
                        g = None if g is None else g.to(torch.float64)
                    stepped[n] = theta if g is None or scale is None else torch.add(theta, g, alpha=-scale)
            del grads
            if step64:
                self._theta64, self._rounded = stepped, False
            else:
                _swap_in(self.params, stepped)
            return float(loss.detach())
        kept = [p.grad for p in tensors]
        try:
            for p, g in zip(tensors, grads, strict=True):
                p.grad = torch.zeros_like(p) if g is None else _like(g, p)
            del grads
            self.optimizer.step()
        finally:
            for p, g in zip(tensors, kept, strict=True):
                p.grad = g
        return float(loss.detach())

    def probs(self, batch: ProbeBatch) -> torch.Tensor:
        """pi at the current parameters (`completion_probs`), in the update's precision (float64_step: the float64
        model at the float64 point, `as_float64`)."""
        if self._step64():
            values = None
            if self._theta64 is None:
                self._round_in()  # (theta_0 itself in the parameters: `as_float64` upcasts them)
            else:
                values = {id(p): self._theta64[n] for n, p in self.params.items()}
            with as_float64(self.model, values):
                return completion_probs(self.model, batch)
        return completion_probs(self.model, batch)

    def _step64(self) -> bool:
        return self._mode == FLOAT64_STEP

    def _round_in(self) -> None:
        """float64_step: the model's parameters hold the current point rounded to their dtype (theta_0: their own)."""
        if not self._step64() or self._rounded:
            return
        if self._sharded:  # (written into the shards in place; theta_0's put back on exit)
            if self._theta64 is None:
                self.start.restore(self.params)
            else:
                with torch.no_grad():
                    for n, p in self.params.items():
                        local(p).copy_(self._theta64[n])
        elif self._theta64 is None:
            _swap_in(self.params, self.start.tensors)
        else:
            _swap_in(self.params, {n: self._theta64[n].to(p.dtype) for n, p in self.params.items()})
        self._rounded = True

    def current(self) -> dict[str, torch.Tensor]:
        """The current point, name -> tensor (float64_step: the float64 one; FSDP2: this rank's shards)."""
        if self._step64():
            return self._theta64 if self._theta64 is not None else self.start.tensors
        return {n: local(p).detach() for n, p in self.params.items()}

    def pi_start(self, batch: ProbeBatch, given: torch.Tensor | None = None) -> torch.Tensor:
        """pi at theta_0 in the update's precision, measured once per batch (before any step). ``given``: pi at
        theta_0 already measured in the same precision (`fix_pi_old` with the same ``precision``; a float32 pi
        differs from a float64 one by more than a small step's change), used as it is."""
        if self._pi_start is not None and self._pi_start[0] is batch:
            return self._pi_start[1]
        if self._moved:
            raise RuntimeError("change: pi_start must be measured before the first step")
        pi = given if given is not None else self.probs(batch)
        self._pi_start = (batch, pi)
        return pi

    def norm2(self) -> float:
        """||theta||^2 at the current parameters (float64 sums over every rank)."""
        return self._sum_over_ranks(sum(dot64(t, t) for t in self.current().values()))

    def distance(self, saved: Saved | None = None) -> float:
        """||theta - theta_saved|| (theta_0 by default), float64 sums, the saved point brought from host memory one
        tensor at a time."""
        ref = (saved or self.initial()).params
        num = 0.0
        for n, t in self.current().items():
            d = t - ref.tensors[n].to(t.device, non_blocking=True)
            num += dot64(d, d)
            del d
        return self._sum_over_ranks(num) ** 0.5

    def resolution(
        self,
        step_norm: float,
        before_norm: float | None = None,
        steps: int = 1,
        signal: bool | None = None,
    ) -> Resolution:
        """The `Resolution` of a displacement of norm ``step_norm`` from a state of norm ``before_norm`` (default
        ||theta_0||) made in ``steps`` stored steps; a "no update" unless ``signal`` (default: some step since entry
        or the last `load` carried a policy-gradient signal, ``self.signal``)."""
        before = self.start_norm2**0.5 if before_norm is None else before_norm
        u = unit_roundoff(self.step_dtype)
        signal = self.signal if signal is None else signal
        if step_norm > 0:
            rounding = steps * u * (before + step_norm) / step_norm
        else:  # no displacement: none lost, or, for an update, all of it
            rounding = float("inf") if signal else 0.0
        return Resolution(
            float(step_norm), str(self.step_dtype).removeprefix("torch."), float(rounding), not signal
        )

    def relative_step(self) -> float:
        """||theta - theta_0|| / ||theta_0|| over every trainable parameter (`distance`)."""
        return self.distance() / self.start_norm2**0.5 if self.start_norm2 > 0 else float("nan")

    def save(self) -> Saved:
        """The current point (parameters and optimizer state) in host memory; before any step, theta_0 itself (no
        second snapshot); with plain SGD steps swapped in, the current tensors themselves (never written)."""
        if not self._moved:
            return Saved(self.start, self._fresh_state)
        if self._step64():
            return Saved(HostSnapshot.borrowed(self.current()), self._fresh_state)
        if self._swap:
            return Saved(HostSnapshot.borrowed(self.params), self._fresh_state)
        return Saved(HostSnapshot(self.params), _state_to_host(self.optimizer.state_dict()))

    def initial(self) -> Saved:
        """theta_0 and the analysis optimizer's state at entry (`load` it to start over)."""
        return Saved(self.start, self._fresh_state)

    def load(self, saved: Saved) -> None:
        """Back to a saved point: parameters copied in place (plain SGD swapped in: the saved tensors put back), the
        optimizer's state loaded (as a copy)."""
        if self._step64():
            at_start = saved.params is self.start
            self._theta64 = None if at_start else dict(saved.params.tensors)
            self._rounded = False
        elif self._swap:
            _swap_in(self.params, saved.params.tensors)
        else:
            saved.params.restore(self.params)
        reshard(self.model)
        self.optimizer.load_state_dict(_state_to_host(saved.optimizer))
        self._moved = saved.params is not self.start
        self.step_signal, self.signal = None, False
