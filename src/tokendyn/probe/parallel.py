"""Data parallelism and sharded parameters, as the probe sees them.

Under DDP and FSDP2 every process runs the backward of its own loss L_r and the wrapper *averages* the parameter
gradients over the n processes, so the update is the gradient of L = (1/n) sum_r L_r. The probe's hooks see
dL_r/dh and dL_r/dlog pi on their process; the token's share of the update is 1/n of that. TRL builds L_r so that
L is the one-process loss of the whole batch (it multiplies each rank's loss by n, e.g. the DAPO normaliser
`num_items_in_batch / num_processes`), so the records, divided by n, equal a one-process run on the global batch.

FSDP2 (`torch.distributed.fsdp.fully_shard`) stores each parameter as a DTensor shard outside its module's forward
and backward. The LM head is never gathered whole for the probe: `head_shard` takes this rank's rows (dim-0 shards
on a 1-D mesh, FSDP2's layout), and the checks all-gather the small token sample [K, H] instead and merge each
rank's partial sums over its rows (`head_sample_quantities`). Only a head sharded some other way (2-D mesh, a
dim-1 placement) is gathered, in its own dtype, for the duration of the check: a transient V x H x itemsize bytes.
Every function here that takes a process group is a collective: every rank must call it in the same order.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from tokendyn.probe.head import (
    HeadPartial,
    HeadQuantities,
    HeadShard,
    head_partial,
    head_quantities,
    rescaled,
)


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _is_dtensor(t: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def is_fully_sharded(model: nn.Module) -> bool:
    """True when some module of the model was sharded with FSDP2 `fully_shard` (its parameters are DTensors)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def check_supported(model: nn.Module) -> None:
    """Refuse the wrappers whose gradients the probe cannot attribute: FSDP1 (flat parameters)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ValueError(
            "probe: FSDP1 (FullyShardedDataParallel, flat parameters) is not supported; shard with FSDP2 "
            "(torch.distributed.fsdp.fully_shard; accelerate: fsdp_version: 2) or use DDP"
        )


def data_parallel_size(model: nn.Module) -> int | None:
    """n, the number of processes that average this model's gradients: the DDP process group's size for a
    `DistributedDataParallel` wrapper, the world size for a model sharded with `fully_shard`; None otherwise."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return int(model.process_group.size())
    if is_fully_sharded(model):
        return _world_size()
    return None


def resolve_data_parallel_size(model: nn.Module, given: int | None) -> int:
    """`given` (validated), else `data_parallel_size(model)`, else 1 (with a warning when several processes run:
    records would then be each process's own gradient, which is right only if nothing averages them)."""
    if given is not None:
        if not isinstance(given, int) or isinstance(given, bool) or given < 1:
            raise ValueError(f"probe: data_parallel_size must be None or an integer >= 1, got {given!r}")
        return given
    n, world = data_parallel_size(model), _world_size()
    if n is None and world > 1:
        warnings.warn(
            f"probe: {world} processes, but the model is neither wrapped in DistributedDataParallel nor sharded "
            "with fully_shard: records are each process's own loss gradient; pass data_parallel_size=n if the "
            "gradients are averaged over n processes (1 to silence this)",
            stacklevel=4,
        )
    return n or 1


def full_weight(t: torch.Tensor | None) -> torch.Tensor | None:
    """The whole (unsharded, detached) tensor of an FSDP2 DTensor parameter; a plain tensor as it is."""
    if t is None:
        return None
    t = t.detach()
    return t.full_tensor() if _is_dtensor(t) else t


def head_shard(head: nn.Module) -> HeadShard:
    """This rank's rows of the LM head (`head.weight`, V x H, and `head.bias`), with their offset and the process
    group that holds the others: a DTensor sharded on dim 0 over a 1-D mesh (FSDP2) stays sharded (group = the
    mesh's group); another DTensor layout is gathered (transient, in the head's dtype: V x H x itemsize bytes);
    a plain tensor is the whole head (group None). No copy in either of the first and last cases."""
    weight = head.weight.detach()
    bias = getattr(head, "bias", None)
    bias = None if bias is None else bias.detach()
    vocab = int(weight.shape[0])
    if not _is_dtensor(weight):
        return HeadShard(weight, bias, 0, vocab)
    from torch.distributed.tensor import Shard

    mesh, placements = weight.device_mesh, weight.placements
    if (
        mesh.ndim == 1
        and len(placements) == 1
        and isinstance(placements[0], Shard)
        and placements[0].dim == 0
    ):
        group = mesh.get_group()
        local = weight.to_local()
        if (
            torch.distributed.get_world_size(group) == 1
        ):  # one rank holds every row: the whole head, no collectives
            return HeadShard(local, None if bias is None else full_weight(bias), 0, vocab)
        counts = gather_counts(int(local.shape[0]), group, local.device)
        offset = int(sum(counts[: torch.distributed.get_rank(group)]))
        if bias is not None:
            bias = bias.to_local() if _is_dtensor(bias) else bias[offset : offset + local.shape[0]]
        return HeadShard(local, bias, offset, vocab, group)
    return HeadShard(weight.full_tensor(), full_weight(bias), 0, vocab)


