"""The batch the verl probe reads: a micro-batch's per-response-token fields as [B, W] (`_response_tensor`), its one
temperature (`_temperature`), and the rebalancing analyses' sample (`probe_batch`, the TRL layout's `ProbeBatch`; a
``notes`` record when no sequence carries a signal). Used by `tokendyn.integrations.verl.probe`, which re-exports
`probe_batch`."""

from __future__ import annotations

import torch

from tokendyn.integrations.verl.layout import prompt_response_lengths
from tokendyn.integrations.verl.loss import VerlConfigError


def _response_tensor(data, key: str) -> torch.Tensor:
    """A per-response-token field of a micro-batch as [B, W] (nested fields padded as verl's ppo_loss pads them)."""
    t = data[key]
    return t.to_padded_tensor(0.0) if t.is_nested else t


def _temperature(data) -> float:
    t = data["temperature"]
    if torch.is_tensor(t):
        t = t.flatten()
        if bool((t != t[0]).any()):
            raise VerlConfigError(
                "temperature: the tokendyn probe needs one temperature per micro-batch, got several"
            )
        t = t[0].item()
    return float(t)


def probe_batch(data, rows: int, temperature: float):
    """The first ``rows`` sequences of a verl batch (NO_PADDING layout) that carry a signal (some response token with
    a non-zero advantage, `tokendyn.probe.batch.signal_rows`: the rule of the TRL trainer's probe), fewer when it has
    fewer, as a `ProbeBatch`; None when no sequence has one. Prompts left-padded and responses right-padded to the
    sample's longest, the completion in the last columns (TRL's layout, which the analyses take); completion mask,
    advantages, pi_old (and pi_ref when the batch has ``ref_log_prob``, verl's rollout-correction weights when it has
    ``rollout_is_weights``) per response token."""
    from tokendyn.probe.batch import signal_rows
    from tokendyn.probe.tokenloss import ProbeBatch

    if int(rows) < 1:
        raise VerlConfigError(f"probe analyses: sample_sequences must be >= 1, got {rows!r}")
    p_len, r_len = prompt_response_lengths(data)
    adv, mask = _response_tensor(data, "advantages"), _response_tensor(data, "response_mask")
    chosen = signal_rows(adv.cpu(), mask.cpu().bool()).nonzero().squeeze(1)[: int(rows)]
    k = int(chosen.numel())
    if k == 0:
        return None
    seqs = data["input_ids"].unbind()
    width_p, width_r = int(p_len[chosen].max()), int(r_len[chosen].max())
    ids = torch.zeros(k, width_p + width_r, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, i in enumerate(chosen.tolist()):
        p, r, seq = int(p_len[i]), int(r_len[i]), seqs[i]
        ids[b, width_p - p : width_p] = seq[:p].cpu()
        ids[b, width_p : width_p + r] = seq[p : p + r].cpu()
        attn[b, width_p - p : width_p + r] = 1

    def per_token(key):
        return _response_tensor(data, key).cpu()[chosen, :width_r]

    has_ref = "ref_log_prob" in data.keys()
    has_is = "rollout_is_weights" in data.keys()  # verl's rollout correction: the loss multiplies them in
    return ProbeBatch(
        input_ids=ids,
        attention_mask=attn,
        completion_mask=per_token("response_mask").bool(),
        advantages=per_token("advantages").double(),
        old_logp=per_token("old_log_probs").double(),
        ref_logp=per_token("ref_log_prob").double() if has_ref else None,
        is_ratio=per_token("rollout_is_weights").double() if has_is else None,
        temperature=temperature,
    )


def _no_signal_note(step: int, rank: int):
    from tokendyn.records import to_frame

    message = f"step {step}: no sequence of the sample has a non-zero advantage; analyses skipped"
    return to_frame("notes", {"step": [step], "rank": [rank], "code": [f"no_signal_sample_step_{step}"],
                              "message": [message]})  # fmt: skip
