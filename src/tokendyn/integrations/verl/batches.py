"""The batches verl's actor trained on, saved as `tokendyn probe` rollouts files (``policy_loss.probe_save_batches``),
so an update recorded inside verl can be replayed offline on the same tokens, advantages and pi_old.

One parquet file per update and data-parallel rank, ``RUN_DIR/batches/update-KKKK-rankR.parquet`` (K: the
worker's update count from 0), one row per sequence: ``prompt_ids``, ``completion_ids``, ``advantage`` and
``old_logp`` (one value per completion token, as verl's advantages and old log-probs; before tokendyn's Reweight and
Lopti, which rewrite them inside the loss), ``sampler_logp`` (verl's ``rollout_log_probs``, when the rollout returns
them), ``loss_mask`` (verl's response mask) and ``temperature``
(``docs/records.md``, "Rollouts file"). The batch is read in either of verl's layouts: nested (no padding, the
``input_ids`` of each sequence its prompt then its response) or left / right padded with an ``attention_mask``.
A response's length is its response mask's last 1 (single-turn rollouts score every response token).
"""

from __future__ import annotations

from pathlib import Path

import torch

BATCHES_DIR = "batches"


def _padded(value: torch.Tensor) -> torch.Tensor:
    return value.to_padded_tensor(0.0) if value.is_nested else value


def batch_rows(data) -> list[dict]:
    """One rollouts row per sequence of verl's training batch `data` (a TensorDict)."""
    from verl.utils import tensordict_utils as tu

    ids = data["input_ids"]
    if ids.is_nested:
        seqs = list(ids.unbind())
    else:
        attention = data["attention_mask"].bool()
        seqs = [row[keep] for row, keep in zip(ids, attention, strict=True)]
    mask = _padded(data["response_mask"])
    advantages = _padded(data["advantages"]).to(torch.float64)
    old = _padded(data["old_log_probs"]).to(torch.float64)
    # the rollout engine's own log-probs (verl's rollout correction; `calculate_log_probs`): the sampler's side
    sampler = (
        _padded(data["rollout_log_probs"]).to(torch.float64) if "rollout_log_probs" in data.keys() else None
    )
    temperature = float(tu.get(data, "temperature", 1.0) or 1.0)
    rows = []
    for b, seq in enumerate(seqs):
        scored = torch.nonzero(mask[b]).flatten()
        if scored.numel() == 0:
            continue
        n = int(scored.max()) + 1
        rows.append(
            {
                "prompt_ids": seq[: len(seq) - n].tolist(),
                "completion_ids": seq[len(seq) - n :].tolist(),
                "advantage": advantages[b, :n].tolist(),
                "old_logp": old[b, :n].tolist(),
                "loss_mask": mask[b, :n].to(torch.int64).tolist(),
                "temperature": temperature,
                **({"sampler_logp": sampler[b, :n].tolist()} if sampler is not None else {}),
            }
        )
    return rows


def save_batch(data, run_dir: str | Path, update: int, rank: int) -> Path:
    """Write `batch_rows(data)` to ``run_dir/batches/update-{update:04d}-rank{rank}.parquet`` (atomically)."""
    import polars as pl

    from tokendyn.common import atomic_write

    out = Path(run_dir) / BATCHES_DIR / f"update-{update:04d}-rank{rank}.parquet"
    out.parent.mkdir(parents=True, exist_ok=True)
    frame = pl.DataFrame(batch_rows(data))
    atomic_write(out, lambda tmp: frame.write_parquet(tmp))
    return out
