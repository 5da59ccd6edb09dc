"""The model's forward for the analyses: per-token log pi_t (and H_t) of every completion token of a `ProbeBatch`.

Alignment: only the logits of positions S-C-1 .. S-2 (those predicting the C completion tokens) are computed,
through the model's own unfused LM head.

Memory: the backbone runs once; its final hidden states of those positions go through the LM head in chunks of at
most `chunk_tokens(V)` tokens (their float64 logits within `CHUNK_BYTES`), each reduced to log pi (and H) before the
next, so no [B, C, V] tensor in float32 or float64 exists; under autograd each chunk is recomputed in the backward
(``torch.utils.checkpoint``), so the graph holds the hidden states, not the logits. A model whose logits are not a
plain affine map of its backbone's output (soft-capping, scaling) is called whole (``logits_to_keep = C + 1``): one
[B, C + 1, V] tensor in the model's dtype, as TRL's training forward holds, and the same chunked log-softmax.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
import weakref
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

from tokendyn.probe.batch import ProbeBatch
from tokendyn.probe.eval_mode import _checkpoint, checkpointed_layers, eval_mode  # noqa: F401 (re-exported)
from tokendyn.probe.logp_math import logp_and_entropy, logp_float64, minp_proxy_logp


def trainable_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> parameter, for every parameter that requires grad (tied weights appear once)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


# Logits are never held for every completion token at once: the LM head is applied to chunks of at most
# `chunk_tokens(V)` tokens, whose float64 logits [n, V] take at most CHUNK_BYTES (Qwen2.5's V = 152,064: 220 tokens).
CHUNK_BYTES = 1 << 28
_SPLIT_OK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HEAD_OK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # the same check with the soft cap modelled
_ANALYSIS = contextvars.ContextVar("tokendyn_analysis_forward", default=False)


def analysis_forward(fn):
    """Decorator of the analyses' entry points: inside them the model's forward may stop at the backbone even when
    hooks sit on the model itself (a `GradientProbe`'s, which the analyses' forwards must not feed: they are not
    training passes). Outside, a model with such hooks is called whole, so that they see the forward."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        token = _ANALYSIS.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _ANALYSIS.reset(token)

    return wrapped


