"""The "direct" per-token gradient by replaying the layers from their recorded inputs, one layer at a time.

direct_l(t) = ||d log pi_t / d h_l[p(t)]|| (see `direct.py`). The chain rule is run by hand, from the top:

    c_N = d log pi / d h_N             (final norm recomputed from its recorded input)
    c_{j-1} = c_j . d layer_j / d h_{j-1}   (layer j recomputed from its recorded input h_{j-1}),

c_N starting from u = d log pi / dh at the LM-head input (`direct.head_seed`), so the LM head is not needed here;
K tokens' seeds are batched (`direct.batched_grads`; tokens in distinct rows share a seed slot).

Why a replay and not a second backward through the training graph: (1) memory: rows of a causal LM never interact,
so only the rows holding sampled tokens are replayed, in groups under the `direct_memory_mb` cap (`plan_rows`:
r rows x c slots hold about r x (S (8H + 5W) + c S (2H + W)) x itemsize bytes, `replay_bytes`), where a second
backward would run every row of the micro-batch through every layer for every slot; (2) it works where a second
backward cannot: FSDP2 (`fully_shard` frees the graph's weights after the forward and re-gathers them only in
its own backward hooks) and reentrant activation checkpointing (`torch.utils.checkpoint` refuses `autograd.grad`).
Each module is recomputed with its plain `forward` (no FSDP or checkpoint hooks; HF gradient checkpointing off; a
KV cache filled by the forward left out), its FSDP2 shards all-gathered for that module only (memory: one layer's
full weights at a time; with an FSDP2 mixed-precision policy, cast to the dtype FSDP gave the module's inputs), and
the random state and autocast state it had in the forward (dropout masks repeat: with dropout active every row is
replayed at once, as the forward drew them). The weights are those of the
forward (the replay runs before the training backward and the optimizer step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from tokendyn.probe.direct import DirectMemoryError, batched_grads, head_seed, row_slots
from tokendyn.probe.parallel import _is_dtensor


@dataclass
class LayerCall:
    """One module call of the forward: the point name of its output, the module, its inputs, and the RNG and
    autocast states it ran under (`LayerCall.record`)."""

    name: str
    module: nn.Module
    args: tuple
    kwargs: dict
    rng: tuple[torch.Tensor, torch.Tensor | None]
    autocast: tuple[bool, torch.dtype]

    @classmethod
    def record(cls, name: str, module: nn.Module, args: tuple, kwargs: dict) -> LayerCall:
        """The call as it starts: (CPU RNG state, CUDA RNG state or None), as torch.utils.checkpoint keeps them,
        and (autocast enabled, its dtype) on the input's device."""
        device = args[0].device
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
        return cls(name, module, tuple(args), dict(kwargs), (torch.get_rng_state(), cuda), autocast)


def _inner(module: nn.Module) -> nn.Module:
    """The module under torch's checkpoint_wrapper (`_checkpoint_wrapped_module`), if any."""
    while isinstance(getattr(module, "_checkpoint_wrapped_module", None), nn.Module):
        module = module._checkpoint_wrapped_module
    return module


@contextmanager
def _plain(module: nn.Module, dtype: torch.dtype | None) -> Iterator[nn.Module]:
    """The module with full (all-gathered, detached; cast to `dtype` if given) weights in place of its FSDP2
    shards and HF gradient checkpointing off, restored on exit."""
    swapped = []
    flags = [(m, m.gradient_checkpointing) for m in module.modules() if hasattr(m, "gradient_checkpointing")]
    try:
        for m, _ in flags:
            m.gradient_checkpointing = False
        for sub in module.modules():
            for name, param in list(sub._parameters.items()):
                if param is not None and _is_dtensor(param):
                    full = param.detach().full_tensor()
                    if dtype is not None and full.is_floating_point():
                        full = full.to(dtype)
                    sub._parameters[name] = full
                    swapped.append((sub, name, param))
        yield module
    finally:
        for m, flag in flags:
            m.gradient_checkpointing = flag
        for sub, name, param in swapped:
            sub._parameters[name] = param


