"""Probability change of the sampled tokens after an update, and the correct ratios (DESIGN.md).

    delta_pi_t = pi_after(o_t) - pi_before(o_t)      (same tokens, same temperature, eval mode)

(a) `counterfactual_change`: an update of the parameters, by default the paper's diagnostic (plain SGD, lr 1e-3,
    one step on the full loss L = sum_t l_t, or on the loss restricted to a token set), made exactly, not to first
    order. It is applied in place and undone exactly (`InPlaceUpdate`): by default on float64 copies of the
    parameters swapped into the model for the analysis (a step of 1e-6 of |theta| is partly lost to float32
    rounding, entirely to bf16's; the copy costs 8 bytes a parameter on the device, the model's own parameters are
    not touched), with precision "model" on the model's own parameters: in host memory (CPU), plain SGD's steps as
    new tensors swapped into them (theta_0 never written, no copy of it); on a GPU, or with another optimizer, in
    place after a copy to host memory, tensor by tensor, copied back bitwise when the analysis ends, also on an
    exception (no copy on the device: a 7B model in bf16 costs 15 GB of host memory instead), with precision "float64_step" (plain SGD only)
    from the gradient in the model's dtype, the step and pi after it in float64 (a float64 copy of the parameters
    only while a step is off theta_0: no float64 activations kept for a backward, no float64 gradients). Each step records how finely it was
    resolved (`Resolution`).
    ``.grad`` of every parameter is set aside during the step and put back, hooks are untouched, and any
    ``torch.optim`` optimizer can make the step (its state, e.g. Adam's moments,
    lives on the device for the analysis only; the trainer's optimizer is never touched). Several stages run in
    sequence with the same optimizer (Lopti: stage 1 then stage 2, pi_old fixed).
(b) `real_change`: pi before (a tensor measured before the optimizer step, or a model) and after a real update
    (re-forward of the same tokens, no grad, mode restored).

Correct ratios (per bin): among A_t > 0 tokens increased / (increased + decreased); among A_t < 0 decreased /
(increased + decreased); pooled = (both numerators) / (both denominators). A tie (delta_pi_t = 0 at float64
resolution) is counted apart (tie_pos, tie_neg), never as a failure. Tokens with A_t = 0 are in neither.

Resolution: pi is measured with a float64 log-softmax of the model's logits (`completion_probs`), so a
near-certain token (1 - pi ~ 1e-7) whose logit margin rises is seen to rise; in float32 its log pi is 0.0 exactly
before and after, and the change would read as a tie.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from tokendyn.effects.resolution import (
    STEP_ROUNDING_LIMIT,
    Resolution,
    policy_signal,
    resolution_columns,
    unit_roundoff,
    warn_unresolved,
)
from tokendyn.effects.shares import dot64
from tokendyn.probe.bins import bin_bounds
from tokendyn.probe.float64 import as_float64
from tokendyn.probe.parallel import check_wholly_sharded, gradients, local, reshard, sum_over_ranks
from tokendyn.probe.tokenloss import (
    Objective,
    ProbeBatch,
    analysis_forward,
    completion_logp,
    eval_mode,
    loss_and_measured_logp,
    token_loss,
    trainable_parameters,
)
from tokendyn.records import to_frame
from tokendyn.vocab import FLOAT64, FLOAT64_STEP, LOPTI, STEP_PRECISIONS, TRAIN

OptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]
QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)
# (the resolution of a step, and whether it was an update at all, are `tokendyn.effects.resolution`'s; re-exported)
__all__ = [
    "STEP_ROUNDING_LIMIT",
    "Resolution",
    "resolution_columns",
    "unit_roundoff",
    "warn_unresolved",
]


def sgd(lr: float = 1e-3) -> OptimizerFactory:
    """The paper's diagnostic optimizer: plain SGD (no momentum, no weight decay)."""
    if not float(lr) > 0:
        raise ValueError(f"change: lr must be > 0, got {lr!r}")
    return lambda params: torch.optim.SGD(params, lr=float(lr), momentum=0.0, weight_decay=0.0)