def gather_counts(n: int, group, device: torch.device) -> list[int]:
    """Every rank's n, in rank order of `group`."""
    dist = torch.distributed
    t = torch.tensor([n], dtype=torch.int64, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [int(x) for x in out]


def gather_rows(t: torch.Tensor, group) -> tuple[torch.Tensor, list[int]]:
    """Every rank's rows of t (first dims may differ) concatenated in rank order, and the row counts."""
    dist = torch.distributed
    counts = gather_counts(int(t.shape[0]), group, t.device)
    top = max(counts)
    padded = torch.zeros((top, *t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    out = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(out, padded.contiguous(), group=group)
    return torch.cat([o[:c] for o, c in zip(out, counts, strict=True)]), counts


def combine_head_partials(p: HeadPartial, group) -> HeadPartial:
    """Merge the ranks' partial sums over their rows of W: M = max_r m_r, each rank's sums rescaled to M
    (`head.rescaled`), then s1, s2, acc, z_o and W_o (the owner's, 0 elsewhere) summed over the ranks."""
    dist = torch.distributed
    big = p.m.clone()
    dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)
    r = rescaled(p, big)
    packed = torch.cat([torch.stack([r.s1, r.s2, r.z_o], dim=-1), r.acc, r.w_o], dim=-1)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    h = p.acc.shape[1]
    return HeadPartial(
        big, packed[:, 0], packed[:, 1], packed[:, 3 : 3 + h], packed[:, 2], packed[:, 3 + h :]
    )


def head_sample_quantities(
    h: torch.Tensor, shard: HeadShard, targets: torch.Tensor, temperature: float
) -> tuple[HeadQuantities, float]:
    """The exact-check quantities of this rank's K tokens (h [K, H], targets [K]) and the largest per-token lower
    bound of sigma_max(W) over the tokens seen (this rank's; under a sharded head every rank's, so the same on all).
    Sharded head: every rank's tokens are all-gathered (sum_r K_r x H, small), each rank sums over its own rows
    for all of them, and the partial sums are merged (`combine_head_partials`)."""
    if shard.group is None:
        q = head_quantities(head_partial(h, shard, targets, temperature), temperature)
        return q, _max_or_zero(q.sigma_lower)
    rank = torch.distributed.get_rank(shard.group)
    h_all, counts = gather_rows(h.detach().to(torch.float64), shard.group)
    t_all, _ = gather_rows(targets.to(h.device).long(), shard.group)
    part = combine_head_partials(head_partial(h_all, shard, t_all, temperature), shard.group)
    q_all = head_quantities(part, temperature)
    lo = sum(counts[:rank])
    mine = slice(lo, lo + counts[rank])
    q = HeadQuantities(*(getattr(q_all, f)[mine] for f in HeadQuantities.__dataclass_fields__))
    return q, _max_or_zero(q_all.sigma_lower)


def _max_or_zero(t: torch.Tensor) -> float:
    t = t[torch.isfinite(t)]
    return float(t.max()) if t.numel() else 0.0


def all_reduce_in(group):
    """A sum over `group` (None: the identity), for `head.sigma_max_power`."""
    if group is None:
        return lambda t: t

    def reduce(t: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=group)
        return t

    return reduce


def agree_max(n: int, model: nn.Module, device: torch.device) -> int:
    """max over the ranks of n when the model is sharded with FSDP2 (its layer replays are collectives whose count
    must agree), else n."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return n
    if not is_fully_sharded(model):
        return n
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


# --- the rebalancing analyses on FSDP2-sharded parameters ------------------------------------------------------
#
# Every rank runs the analyses on the same batch. A forward and a backward of the model go through FSDP2's hooks
# (all-gather before each module, reduce-scatter of the gradients after), so every rank must make them in the same
# order. `torch.autograd.grad` does not reach the sharded parameters (the graph holds the gathered copies), so a
# gradient is taken by a backward into ``.grad`` (each parameter's own ``.grad`` set aside and put back): FSDP2
# averages it over the ranks, and the ranks' losses are the same loss, so the average is that loss's gradient.
# Norms and inner products are summed over each rank's shard (float64) and then over the ranks (`sum_over_ranks`).


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of the model sharded with `fully_shard` (empty when none is)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def reshard(model: nn.Module) -> None:
    """Register every FSDP2 module's sharded parameters again (a no-op where they are). FSDP2 leaves the root's
    parameters gathered after a forward that no backward follows (eval, no grad), and a later forward reuses that
    copy: before the parameters are changed in place, or read as shards, they must be resharded."""
    for m in fsdp_modules(model):
        m.reshard()


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the same storage), a plain tensor as it is."""
    if _is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


def sum_over_ranks(t: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """t summed over the ranks (in place) when the model is FSDP2-sharded (t holds sums over this rank's
    shards), else t: a collective under FSDP2."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and fsdp_modules(model):
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def check_wholly_sharded(model: nn.Module) -> None:
    """Refuse an FSDP2 model some of whose trainable parameters FSDP2 does not shard (a root module left without
    `fully_shard`): the analyses sum norms and inner products over each rank's shards and then over the ranks, which
    would count such a parameter, held whole by every rank, once per rank."""
    if not fsdp_modules(model):
        return
    plain = [n for n, p in model.named_parameters() if p.requires_grad and not _is_dtensor(p)]
    if plain:
        raise ValueError(
            f"probe: the analyses need every trainable parameter of an FSDP2 model sharded; {plain[0]!r} (and "
            f"{len(plain) - 1} more) is not: apply fully_shard to the root module too"
        )


def all_agree(flag: bool, model: nn.Module) -> bool:
    """True when ``flag`` is true on every rank of an FSDP2-sharded model (a collective there), else ``flag``."""
    first = next(model.parameters(), None)
    device = local(first).device if first is not None else torch.device("cpu")
    votes = sum_over_ranks(torch.tensor([float(flag)], dtype=torch.float64, device=device), model)
    world = _world_size() if fsdp_modules(model) else 1
    return bool(float(votes) >= world)


def _param_groups(model: nn.Module) -> list:
    return [g for m in fsdp_modules(model) for g in m._get_fsdp_state()._fsdp_param_groups]


def gradients(
    model: nn.Module,
    outputs: torch.Tensor,
    params: list[torch.Tensor],
    grad_outputs: torch.Tensor | None = None,
    *,
    retain_graph: bool = False,
) -> list[torch.Tensor | None]:
    """d <outputs, grad_outputs> / d params (grad_outputs None: outputs is a scalar), None for a parameter the
    outputs do not reach. Plain parameters: ``torch.autograd.grad``. FSDP2: a backward into ``.grad`` (module
    comment above), and this rank's shard of each gradient is returned (``.grad`` put back as it was; the
    gradients are reduce-scattered even inside a no-sync accumulation window, whose flags are restored after).
    A collective under FSDP2."""
    if not fsdp_modules(model):
        return list(
            torch.autograd.grad(outputs, params, grad_outputs, retain_graph=retain_graph, allow_unused=True)
        )
    groups = _param_groups(model)
    if any(getattr(p, "unsharded_accumulated_grad", None) is not None for g in groups for p in g.fsdp_params):
        raise RuntimeError(
            "probe: FSDP2 holds gradients accumulated without synchronisation; the analyses must run before a "
            "micro-step's backward, outside a no-sync accumulation window's middle"
        )
    flags = [(g.reduce_grads, g.all_reduce_grads) for g in groups]
    roots = [m._get_fsdp_state()._state_ctx for m in fsdp_modules(model)]
    last = [ctx.is_last_backward for ctx in roots]
    kept = [p.grad for p in params]
    try:
        for g in groups:
            g.reduce_grads, g.all_reduce_grads = True, True
        for ctx in roots:
            ctx.is_last_backward = True
        for p in params:
            p.grad = None
        torch.autograd.backward(outputs, grad_outputs, retain_graph=retain_graph, inputs=None)
        return [None if p.grad is None else local(p.grad) for p in params]
    finally:
        for p, g in zip(params, kept, strict=True):
            p.grad = g
        for g, (a, b) in zip(groups, flags, strict=True):
            g.reduce_grads, g.all_reduce_grads = a, b
        for ctx, flag in zip(roots, last, strict=True):
            ctx.is_last_backward = flag