def _run(call: LayerCall, x: torch.Tensor) -> torch.Tensor:
    """The module's plain forward on x (its recorded first argument replaced), as it ran in the forward."""
    module = _inner(call.module)
    # a KV cache (`past_key_values`, `cache`; GPT-2 passes it positionally) was filled by this very forward: a
    # replay that appended to it again would attend to the forward's keys beside its own (the same output, since
    # the keys repeat, but half the gradient lost into the forward's detached copy)
    args = tuple(None if hasattr(a, "get_seq_length") else a for a in call.args[1:])
    kwargs = {k: None if hasattr(v, "get_seq_length") else v for k, v in call.kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    cpu, cuda = call.rng
    devices = [x.device] if cuda is not None else []
    autocast, dtype = call.autocast
    # FSDP2 mixed precision (no autocast): FSDP computed in the dtype it cast the inputs to
    cast = x.dtype if not autocast and x.is_floating_point() else None
    with (
        torch.random.fork_rng(devices=devices),
        _plain(module, cast),
        torch.enable_grad(),
        torch.autocast(x.device.type, dtype=dtype, enabled=autocast),
    ):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, x.device)
        out = module.forward(x, *args, **kwargs)
    return out if torch.is_tensor(out) else out[0]


def layer_width(module: nn.Module, hidden: int) -> int:
    """W: the widest per-position activation inside a layer, the largest output width of its linear maps
    (`nn.Linear.out_features`, GPT-2's `Conv1D.nf`; the MLP's intermediate size in a Llama-style block), at least
    `hidden` (4 x hidden when the layer has no linear map that says)."""
    widths = [
        int(getattr(m, "out_features", 0) or getattr(m, "nf", 0) or 0) for m in _inner(module).modules()
    ]
    return max([hidden, *widths]) if any(widths) else 4 * hidden


def replay_bytes(seq: int, hidden: int, width: int, itemsize: int) -> tuple[int, int]:
    """(row_bytes, slot_bytes): what replaying one layer costs per row of the micro-batch.

    row_bytes = S x (8H + 5W) x itemsize: what a Llama-style layer recomputed with gradients saves for its
    backward, per position: its input, both norms' inputs and outputs, q / k / v and the rotated q / k, the
    attention output (8 hidden-sized; fewer with grouped k / v heads), the MLP's gate, up, activation, product and
    the down projection's input (5 of width W); slot_bytes = S x (2H + W) x itemsize: for each seed slot, the
    cotangents into and out of the layer and the widest temporary of its batched backward. An estimate, for the
    plan; bench/probe_memory.py measures what the replay really holds."""
    return seq * (8 * hidden + 5 * width) * itemsize, seq * (2 * hidden + width) * itemsize