@analysis_forward
def completion_probs(
    model: nn.Module, batch: ProbeBatch, params: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """pi_t(o_t) at the batch temperature, (B, C) float64, without grad, in eval mode (mode restored); the
    log-softmax is taken in float64 (`completion_logp`'s ``float64``) so that a change of a near-certain token's
    probability keeps its sign."""
    with torch.no_grad(), eval_mode(model):
        return torch.exp(completion_logp(model, batch, params, float64=True))


class HostSnapshot:
    """A bitwise copy of tensors in host memory (CPU; pinned when they live on a GPU), taken and put back tensor by
    tensor: at no time is there a second copy of all of them on the device."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = {n: _to_host(local(t)) for n, t in tensors.items()}  # FSDP2: this rank's shard

    @classmethod
    def borrowed(cls, tensors: dict[str, torch.Tensor]) -> HostSnapshot:
        """The tensors themselves (detached, no copy, wherever they live), for tensors nothing writes while the
        snapshot is held: the model's own weights while float64 copies stand in for them (`InPlaceUpdate`)."""
        snap = cls.__new__(cls)
        snap.tensors = {n: local(t).detach() for n, t in tensors.items()}
        return snap

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy every saved tensor back into the (same-named, same-shape) tensor given, in place."""
        with torch.no_grad():
            for n, t in tensors.items():
                local(t).copy_(self.tensors[n])


def _to_host(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone()
    try:  # pinned: faster copies to and from the GPU
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    except RuntimeError:  # pinning refused (e.g. a locked-memory limit): pageable memory
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return out.copy_(t)


def _state_to_host(obj):
    """An optimizer ``state_dict`` with every tensor copied to host memory (the state is not aliased)."""
    if torch.is_tensor(obj):  # (a DTensor's state, FSDP2, stays a copy of its shard on the device)
        return obj.detach().clone() if local(obj) is not obj else _to_host(obj)
    if isinstance(obj, dict):
        return {k: _state_to_host(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_state_to_host(v) for v in obj)
    return obj


def _like(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The gradient g (FSDP2: this rank's shard) in the layout of the parameter p (a DTensor: the same shard)."""
    if local(p) is p:
        return g
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())


