"""Per-token records of the analysis sample: who drives the update, token by token (`token_view`, `token_view_rules`).

For the first ``view_sequences`` sequences of a probed step's analysis sample, one row per completion token (padding
left out) with every number the analyses already have for it:

    text          the token decoded on its own, in context (`token_texts`), special tokens marked
    pi_old, A     its probability under the sampling policy and its advantage; bin of pi_old
    group         Lopti's stage of the token (low / high; null for a one-stage run)
    share         s_t = <grad l_t, g> / ||g||^2, its share of the update (one JVP; null without token_shares, and
                  where the sample's shares do not add up to 1: g at its rounding level, `shares_add_up`)
    dpi_cf        pi(theta + dtheta) - pi(theta) after the counterfactual SGD update of every token (Lopti: both stages)
    dpi_real      the same after the run's real update (filled in after the optimizer step; null offline)
    head_ratio    ||d log pi_t / d h_t|| / (1 - pi_t) at the LM-head input: its own gradient over |w| (1 - pi), which
                  the bound keeps <= sqrt(2) sigma_max(W) / T (`tokendyn.probe.head`)
    log_rho       log pi_old - log mu, the sampler's mismatch at the token (vLLM-sampled rollouts; null otherwise)
    is_weight     the importance weight the loss applied to it (TRL's correction; null without one)

and, with the paired comparison on, `token_view_rules`: one row per (token, rule, mode) with the rule's Δπ and update
share (`tokendyn.effects.compare`). Both are bounded by ``view_sequences`` (at most that many sequences of at most the
completion length per probed step).
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl
import torch
from torch import nn

from tokendyn.probe.head import HeadShard, head_partial, head_quantities
from tokendyn.probe.tokenloss import ProbeBatch, eval_mode, head_inputs
from tokendyn.records import SCHEMAS, to_frame
from tokendyn.vocab import TRAIN

# tokens decoded before each one, so that a decoder's rules at the text's start do not apply
CONTEXT_TOKENS = 8
# the view's shares are kept where the sample's add up to 1 within this (`shares_add_up`)
SHARE_SUM_TOL = 1e-3


def token_texts(tokenizer, ids: Sequence[int]) -> tuple[list[str], list[bool]]:
    """Each token's text as it appears in the decoded sequence, and whether it is a special token: piece_t =
    decode(ids[s:t+1]) minus its prefix decode(ids[s:t]), s = t - CONTEXT_TOKENS (so a leading space a decoder
    strips at the start of a text is kept, and whitespace is the tokenizer's own). A token that ends inside a
    multi-byte character gets "" and the character goes to the token that completes it; a decoder that rewrites its
    prefix leaves at most CONTEXT_TOKENS tokens empty before a fresh window starts. No tokenizer: "" each."""
    ids = [int(i) for i in ids]
    if tokenizer is None:
        return [""] * len(ids), [False] * len(ids)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())

    def decode(part: list[int]) -> str:
        return tokenizer.decode(part, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    texts, start, prefix, pending = [], 0, "", 0
    for t in range(len(ids)):
        if pending > CONTEXT_TOKENS:  # a decoder that keeps rewriting its prefix: start a fresh window here
            start, prefix, pending = t, "", 0
        elif not pending and t - start > CONTEXT_TOKENS:
            start = t - CONTEXT_TOKENS
            prefix = decode(ids[start:t])
        full = decode(ids[start : t + 1])
        if full.endswith("\ufffd") or not full.startswith(prefix):
            texts.append("")  # an incomplete character (or a decoder that rewrites its prefix): nothing yet
            pending += 1
            continue
        texts.append(full[len(prefix) :])
        prefix, pending = full, 0
    return texts, [i in special for i in ids]


@torch.no_grad()
def head_ratios(model: nn.Module, batch: ProbeBatch) -> torch.Tensor | None:
    """||d log pi_t / d h_t|| / (1 - pi_t) for every completion token, (B, C) float64 (0 on padding), from the
    LM-head input h_t and the head's rows streamed in float64 (`tokendyn.probe.head`: the ratio is ||W_o - E_r[W]||/T
    with r_k = pi_k / (1 - pi_o), exact as pi_o -> 1; a soft cap is modelled). None where the model's head is not a
    plain affine map of a backbone (`tokenloss.head_inputs`)."""
    from tokendyn.probe.points import logit_softcap

    with eval_mode(model):
        parts = head_inputs(model, batch)
    if parts is None:
        return None
    h, weight, bias = parts
    shard = HeadShard(weight.detach(), None if bias is None else bias.detach(), 0, int(weight.shape[0]))
    shard.softcap = logit_softcap(model)
    mask = batch.completion_mask.bool().flatten().to(h.device)
    targets = batch.completion_ids.flatten().to(h.device)
    out = torch.zeros(mask.numel(), dtype=torch.float64, device=h.device)
    if mask.any():
        q = head_quantities(head_partial(h[mask], shard, targets[mask], batch.temperature), batch.temperature)
        out[mask] = torch.linalg.vector_norm(q.direction, dim=-1) / q.one_minus_pi
    return out.view_as(batch.completion_mask).cpu()


def shares_add_up(shares: torch.Tensor, mask: torch.Tensor, tol: float = SHARE_SUM_TOL) -> bool:
    """Whether the per-token shares of the whole sample add up to 1 within ``tol``, as they do exactly in exact
    arithmetic (sum_t <grad l_t, g> = ||g||^2). They do not where g is at its rounding level, e.g. every advantage
    of the sample 0 and only a KL term at the reference policy left (measured: ||g|| = 5e-10, sum 0.83)."""
    total = float(shares.detach().to(torch.float64)[mask.bool().to(shares.device)].sum())
    return abs(total - 1.0) <= tol


def view_rows(batch: ProbeBatch, n: int) -> int:
    """How many sequences the view keeps: the first min(n, B)."""
    return min(int(n), int(batch.completion_mask.size(0)))


def token_view_frame(
    batch: ProbeBatch,
    n: int,
    *,
    step: int,
    stage: str = TRAIN,
    pi_old: torch.Tensor,
    bins: torch.Tensor,
    tokenizer=None,
    shares: torch.Tensor | None = None,
    dpi_cf: torch.Tensor | None = None,
    groups: Sequence[tuple[str, torch.Tensor]] = (),
    head_ratio: torch.Tensor | None = None,
) -> pl.DataFrame:
    """The `token_view` record of the first ``n`` sequences (module docstring): one row per scored token.
    ``groups``: (name, (B, C) mask) of Lopti's stages; the others are (B, C) tensors or None (column of nulls)."""
    rows = view_rows(batch, n)
    if shares is not None and not shares_add_up(shares, batch.completion_mask):
        shares = None  # g is at its rounding level: its shares are noise, not a decomposition
    mask = batch.completion_mask[:rows].bool().cpu()
    ids = batch.completion_ids[:rows].cpu()
    # the completion's real tokens (scored or not: a tool's output inside it is text too), decoded in order
    real = batch.attention_mask[:rows, -batch.n_completion :].bool().cpu() | mask
    cols: dict[str, list] = {c: [] for c in ("seq", "pos", "token_id", "text", "special")}
    for i in range(rows):
        pos = torch.nonzero(mask[i]).flatten()
        shown = torch.nonzero(real[i]).flatten()
        texts, special = token_texts(tokenizer, ids[i][shown].tolist())
        scored = mask[i][shown].tolist()
        cols["seq"] += [i] * len(pos)
        cols["pos"] += pos.tolist()
        cols["token_id"] += ids[i][pos].tolist()
        cols["text"] += [x for x, on in zip(texts, scored, strict=True) if on]
        cols["special"] += [x for x, on in zip(special, scored, strict=True) if on]

    def take(x: torch.Tensor | None) -> list:
        if x is None:
            return [None] * len(cols["seq"])
        return x[:rows].detach().to("cpu", torch.float64)[mask].tolist()

    group = [None] * len(cols["seq"])
    for name, m in groups:
        for k, on in enumerate(m[:rows].detach().cpu().bool()[mask].tolist()):
            if on:
                group[k] = name
    n_rows = len(cols["seq"])
    cols.update(
        step=[step] * n_rows,
        stage=[stage] * n_rows,
        bin=bins[:rows].cpu()[mask].tolist(),
        pi_old=take(pi_old),
        advantage=take(batch.advantages),
        group=group,
        share=take(shares),
        dpi_cf=take(dpi_cf),
        dpi_real=[None] * n_rows,
        head_ratio=take(head_ratio),
        log_rho=take(None if batch.sampling_logp is None else torch.log(pi_old) - batch.sampling_logp),
        is_weight=take(None if batch.is_ratio is None else batch.is_ratio.expand_as(batch.completion_mask)),
    )
    return to_frame("token_view", cols)