def plan_rows(
    tokens_per_row: list[int],
    row_bytes: float,
    slot_bytes: float,
    chunk: int,
    cap: float | None,
    whole: bool = False,
) -> list[tuple[list[int], int]]:
    """How to replay under a memory cap: [(rows of the group, seed slots per replay)], over the rows with tokens.

    A group of r rows replayed with c slots holds about r x (row_bytes + c x slot_bytes) bytes (`replay_bytes`).
    Rows with tokens (tokens_per_row[i] > 0) are packed in order while r x (row_bytes + min(chunk, m) x slot_bytes)
    <= cap, m = the most tokens of one row in the group; a group gets c = min(chunk, m) slots, or, alone over that,
    c = floor((cap / r - row_bytes) / slot_bytes). ``whole``: one group of every row (with tokens or not: dropout
    masks repeat only on the whole batch). With no cap: one group, c = min(chunk, m). Raises DirectMemoryError when
    a group's one slot (one row, or every row when ``whole``) is over the cap."""
    rows = [i for i, n in enumerate(tokens_per_row) if n > 0]
    if not rows:
        return []
    m_all = min(chunk, max(tokens_per_row))
    if whole:
        rows = list(range(len(tokens_per_row)))
    if cap is None:
        return [(rows, m_all)]
    r_min = len(rows) if whole else 1
    need = r_min * (row_bytes + slot_bytes)
    if need > cap:
        raise DirectMemoryError(
            f"replaying {r_min} row(s) of one layer for one token needs {need / 2**20:.1f} MiB, above the cap of "
            f"{cap / 2**20:.1f} MiB"
        )

    def cost(group: list[int]) -> float:
        return len(group) * (row_bytes + min(chunk, max(tokens_per_row[i] for i in group)) * slot_bytes)

    groups: list[list[int]] = [rows] if whole else []
    for i in [] if whole else rows:
        if groups and cost(groups[-1] + [i]) <= cap:
            groups[-1].append(i)
        else:
            groups.append([i])
    plan = []
    for g in groups:
        c = min(chunk, max(tokens_per_row[i] for i in g))
        if cost(g) > cap:  # fewer slots per replay
            c = max(1, int((cap / len(g) - row_bytes) // slot_bytes))
        plan.append((g, c))
    return plan


def active_dropout(calls: list[LayerCall]) -> bool:
    """Does any replayed module drop out at random (an `nn.Dropout` with p > 0, or an attention's own
    `attention_dropout` / `attn_pdrop` > 0, in training mode)?"""
    for call in calls:
        for m in call.module.modules():
            if not m.training:
                continue
            if isinstance(m, nn.Dropout) and m.p > 0:
                return True
            if any(float(getattr(m, a, 0.0) or 0.0) > 0 for a in ("attention_dropout", "attn_pdrop")):
                return True
    return False


def _select_rows(obj, batch: int, index: torch.Tensor | None):
    """obj with every tensor of >= 2 dims whose first dim is the batch (`batch` rows) cut to rows `index`
    (tuples, lists and dicts walked; None: obj itself). Masks [b, 1, S, S], position ids [b, S] and rotary tables
    [b, S, d] follow the rows; tensors broadcast over the batch (first dim 1) and 1-D ones (cache positions) stay."""
    if index is None:
        return obj
    if torch.is_tensor(obj):
        return obj.index_select(0, index) if obj.dim() >= 2 and obj.shape[0] == batch else obj
    if isinstance(obj, tuple | list):
        return type(obj)(_select_rows(o, batch, index) for o in obj)
    if isinstance(obj, dict):
        return {k: _select_rows(v, batch, index) for k, v in obj.items()}
    return obj


def _rows_of(call: LayerCall, index: torch.Tensor | None) -> LayerCall:
    """The call restricted to rows `index` of its batch (all rows: None)."""
    if index is None:
        return call
    b = call.args[0].shape[0]
    return LayerCall(
        call.name, call.module, _select_rows(call.args, b, index), _select_rows(call.kwargs, b, index),
        call.rng, call.autocast,
    )  # fmt: skip


def replay_direct_norms(
    calls: list[LayerCall],
    probed: list[str],
    rows: torch.Tensor,
    positions: torch.Tensor,
    direction: torch.Tensor,
    chunk: int = 8,
    memory_bytes: float | None = None,
    agree: Callable[[int], int] = lambda n: n,
) -> dict[str, torch.Tensor]:
    """{point: [K] float32 ||d log pi_k / d h_point[rows_k, positions_k]||} for the probed points.

    `calls`: every module call from the first decoder layer to the LM head's input, in forward order (the input of
    calls[i] is the output of calls[i-1]; `points.replay_chain`); a probed `final_norm.out` that is not among them is
    the last call's output (a post-LN head input). `direction` [K, H] = d log pi_k / dh at the LM-head input. Only
    rows that hold tokens are replayed (rows of a causal LM never interact), in groups under the memory cap (`plan_rows`: r rows x c slots at a
    time; every row at once where a module drops out at random, so that the replay draws the forward's masks),
    each group from the final norm down to the layer after the lowest probed one. Under FSDP2 every rank must gather
    the same weights as often, so `agree` (a max over the ranks there) makes the number of replays the same on every
    rank (a rank with fewer replays a one-row group without seeds). Raises DirectMemoryError, on every rank, when one
    group's one slot is over the cap."""
    device = positions.device
    k_total = rows.shape[0]
    out = {n: torch.full((k_total,), float("nan"), dtype=torch.float32, device=device) for n in probed}
    names = [c.name for c in calls]
    alias = {n: names[-1] for n in probed if n not in names}  # a post-LN head input: the last layer's output
    lowest = min(names.index(alias.get(n, n)) for n in probed)
    top = calls[-1]
    x_top = top.args[0]
    b, seq, hidden = x_top.shape[0], x_top.shape[1], x_top.shape[-1]
    # every rank plans from the longest rank's rows, and a plan over the cap raises on every rank (FSDP2: a rank
    # leaving the replays alone would leave the others waiting in their all-gathers)
    width = layer_width(calls[0].module, hidden)
    row_b, slot_b = replay_bytes(agree(seq), hidden, width, x_top.element_size())
    slots = row_slots(rows) if k_total else rows
    per_row = torch.bincount(rows, minlength=b).tolist() if k_total else [0] * b
    try:  # dropout masks repeat only when the replay has the forward's shape: then every row at once
        plan, error = plan_rows(per_row, row_b, slot_b, chunk, memory_bytes, active_dropout(calls)), None
    except DirectMemoryError as exc:
        plan, error = [], exc
    if agree(int(error is not None)):
        raise error or DirectMemoryError("another rank's direct gradients are over the memory cap")
    work = []  # (rows of the group or None for all, first slot, last slot + 1)
    for group, c in plan:
        m = max(per_row[i] for i in group)
        index = None if group == list(range(b)) else torch.tensor(group, device=device)
        work += [(index, start, min(start + c, m)) for start in range(0, m, c)]
    n_work = agree(len(work))
    work += [(torch.zeros(1, dtype=torch.long, device=device), 0, 0)] * (n_work - len(work))

    def record(name: str, grads: torch.Tensor, sel: torch.Tensor, local: torch.Tensor, start: int) -> None:
        for target in [name] + [a for a, n in alias.items() if n == name]:
            if target in out:
                out[target][sel] = torch.linalg.vector_norm(
                    grads[slots[sel] - start, local, positions[sel]], dim=-1, dtype=torch.float32
                )

    for index, start, stop in work:
        in_group = torch.ones_like(rows, dtype=torch.bool) if index is None else torch.isin(rows, index)
        sel = torch.nonzero(in_group & (slots >= start) & (slots < stop)).squeeze(1)
        local = rows[sel] if index is None else torch.searchsorted(index, rows[sel])
        seeds = (slots[sel].unsqueeze(0) == torch.arange(start, stop, device=device).unsqueeze(1)).float()
        call = _rows_of(top, index)
        x = call.args[0].detach().requires_grad_()
        y = _run(call, x)
        with torch.enable_grad():
            lp = head_seed(y[local, positions[sel]], direction[sel])
        cot = None
        if stop > start:
            gy, cot = batched_grads(lp, [y, x], seeds)
            record(top.name, gy, sel, local, start)
            record(names[-2], cot, sel, local, start)
            del gy
        del y, lp
        for i in range(len(calls) - 2, lowest, -1):  # calls[i] maps h_{i-1} (the output of calls[i-1]) to h_i
            call = _rows_of(calls[i], index)
            x = call.args[0].detach().requires_grad_()
            y = _run(call, x)
            if cot is not None:
                (cot,) = batched_grads(y, [x], cot)
                record(names[i - 1], cot, sel, local, start)
            del y
    return out
