"""The per-token shares s_t = <grad l_t, g> / ||g||^2 of `tokendyn.effects.shares` by one forward-mode JVP along g,
for one direction or several at once."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from tokendyn.effects.shares_sums import dot64
from tokendyn.probe.parallel import fsdp_modules
from tokendyn.probe.tokenloss import (
    Objective,
    ProbeBatch,
    analysis_forward,
    completion_logp,
    completion_logp_entropy,
    eval_mode,
    loss_terms,
    token_loss,
    trainable_parameters,
)

# the per-token JVP goes through `torch.func.functional_call`, whose substituted parameters FSDP2's hooks replace
FSDP_NO_TOKEN_SHARES = (
    "shares: per-token shares (the token_shares record, the shares' jvp_share) are not computed on FSDP2-sharded "
    "parameters: their forward-mode JVP substitutes the parameters, which FSDP2's gathering replaces; the per-bin "
    "shares, norms and every other analysis are exact"
)


def jvp_attention(model: nn.Module) -> AbstractContextManager:
    """The attention kernels forward-mode AD can go through: eager as is, SDPA restricted to its math kernel."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or "eager"
    if impl == "eager":
        return nullcontext()
    if impl == "sdpa":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.MATH)
    raise ValueError(
        f"shares: per-token shares need forward-mode AD, which attn_implementation={impl!r} does not support; "
        "load the model with attn_implementation='eager' or 'sdpa'"
    )


@analysis_forward
def token_shares(
    model: nn.Module,
    batch: ProbeBatch,
    direction: dict[str, torch.Tensor],
    *,
    objective: Objective | None = None,
) -> torch.Tensor:
    """s_t = <grad_theta l_t, v> / ||v||^2 for every completion token, (B, C) float64, zero on padding, from one
    forward-mode JVP of the per-token terms along v (``direction``: name -> tensor, e.g. g = `BinGradients.total`).
    With v = g: sum_t s_t = 1 and sum_{t in b} s_t = s_b."""
    params = trainable_parameters(model)
    missing = [n for n in direction if n not in params]
    if missing:
        raise ValueError(f"shares: direction has tensors for unknown or frozen parameters: {missing[:3]}")
    names = list(direction)
    primals = tuple(params[n].detach() for n in names)
    tangents = tuple(direction[n].detach().to(dtype=params[n].dtype, device=params[n].device) for n in names)
    norm2 = sum(dot64(v, v) for v in tangents)
    if norm2 == 0.0:
        raise ValueError("shares: the direction is zero (no advantage on any token?); shares are undefined")

    def terms(*ps: torch.Tensor) -> torch.Tensor:
        return token_loss(model, batch, objective, dict(zip(names, ps, strict=True))).terms

    # forward-mode AD keeps no activations for a backward: nothing to checkpoint (and checkpointing refuses jvp)
    with eval_mode(model, checkpoint=False), jvp_attention(model), _no_input_require_grads(model):
        _, dterms = torch.func.jvp(terms, primals, tangents)
    return dterms.detach().to(torch.float64) / norm2


def token_shares_many(
    model: nn.Module,
    items: list[tuple[ProbeBatch, dict[str, torch.Tensor], Objective | None]],
    tangents: dict[str, torch.Tensor] | None = None,
    *,
    strict: bool = False,
) -> list[torch.Tensor]:
    """`token_shares` of several (batch, direction v_i, objective) at once: s_i,t = <grad l_t(batch_i, objective_i),
    v_i> / ||v_i||^2. Batches that differ at most in their advantages and rewards (one forward for all: the same
    tokens, masks and temperature) share one forward-mode pass with the directions batched (``torch.func.vmap`` over
    the tangents: the primal forward made once, 1.25 s less of 9.2 s per direction on SmolLM2-135M); otherwise,
    and under FSDP2, one `token_shares` each, as where vmap refuses an op (unless ``strict``: raised). ``tangents``:
    name -> (len(items), *shape) tensor holding the directions stacked (no second copy of them is made), else
    stacked here."""
    same = all(same_forward(items[0][0], b) for b, _, _ in items[1:])
    if len(items) < 2 or not same or fsdp_modules(model):
        return [token_shares(model, b, d, objective=o) for b, d, o in items]
    params = trainable_parameters(model)
    names = list(items[0][1])
    if any(list(d) != names for _, d, _ in items) or any(n not in params for n in names):
        raise ValueError("shares: the directions must name the same trainable parameters")
    primals = tuple(params[n].detach() for n in names)
    if tangents is None:
        tangents = {n: torch.stack([d[n].detach() for _, d, _ in items]) for n in names}
    stacked = tuple(tangents[n].to(dtype=params[n].dtype, device=params[n].device) for n in names)
    norms = [sum(dot64(d[n], d[n]) for n in names) for _, d, _ in items]
    if any(x == 0.0 for x in norms):
        raise ValueError("shares: a direction is zero (no advantage on any token?); shares are undefined")
    objectives = [o or Objective() for _, _, o in items]
    entropy = any(o.needs_entropy for o in objectives)
    batch = items[0][0]

    def terms(*ps: torch.Tensor) -> torch.Tensor:
        named = dict(zip(names, ps, strict=True))
        if entropy:
            logp, h = completion_logp_entropy(model, batch, named)
        else:
            logp, h = completion_logp(model, batch, named), None
        return torch.stack(
            [loss_terms(logp, b, o, h) for (b, _, _), o in zip(items, objectives, strict=True)]
        )

    try:
        with eval_mode(model, checkpoint=False), jvp_attention(model), _no_input_require_grads(model):
            # (randomness "same": a rule drawing random numbers, Clip-Cov, draws them once for every direction, as
            # one forward would; its draws come from its own seeded generator)
            dterms = torch.func.vmap(lambda *t: torch.func.jvp(terms, primals, t)[1], randomness="same")(
                *stacked
            )
    except RuntimeError:  # (an op vmap has no batching rule for: one JVP each, the same numbers)
        if strict:
            raise
        return [token_shares(model, b, d, objective=o) for b, d, o in items]
    return [dterms[i, i].detach().to(torch.float64) / norms[i] for i in range(len(items))]


def same_forward(a: ProbeBatch, b: ProbeBatch) -> bool:
    """Whether the two batches' model forward is the same (tokens, masks, temperature)."""
    same = a.temperature == b.temperature
    for name in ("input_ids", "attention_mask", "completion_mask"):
        x, y = getattr(a, name), getattr(b, name)
        same = same and (x is y or (x.shape == y.shape and torch.equal(x, y.to(x.device))))
    return same


@contextlib.contextmanager
def _no_input_require_grads(model: nn.Module):
    """Gradient checkpointing makes HF models call ``requires_grad_`` on the embeddings' output in a forward
    hook (``enable_input_require_grads``; the trainers may register it more than once), which functorch
    transforms refuse: set those hooks aside for the JVP and put them back after."""
    stashed = []
    for module in model.modules():
        hooks = module._forward_hooks
        for key, fn in list(hooks.items()):
            if getattr(fn, "__name__", "") == "make_inputs_require_grads":
                stashed.append((hooks, key, fn))
                del hooks[key]
    try:
        yield
    finally:
        for hooks, key, fn in stashed:
            hooks[key] = fn