def with_real_change(frame: pl.DataFrame, delta: torch.Tensor) -> pl.DataFrame:
    """``frame`` (a `token_view` record) with dpi_real read off the real update's Δπ (B, C) at (seq, pos)."""
    d = delta.detach().to("cpu", torch.float64)
    seq = torch.tensor(frame["seq"].to_list(), dtype=torch.long)
    pos = torch.tensor(frame["pos"].to_list(), dtype=torch.long)
    return frame.with_columns(pl.Series("dpi_real", d[seq, pos].tolist(), dtype=pl.Float64))


def token_rules_frame(results: dict, frame: pl.DataFrame) -> pl.DataFrame:
    """The `token_view_rules` record: each (rule, mode) of `compare_rules`' results at the tokens of ``frame``."""
    seq = torch.tensor(frame["seq"].to_list(), dtype=torch.long)
    pos = torch.tensor(frame["pos"].to_list(), dtype=torch.long)
    n = len(seq)
    cols: dict[str, list] = {c: [] for c in SCHEMAS["token_view_rules"]}
    step, stage = frame["step"].to_list(), frame["stage"].to_list()
    for (rule, mode), res in results.items():
        cols["step"] += step
        cols["stage"] += stage
        cols["seq"] += seq.tolist()
        cols["pos"] += pos.tolist()
        cols["rule"] += [rule] * n
        cols["mode"] += [mode] * n
        diverged = getattr(res, "diverged", False)  # (its delta is not a measurement: null)
        cols["delta_pi"] += (
            [None] * n if diverged else res.delta.detach().to("cpu", torch.float64)[seq, pos].tolist()
        )
        s = res.shares
        cols["share"] += (
            s.detach().to("cpu", torch.float64)[seq, pos].tolist() if s is not None else [None] * n
        )
    return to_frame("token_view_rules", cols)
