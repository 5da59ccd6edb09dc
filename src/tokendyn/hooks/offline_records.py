"""The offline probe's small records (`tokendyn.hooks.offline`): its `sampler` rows, the sample the analyses take,
the note when that sample is empty, and the versions run.json names.

A rollouts file carries the sampler's log-probs (column ``sampler_logp``) but no importance weight: nothing was
applied to the loss, so a row's ``is_weight`` and ``seq_masked`` are unknown, null (not 1 and false, which would
claim a run that weighed every token by 1 and masked nothing).
"""

from __future__ import annotations

import numpy as np
import polars as pl
import torch

from tokendyn.hooks.rollouts import Rollouts
from tokendyn.hooks.sampler import sampler_frame
from tokendyn.probe.batch import signal_rows
from tokendyn.records import to_frame
from tokendyn.vocab import TRAIN

NO_SIGNAL = "no sequence of the sample has a non-zero advantage; analyses skipped"


def offline_sampler_frame(
    b: dict, mask: torch.Tensor, micro: int, logp: torch.Tensor | None
) -> pl.DataFrame | None:
    """The `sampler` rows of one offline micro-batch ``b`` (its scored tokens ``mask``; log pi_old the file's
    column, else ``logp``, the model's own): the weight columns null (module docstring). None without log mu."""
    frame = sampler_frame({**b, "completion_mask": mask}, 0, TRAIN, micro, 0, logp_old=logp)
    if frame is None:
        return None
    return frame.with_columns(
        pl.lit(None, dtype=pl.Float64).alias("is_weight"), pl.lit(None, dtype=pl.Boolean).alias("seq_masked")
    )


def signal_sample(rollouts: Rollouts, n: int) -> list[int]:
    """The rows the analyses take: the first ``n`` rows of the file (in its order) with some scored token whose
    advantage is not 0 (`tokendyn.probe.batch.signal_rows`, the trainer's rule), fewer when it has fewer."""
    rows: list[int] = []
    for i in range(rollouts.n):
        if len(rows) >= n:
            break
        adv = torch.as_tensor(np.asarray(rollouts.advantages[i], dtype=np.float64))
        scored = torch.as_tensor(np.asarray(rollouts.scored(i)) != 0).unsqueeze(0)
        if bool(signal_rows(adv.reshape(1, -1) if adv.dim() else adv.reshape(1), scored)[0]):
            rows.append(i)
    return rows


def no_signal_note() -> pl.DataFrame:
    return to_frame("notes", {"step": [0], "rank": [0], "code": ["no_signal_sample"], "message": [NO_SIGNAL]})


def versions() -> dict:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("tokendyn", "torch", "transformers", "trl"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out
