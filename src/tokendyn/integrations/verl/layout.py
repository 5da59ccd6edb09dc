"""Where verl puts each response token inside its actor engine, so that the probe reads the right position.

verl's FSDP engine rebuilds every micro-batch from the no-padding layout (`left_right_2_no_padding`: each sequence
is its real prompt followed by its real response, no padding). Sequence b has P_b prompt and R_b response tokens; its
response token t (0 <= t < R_b) is the sequence's token P_b + t, and the loss reads its log-probability at the
position before it (verl's `no_padding_2_padding` slices ``[offset_b + P_b - 1, offset_b + P_b + R_b - 1)``):

    remove-padding on  (one packed row):      row 0, position  o_t = offset_b + P_b + t,  offset_b = sum_{c<b} (P_c + R_c)
    remove-padding off (rows right-padded):   row b, position  o_t = P_b + t

(`tokendyn.probe` takes ``token_positions`` = o_t and ``token_rows`` = the row; p(t) = o_t - 1 is its own rule.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ResponseLayout:
    """The response tokens of one micro-batch, [B, W] like the loss's log_prob: sampled ids, positions o_t, rows
    of the engine's forward, and which columns are real tokens."""

    completion_ids: torch.Tensor  # [B, W] long (0 past R_b)
    positions: torch.Tensor  # [B, W] long: o_t (clamped into the row past R_b)
    rows: torch.Tensor  # [B, W] long
    valid: torch.Tensor  # [B, W] bool: t < R_b, the sequence's real response tokens


def prompt_response_lengths(data) -> tuple[torch.Tensor, torch.Tensor]:
    """(P [B], R [B]): the real prompt and response lengths of a verl micro-batch, read as verl's own
    `no_padding_2_padding` reads them (nested prompts / responses: their offsets; padded: the attention mask)."""
    prompts, responses = data["prompts"], data["responses"]
    if prompts.is_nested:
        return prompts.offsets().diff(), responses.offsets().diff()
    mask = data["attention_mask"]
    width = prompts.shape[1]
    return mask[:, :width].sum(1), mask[:, width:].sum(1)


def response_layout(input_ids: torch.Tensor, data, width: int, packed: bool) -> ResponseLayout:
    """The layout of the micro-batch ``data`` whose no-padding ``input_ids`` (nested [B, j]) the engine ran, for
    log-probs of ``width`` response columns; ``packed``: remove-padding (one row) or not (a row per sequence)."""
    p_len, r_len = prompt_response_lengths(data)
    device = input_ids.values().device
    p_len, r_len = p_len.to(device).long(), r_len.to(device).long()
    seq_len = input_ids.offsets().diff().to(device).long()
    if not bool(torch.equal(seq_len, p_len + r_len)):
        raise ValueError("verl micro-batch: input_ids lengths are not prompt + response lengths")
    if bool((p_len < 1).any()):
        raise ValueError(
            "verl micro-batch: a sequence without a prompt token (its first token has no predictor)"
        )
    t = torch.arange(width, device=device)[None]
    local = p_len[:, None] + torch.minimum(
        t, (r_len[:, None] - 1).clamp(min=0)
    )  # o_t, clamped into the sequence
    start = input_ids.offsets()[:-1].to(device).long()[:, None]
    flat = input_ids.values()
    ids = flat[start + local]
    valid = t < r_len[:, None]
    ids = torch.where(valid, ids, torch.zeros_like(ids))
    if packed:
        return ResponseLayout(ids, start + local, torch.zeros_like(local), valid)
    rows = torch.arange(local.shape[0], device=device)[:, None].expand_as(local)
    return ResponseLayout(ids, local, rows.contiguous(), valid)