def _plain_sgd(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps theta - s g with a scalar s per parameter and no state: plain SGD
    (`torch.optim.SGD` itself: no momentum, weight decay, nesterov or maximize, float learning rates: s = lr), or an
    optimizer saying so with a ``step_scales(params, grads) -> {id(param): s}`` method (the comparison's
    `NormalizedSGD`). `InPlaceUpdate` then makes its step as new tensors swapped into the parameters
    (``torch.add(theta, g, alpha=-s)``: the kernel of their own ``add_``, so the same floats), so that theta_0 is
    never written and needs no copy."""
    if hasattr(optimizer, "step_scales"):
        return True
    return type(optimizer) is torch.optim.SGD and all(
        (g["momentum"], g["weight_decay"], g["nesterov"], g["maximize"]) == (0, 0, False, False)
        and not torch.is_tensor(g["lr"])
        for g in optimizer.param_groups
    )


def swaps_steps(model: nn.Module) -> bool:
    """Whether `InPlaceUpdate` makes plain SGD's steps in the model's dtype as new tensors swapped in (`_plain_sgd`):
    for unsharded parameters in host memory (CPU), where theta_0 then needs no host copy, so a parameter-sized buffer
    more (the stepped tensors, a kept gradient) costs no more than that copy did. On a GPU the copy of theta_0 goes to
    host memory and the step is in place: no second copy of the parameters on the device."""
    params = list(trainable_parameters(model).values())
    return not _sharded(model) and all(p.device.type == "cpu" for p in params)


def _step_scales(optimizer: torch.optim.Optimizer, params: list, grads: list) -> dict[int, float]:
    """id(parameter) -> s of a `_plain_sgd` optimizer's step theta - s g with these gradients."""
    if hasattr(optimizer, "step_scales"):
        return optimizer.step_scales(params, grads)
    return {id(p): float(group["lr"]) for group in optimizer.param_groups for p in group["params"]}


def _swap_in(params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """Each parameter's data replaced by the same-named tensor (no copy, nothing written)."""
    for n, p in params.items():
        p.data = tensors[n]


def step_mode(model: nn.Module, optimizer: OptimizerFactory, precision: str) -> str:
    """The precision `InPlaceUpdate` steps in for ``precision``: "float64_step" with another optimizer than plain
    SGD is "float64" (its state in float64 too, every op float64); on an FSDP2-sharded model "float64" is
    "float64_step" (no float64 backward of a sharded model: the gradient in the shards' dtype), which needs plain
    SGD there."""
    precision = _sharded_float64_mode(model, precision)
    if precision == FLOAT64_STEP and not _plain_sgd(optimizer(list(trainable_parameters(model).values()))):
        if _sharded(model):
            raise ValueError(
                "change: float64 steps of an FSDP2-sharded model need plain SGD (step_precision 'model' for "
                "another optimizer)"
            )
        precision = FLOAT64
    return precision


def _sharded_float64_mode(model: nn.Module, precision: str) -> str:
    """Precision "float64" on an FSDP2-sharded model is "float64_step" (no float64 backward of a sharded model)."""
    return FLOAT64_STEP if precision == FLOAT64 and _sharded(model) else precision


@dataclass
class Saved:
    """The parameters and the analysis optimizer's state at one point of an `InPlaceUpdate` (host memory)."""

    params: HostSnapshot
    optimizer: dict


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


@dataclass
class ChangeResult:
    """pi before every stage and after the last, and delta pi per stage (relative to the state the stage started
    from); ``delta["lopti"]`` is after the last stage minus before the first (present with two or more stages).
    ``resolution``: per stage (and lopti) how finely its step was resolved (`Resolution`)."""

    pi_before: torch.Tensor  # (B, C) float64
    pi_after: dict[str, torch.Tensor] = field(default_factory=dict)
    delta: dict[str, torch.Tensor] = field(default_factory=dict)
    losses: dict[str, float] = field(default_factory=dict)
    param_step: dict[str, float] = field(
        default_factory=dict
    )  # ||theta - theta_0|| / ||theta_0|| after each stage
    resolution: dict[str, Resolution] = field(default_factory=dict)


@analysis_forward
def fix_pi_old(
    model: nn.Module, batch: ProbeBatch, pi_before: torch.Tensor | None = None, precision: str = "model"
) -> tuple[ProbeBatch, torch.Tensor]:
    """(batch with old_logp set, pi_before): an on-policy batch gets pi_old = the current pi, fixed for every later
    stage (as the trainer does: pi_old is not recomputed between Lopti stages). ``pi_before``: pi at the current
    parameters (`completion_probs`) when the caller measured it already, for a batch whose pi_old is fixed (no
    forward then; it must have been measured in ``precision``). ``precision`` "float64": pi is the float64 model's
    (`as_float64`; FSDP2-sharded too), and so is an on-policy batch's pi_old (the ratio pi / pi_old of the float64
    steps exactly 1 at theta_0); "float64_step": pi is the float64 model's, pi_old the loss's own in the model's
    dtype, where that precision takes its gradients (its ratio exactly 1 at theta_0, as the model-dtype steps' is:
    for bf16 weights the float64 pi_old would be off by percents there; one more forward without grad)."""
    if batch.old_logp is not None and pi_before is not None:
        return batch, pi_before
    precision = _sharded_float64_mode(model, precision)  # (the steps' own: `step_mode`)
    if precision == FLOAT64_STEP and batch.old_logp is None:
        batch = batch.with_old_logp(loss_and_measured_logp(model, batch)[0])
    with as_float64(model) if precision in (FLOAT64, FLOAT64_STEP) else nullcontext():
        if batch.old_logp is not None:
            return batch, completion_probs(model, batch)
        logp, logp64 = loss_and_measured_logp(model, batch)  # pi_old: the loss's own log pi, ratio 1 at start
    return batch.with_old_logp(logp), torch.exp(logp64)


def _sharded(model: nn.Module) -> bool:
    return any(local(p) is not p for p in model.parameters())


@analysis_forward
def counterfactual_change(
    model: nn.Module,
    batch: ProbeBatch,
    stages: Sequence[tuple[str, torch.Tensor | None]] | None = None,
    *,
    lr: float = 1e-3,
    optimizer: OptimizerFactory | None = None,
    objective: Objective | None = None,
    pi_before: torch.Tensor | None = None,
    precision: str = "float64",
) -> ChangeResult:
    """delta pi of every completion token after counterfactual update(s) of the parameters, made in place and
    undone exactly (`InPlaceUpdate`: the model is left bitwise as it was).

    ``stages``: (name, token mask or None for all tokens), applied in order with the same optimizer, each one
    step on L_mask = sum_{t in mask} l_t; default ``[("train", None)]``, the paper's one-step diagnostic. Lopti:
    ``[("low", low), ("high", high)]`` (`tokendyn.vocab`). ``optimizer``: params -> torch.optim.Optimizer; default
    plain SGD(lr). ``pi_before``: as in `fix_pi_old`. ``precision``: the steps' (`InPlaceUpdate`); each stage's
    `Resolution` is in ``resolution`` (a stage without a policy-gradient signal is "no update" there, not warned
    about: `tokendyn.effects.resolution`; "lopti" is one when neither stage is an update).
    """
    stages = [(TRAIN, None)] if stages is None else list(stages)
    if not stages:
        raise ValueError("change: stages must hold at least one (name, mask)")
    names = [s[0] for s in stages]
    if len(set(names)) != len(names) or LOPTI in names:
        raise ValueError(f"change: stage names must be distinct and not {LOPTI!r}, got {names}")
    optimizer = optimizer or sgd(lr)
    batch, pi0 = fix_pi_old(model, batch, pi_before, step_mode(model, optimizer, precision))
    with InPlaceUpdate(model, optimizer, objective, precision) as update:
        pi0 = update.pi_start(batch, pi0)
        result = ChangeResult(pi0)
        before, before_norm, mark = pi0, update.start_norm2**0.5, None
        for i, (name, mask) in enumerate(stages):
            result.losses[name] = update.step(batch, mask)
            result.param_step[name] = update.relative_step()
            result.resolution[name] = update.resolution(
                update.distance(mark), before_norm, signal=update.step_signal
            )
            after = update.probs(batch)
            result.pi_after[name] = after
            result.delta[name] = _masked(after - before, batch.completion_mask)
            before = after
            if i + 1 < len(stages):  # the next stage's step is measured from here
                mark, before_norm = update.save(), update.norm2() ** 0.5
    if len(stages) > 1:
        result.delta[LOPTI] = _masked(before - pi0, batch.completion_mask)
        result.param_step[LOPTI] = result.param_step[stages[-1][0]]
        result.resolution[LOPTI] = update.resolution(
            result.param_step[LOPTI] * update.start_norm2**0.5, steps=len(stages)
        )
    for name, res in result.resolution.items():
        warn_unresolved(f"change ({name})", res)
    return result


@analysis_forward
def real_change(before: torch.Tensor | nn.Module, after: nn.Module, batch: ProbeBatch) -> torch.Tensor:
    """delta pi = pi_after - pi_before on the batch's completion tokens, (B, C) float64, zero on padding.
    ``before``: pi measured before the update (`completion_probs`, taken before the optimizer step) or the model
    before the update; ``after``: the model after it. Side-effect free (no grad, each module's mode restored)."""
    pi_before = completion_probs(before, batch) if isinstance(before, nn.Module) else before.to(torch.float64)
    pi_after = completion_probs(after, batch)
    if pi_before.shape != pi_after.shape:
        raise ValueError(
            f"change: before has shape {list(pi_before.shape)}, the batch's completion {list(pi_after.shape)}"
        )
    return _masked(pi_after - pi_before.to(pi_after.device), batch.completion_mask)


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.to(x.device), x, torch.zeros_like(x))


def correct_ratios(
    delta: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> dict[str, float | int]:
    """Correct ratios on the tokens of ``mask``, ties apart (DESIGN.md):

        n_pos = #(A > 0), tie_pos = #(A > 0, dpi = 0),  correct_pos = #(A > 0, dpi > 0) / (n_pos - tie_pos)
        n_neg = #(A < 0), tie_neg = #(A < 0, dpi = 0),  correct_neg = #(A < 0, dpi < 0) / (n_neg - tie_neg)
        correct_pooled = (both numerators) / (both denominators)

    A tie (no change at the measurement's float64 resolution) is neither correct nor wrong. NaN for 0/0; tokens
    with A = 0 are in neither sign."""
    m = mask.bool()
    a, d = advantages.to(delta.device)[m], delta[m]
    pos, neg = a > 0, a < 0
    n_pos, n_neg = int(pos.sum()), int(neg.sum())
    tie_pos, tie_neg = int((pos & (d == 0)).sum()), int((neg & (d == 0)).sum())
    up, down = int((pos & (d > 0)).sum()), int((neg & (d < 0)).sum())

    def ratio(num: int, den: int) -> float:
        return num / den if den else float("nan")

    return {
        "n_pos": n_pos,
        "n_neg": n_neg,
        "tie_pos": tie_pos,
        "tie_neg": tie_neg,
        "correct_pos": ratio(up, n_pos - tie_pos),
        "correct_neg": ratio(down, n_neg - tie_neg),
        "correct_pooled": ratio(up + down, n_pos + n_neg - tie_pos - tie_neg),
    }


def delta_summary(
    delta: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> dict[str, float | int]:
    """Distribution of delta pi over the tokens of ``mask``: count, mean, std, mean_abs, min, q01 .. q99, max, and
    the correct ratios (`correct_ratios`). NaN where there is no token."""
    x = delta[mask.bool()].to(torch.float64)
    n = int(x.numel())
    nan = float("nan")
    out: dict[str, float | int] = {"count": n}
    out["mean"] = float(x.mean()) if n else nan
    out["std"] = float(x.std(unbiased=False)) if n else nan
    out["mean_abs"] = float(x.abs().mean()) if n else nan
    out["min"] = float(x.min()) if n else nan
    qs = torch.quantile(x, torch.tensor(QUANTILES, dtype=torch.float64)) if n else None
    for i, q in enumerate(QUANTILES):
        out[f"q{round(q * 100):02d}"] = float(qs[i]) if n else nan
    out["max"] = float(x.max()) if n else nan
    out.update(correct_ratios(delta, advantages, mask))
    return out


def null_summary() -> dict[str, None]:
    """`delta_summary`'s keys, every value null: the record of a step that was no update
    (`tokendyn.effects.resolution`), whose delta pi is no measurement."""
    keys = ("count", "mean", "std", "mean_abs", "min", *(f"q{round(q * 100):02d}" for q in QUANTILES), "max")
    keys += ("n_pos", "n_neg", "tie_pos", "tie_neg", "correct_pos", "correct_neg", "correct_pooled")
    return dict.fromkeys(keys)


def change_frame(
    delta: torch.Tensor,
    batch: ProbeBatch,
    bins: torch.Tensor,
    edges: torch.Tensor,
    *,
    step: int,
    stage: str = "train",
    update: str = "counterfactual",
    update_stage: str = TRAIN,
    source_bin: int = -1,
    lr: float | None = None,
    param_step: float | None = None,
    resolution: Resolution | None = None,
    limit: bool = False,
):
    """The `prob_change` record of one delta pi: one row per bin of pi_old (``bins``: (B, C), -1 on padding) and
    one for all tokens (bin -1). ``update``: "counterfactual", "sweep" (the counterfactual step at another step size,
    `tokendyn.effects.rebalance.RebalanceOptions.lr_sweep`) or "real"; ``update_stage``: "train", "low", "high",
    "lopti" (`tokendyn.vocab`); ``source_bin``: the bin the update was restricted to (-1: all tokens); ``param_step``: the update's
    ||delta theta|| / ||theta||; ``resolution``: how finely a counterfactual step was resolved (`Resolution`; null
    for a real update); a step that was no update has null statistics (`null_summary`). ``limit``: ``delta`` is the
    lr -> 0 limit of the step, d pi / d lr at lr = 0 (`tokendyn.effects.limit`; its rows have lr 0 and update
    "sweep")."""

    rows = []
    k = edges.numel() - 1
    for b in [-1, *range(k)]:
        mask = batch.completion_mask if b < 0 else (bins == b)
        lo, hi = bin_bounds(edges, b)
        row = {
            "step": step,
            "stage": stage,
            "update": update,
            "update_stage": update_stage,
            "source_bin": source_bin,
            "bin": b,
            "bin_lo": lo,
            "bin_hi": hi,
            "lr": lr,
            "param_step": param_step,
            **resolution_columns(resolution),
            "limit": limit,
        }
        none = resolution is not None and resolution.no_update
        row.update(null_summary() if none else delta_summary(delta, batch.advantages, mask))
        rows.append(row)
    return to_frame("prob_change", {c: [r[c] for r in rows] for c in rows[0]})
