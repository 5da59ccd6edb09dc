"""State of one probed forward/backward, position alignment, and the all-reduce of the statistics (the process rank
is `tokendyn.records.process_rank`)."""

from __future__ import annotations

import torch

from tokendyn.probe.inputs import StepInputs
from tokendyn.probe.reduce import HeadCheckData


def in_backward() -> bool:
    """True while the autograd engine runs (e.g. a checkpointed layer recomputed in backward)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the process group (a copy), or t itself in a single process."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def completion_positions(
    batch: int,
    seq: int,
    mask: torch.Tensor,
    token_positions: torch.Tensor | None,
    token_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """p(t) [B, C]: the sequence position whose output predicts o_t, one before o_t.

    Default layout (prompt + completion, as TRL builds it): o_{t_j} sits at S - C + j, so p = S - C - 1 + j.
    Otherwise p = token_positions - 1, in row b of the forward, or in row token_rows[b, j] (a packed layout: several
    sequences in one row of the forward, as verl's remove-padding builds it)."""
    n_rows, c_len = mask.shape
    if token_rows is not None:
        if bool((token_rows[mask] >= batch).any()):
            raise ValueError(f"probe: token_rows must be < {batch} (the forward's batch size)")
    elif n_rows != batch:
        raise ValueError(f"probe: completion_mask has {n_rows} rows but the forward had batch size {batch}")
    if token_positions is None:
        if c_len > seq - 1:
            raise ValueError(
                f"probe: completion length {c_len} needs at least {c_len + 1} sequence positions, the forward had "
                f"{seq}; pass token_positions= if completions are not at the end of each row"
            )
        return torch.arange(seq - c_len - 1, seq - 1, device=mask.device).expand(batch, c_len)
    pos = token_positions - 1
    if bool((pos[mask] > seq - 2).any()):
        raise ValueError(f"probe: token_positions must be <= {seq - 1} (the sequence length is {seq})")
    return pos.clamp(0, seq - 2)


def at_tokens(t: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """t[row(b, j), pos[b, j]] [B, C] of a per-position tensor t [b, S'] (rows None: row b; positions past S' - 1
    are clamped, they are masked tokens)."""
    pos = pos.clamp(max=t.shape[1] - 1)
    return torch.gather(t, 1, pos) if rows is None else t[rows, pos]


class Pass:
    """One forward with gradients and its backward: live tensors until prepared, then what the hooks read."""

    def __init__(self) -> None:
        self.inputs: StepInputs | None = None
        self.hidden: dict[str, torch.Tensor] = {}  # live graph tensors, released once prepared
        self.calls: dict = {}  # point -> replay.LayerCall (its module's inputs), released once prepared
        self.unhooked: set[str] = (
            set()
        )  # points whose forward output carried no gradient (reentrant checkpoint)
        self.norms: dict[str, torch.Tensor] = {}  # point -> [b, S] float32 ||dL/dh|| per position
        self.handles: list = []
        self.shape: tuple[int, int] | None = None
        self.logp_seq: torch.Tensor | None = (
            None  # fused head output log_probs [b, S-1] (position p predicts p+1)
        )
        self.logits: torch.Tensor | None = None  # plain head output logits [b, S', V]
        self.forward_done = self.prepared = self.backward_seen = False
        self.w_kind: str | None = None  # "seq" (fused log_probs) or "completion" (the caller's logps [B, C])
        self.w_grad: torch.Tensor | None = None
        self.entropy_seq: torch.Tensor | None = (
            None  # fused head output entropy [b, S-1], aligned as logp_seq
        )
        self.e_kind: str | None = (
            None  # an entropy bonus: "seq" (fused entropy) or "completion" (the caller's)
        )
        self.e_grad: torch.Tensor | None = None  # e = dL/dH
        self.logp_value: torch.Tensor | None = None  # [B, C] log pi_t at the forward
        self.positions: torch.Tensor | None = None  # [B, C] p(t)
        self.rows: torch.Tensor | None = None  # [B, C] the forward's row of each token (None: row b)
        self.sample: tuple[torch.Tensor, torch.Tensor] | None = None
        self.check_at: tuple[torch.Tensor, torch.Tensor] | None = None
        self.check: HeadCheckData | None = None
        self.delta_check: torch.Tensor | None = None
        self.logits_grad_check: torch.Tensor | None = None
        self.grad_dtype: torch.dtype = torch.float32
        self.head_dtype: torch.dtype = (
            torch.float32
        )  # the dtype the LM head's product ran in (autocast included)
        self.autocast: tuple[bool, torch.dtype] = (False, torch.float32)  # at the LM-head input's forward
        self.rounded: tuple | None = None  # a 16-bit head: (h, targets, shard, T) of the check tokens
        self.direct: torch.Tensor | None = None

    def release(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.hidden, self.logp_seq, self.logits, self.calls, self.rounded = {}, None, None, {}, None
        self.entropy_seq = None


def gather_completion(p: Pass, point_names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(norms [P, B, C] at p(t), NaN for points the backward did not reach; w [B, C] = dL/dlog pi_t)."""
    pos = p.positions
    b, c_len = pos.shape
    norms = torch.full((len(point_names), b, c_len), float("nan"), dtype=torch.float32, device=pos.device)
    for i, n in enumerate(point_names):
        if n in p.norms:
            norms[i] = at_tokens(p.norms[n], pos, p.rows)
    if p.w_kind == "completion":
        return norms, p.w_grad
    return norms, at_tokens(p.w_grad, pos, p.rows)