def chunk_tokens(vocab: int, budget: int | None = None) -> int:
    """n = max(1, floor(budget / (8 V))): the tokens per chunk whose float64 logits [n, V] fit in ``budget`` bytes
    (default `CHUNK_BYTES`)."""
    return max(1, int(CHUNK_BYTES if budget is None else budget) // (8 * max(int(vocab), 1)))


@dataclass
class _Features:
    """What the LM head is applied to, one row per completion token (N = B * C, row-major over (B, C)): the final
    hidden states h (N, H) with the head's weight and bias, or, for a model whose head is not a plain affine map
    of a backbone's output, its logits (N, V) in the model's dtype (weight None)."""

    x: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None


class _Parts(nn.Module):
    """Backbone and head of a causal LM, called apart (under ``functional_call`` the swapped tensors are used)."""

    def __init__(self, lm: nn.Module, backbone: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.lm = lm
        object.__setattr__(self, "_backbone", backbone)  # submodules of lm: not registered twice
        object.__setattr__(self, "_head", head)

    def forward(self, input_ids, attention_mask):
        out = self._backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return h, self._head.weight, self._head.bias


def _peft_base(model: nn.Module) -> nn.Module | None:
    """The Hugging Face causal LM inside PEFT's wrappers (PeftModel or PeftMixedModel -> its tuner, e.g. LoraModel ->
    the model, whose layers hold the adapters), the model itself when it is not wrapped, None for a prompt-learning
    adapter (prefix / prompt tuning: the wrapper's forward adds virtual tokens, so the inner model's backbone alone
    is not the model's forward). A model can only be wrapped by PEFT once PEFT is imported (``sys.modules``)."""
    peft = sys.modules.get("peft")
    if peft is None:
        return model
    wrappers = tuple(
        c for c in (getattr(peft, "PeftModel", None), getattr(peft, "PeftMixedModel", None)) if c
    )
    if wrappers and isinstance(model, wrappers):
        config = getattr(model, "active_peft_config", None)
        if getattr(config, "is_prompt_learning", False):
            return None
        model = model.base_model
    tuner = getattr(sys.modules.get("peft.tuners.tuners_utils"), "BaseTuner", None)
    if tuner is not None and isinstance(model, tuner):
        model = model.model
    return model


def _split(model: nn.Module, softcap: bool = False) -> tuple[nn.Module, nn.Linear] | None:
    """(backbone, head) when logits = head(backbone(ids).last_hidden_state) with a plain `nn.Linear` head (a Hugging
    Face causal LM, also inside a PEFT wrapper (`_peft_base`): its ``base_model_prefix`` names the backbone), else
    None. Both are submodules of ``model``, so parameters substituted by their names in ``model`` reach them."""
    from tokendyn.probe.points import head_transform_supported

    lm = _peft_base(model)
    if lm is None:
        return None
    prefix = getattr(lm, "base_model_prefix", None)
    backbone = getattr(lm, prefix, None) if isinstance(prefix, str) and prefix else None
    get_head = getattr(lm, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(backbone, nn.Module) or backbone is lm or type(head) is not nn.Linear:
        return None
    return (backbone, head) if head_transform_supported(lm, softcap=softcap) else None


def _split_checked(
    model: nn.Module, batch: ProbeBatch, softcap: bool = False
) -> tuple[nn.Module, nn.Linear] | None:
    """`_split`, confirmed once per model on the batch's first row: the head applied to the backbone's last hidden
    state (and, with ``softcap``, the model's soft cap c tanh(z / c) after it) reproduces the model's own last logit
    within float rounding (a model that scales its hidden state or logits in its forward, e.g. MiniCPM, falls back
    to the model's full forward, and so does a split whose "backbone" output is not as wide as the head's input)."""
    from tokendyn.probe.points import logit_softcap

    parts = _split(model, softcap=softcap)
    if parts is None:
        return None
    cache = _HEAD_OK if softcap else _SPLIT_OK
    ok = cache.get(model)
    if ok is None:
        ids, mask = batch.input_ids[:1], batch.attention_mask[:1]
        with torch.no_grad(), eval_mode(model):
            kwargs = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
            if _accepts_logits_to_keep(model):
                kwargs["logits_to_keep"] = 1
            out = model(**kwargs)
            want = (out.logits if hasattr(out, "logits") else out[0])[:, -1].float()
            h = _Parts(model, *parts)(ids, mask)[0]
            # a "backbone" whose output is not the head's input (e.g. a wrapper's whole model) is no split
            ok = h.dim() == 3 and h.size(-1) == parts[1].weight.size(1)
            if ok:
                got = torch.nn.functional.linear(h[:, -1], parts[1].weight, parts[1].bias).float()
                cap = logit_softcap(model) if softcap else None
                if cap is not None:
                    got = cap * torch.tanh(got / cap)
                # the same logits to the rounding of the head's dtype (bf16: its soft cap applied in bf16 by the
                # model, in float32 here, differs by ~2^-8 of |z|); a wrong split is off by O(|z|)
                tol = max(1e-3, 8 * torch.finfo(parts[1].weight.dtype).eps)
                ok = bool(((got - want).abs().max() <= tol * want.abs().max() + 1e-6).item())
        cache[model] = ok
    return parts if ok else None


def _splittable(model: nn.Module) -> bool:
    """Whether an analysis forward may stop at the backbone: not for a model with hooks on its own forward outside
    `analysis_forward`, one sharded by FSDP2 (the root's hooks gather the embeddings, final norm and head: it is
    called whole) or one dispatched by accelerate's hooks."""
    from tokendyn.probe.parallel import fsdp_modules

    hooked = bool(model._forward_hooks or model._forward_pre_hooks) and not _ANALYSIS.get()
    return not (hooked or fsdp_modules(model) or hasattr(model, "_hf_hook"))


def _features(model: nn.Module, batch: ProbeBatch, params: dict[str, torch.Tensor] | None) -> _Features:
    """One forward of the model (through ``torch.func.functional_call`` with ``params`` when given), stopping
    before the LM head where it can (`_split_checked`; not for a model with hooks on its own forward outside
    `analysis_forward`, nor one dispatched by accelerate's hooks)."""
    from tokendyn.probe.parallel import fsdp_modules, reshard

    c = batch.n_completion
    sharded = bool(fsdp_modules(model))
    parts = _split_checked(model, batch) if _splittable(model) else None
    if parts is not None:
        call = _Parts(model, *parts)
        args = (batch.input_ids, batch.attention_mask)
        if params is None:
            h, w, b = call(*args)
        else:
            h, w, b = torch.func.functional_call(call, {f"lm.{n}": p for n, p in params.items()}, args)
        h = h[:, -(c + 1) : -1, :]
        return _Features(h.reshape(-1, h.size(-1)), w, b)
    kwargs: dict = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "use_cache": False}
    if _accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = c + 1
    if sharded and params is not None:
        raise ValueError("probe: a model sharded with FSDP2 cannot be called with substituted parameters")
    out = model(**kwargs) if params is None else torch.func.functional_call(model, params, (), kwargs)
    if sharded and not torch.is_grad_enabled():
        reshard(model)  # no backward follows: drop the gathered copy FSDP2 keeps (`parallel.reshard`)
    logits = out.logits if hasattr(out, "logits") else out[0]
    logits = logits[:, -(c + 1) : -1, :]
    return _Features(logits.reshape(-1, logits.size(-1)), None, None)


def head_inputs(
    model: nn.Module, batch: ProbeBatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(h, W, b): the LM head's input for every completion token (B * C, H), row-major over (B, C), with the head's
    weight and bias, from one forward of the backbone (a soft-capped head included: the caller models the cap,
    `tokendyn.probe.points.logit_softcap`); None where the head is not a plain affine map of the backbone's output
    (`_split_checked`), or the forward may not stop there (`_splittable`)."""
    parts = _split_checked(model, batch, softcap=True) if _splittable(model) else None
    if parts is None:
        return None
    h, w, b = _Parts(model, *parts)(batch.input_ids, batch.attention_mask)
    c = batch.n_completion
    h = h[:, -(c + 1) : -1, :]
    return h.reshape(-1, h.size(-1)), w, b


def chunk_logits(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """z = (x W^T + b) / T (x: final hidden states) or z = x / T (x: logits), in float32 or wider, (n, V)."""
    z = x if weight is None else torch.nn.functional.linear(x, weight, bias)
    return z.to(torch.promote_types(z.dtype, torch.float32)) / temperature


def _chunk_values(
    x, weight, bias, ids, temperature: float, kinds: tuple[str, ...], kappa: float | None = None
) -> tuple[torch.Tensor, ...]:
    z = chunk_logits(x, weight, bias, temperature)
    out = []
    if "logp" in kinds or "entropy" in kinds:
        if "entropy" in kinds:
            out.extend(logp_and_entropy(z, ids))
        else:
            out.append(torch.log_softmax(z, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1))
    if "logp64" in kinds:
        out.append(logp_float64(z, ids))
    if "proxy" in kinds:
        out.append(minp_proxy_logp(z, ids, temperature, kappa))
    return tuple(out)


def _token_values(
    model: nn.Module,
    batch: ProbeBatch,
    params: dict[str, torch.Tensor] | None,
    kinds: tuple[str, ...],
    kappa: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """Per-token values of every completion token, (B, C) each, in the order of ``kinds`` (from "logp", "entropy":
    float32 or wider, "logp64": float64), from one forward and the LM head applied chunk by chunk (`chunk_tokens`
    tokens at a time): no [B, C, V] float32 or float64 tensor exists. Under autograd each chunk is recomputed in
    the backward (``torch.utils.checkpoint``): the graph keeps the hidden states, never the logits."""
    f = _features(model, batch, params)
    vocab = f.x.size(-1) if f.weight is None else f.weight.size(0)
    ids = batch.completion_ids.to(f.x.device).reshape(-1)
    n = chunk_tokens(vocab)
    track = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (f.x, f.weight, f.bias)
    )
    pieces = []
    for lo in range(0, ids.numel(), n):
        args = (f.x[lo : lo + n], f.weight, f.bias, ids[lo : lo + n], batch.temperature, kinds, kappa)
        if track and "logp64" not in kinds:
            pieces.append(_checkpoint(_chunk_values, *args))
        else:
            pieces.append(_chunk_values(*args))
    shape = batch.completion_ids.shape
    return tuple(torch.cat([p[i] for p in pieces]).reshape(shape) for i in range(len(kinds)))


def completion_logp(
    model: nn.Module,
    batch: ProbeBatch,
    params: dict[str, torch.Tensor] | None = None,
    *,
    float64: bool = False,
) -> torch.Tensor:
    """log pi_t(o_t) at temperature T for every completion token, (B, C), differentiable.

    z = logits[p(t)] / T with p(t) = t - 1 (see the module docstring), log pi_t = log_softmax(z)[o_t]; computed in
    float32 or wider. With ``params`` the model is called through ``torch.func.functional_call`` with those
    tensors in place of its parameters (the module itself is not modified). The LM head is applied to chunks of
    tokens (`chunk_tokens`), so the full [B, C, V] logits are never materialised (`_token_values`).

    ``float64=True`` (for measuring probability changes, `tokendyn.effects.change`): log pi_t = z_o - logsumexp(z)
    with the model's logits cast to float64 first, chunk by chunk. In float32, log pi_t = z_o - logsumexp(z) is a
    difference of two numbers of size |z| ~ 10-30 whose rounding (~1e-6) swamps 1 - pi below ~1e-6: a near-certain
    token has log pi = 0.0 exactly and no change of it is visible. In float64 the same difference resolves log pi to
    ~1e-14, so a change of pi of 1e-12 still has its sign. What remains is the model's own forward precision: a
    change of the logits below their rounding (float32: ~1e-7 of |z|) is noise.
    """
    return _token_values(model, batch, params, ("logp64",) if float64 else ("logp",))[0]


def loss_and_measured_logp(model: nn.Module, batch: ProbeBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi_t as the loss computes it, log pi_t in float64 for measuring changes), from one forward without
    grad in eval mode: the same values as `completion_logp` without and with ``float64``."""
    with torch.no_grad(), eval_mode(model):
        return _token_values(model, batch, None, ("logp", "logp64"))


def completion_logp_entropy(
    model: nn.Module, batch: ProbeBatch, params: dict[str, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi_t(o_t), H_t) for every completion token, (B, C) each, differentiable: H_t = -sum_k pi_k log pi_k,
    the entropy of the temperature-scaled distribution at p(t) (what TRL's entropy bonus and entropy mask use)."""
    return _token_values(model, batch, params, ("logp", "entropy"))


def completion_proxy_logp(model: nn.Module, batch: ProbeBatch, kappa: float) -> torch.Tensor:
    """log pi_proxy(o_t) (B, C) of every completion token, Lp-Reg's min-p proxy (`minp_proxy_logp`) of the model's
    distribution at p(t), without grad in eval mode: called at the policy that sampled the batch (pi_old), once per
    rollout batch. Cost: one forward without grad, the LM head chunk by chunk as `completion_logp`."""
    with torch.no_grad(), eval_mode(model):
        return _token_values(model, batch, None, ("proxy",), kappa=float(kappa))[0]
