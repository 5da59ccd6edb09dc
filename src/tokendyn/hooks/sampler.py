"""The sampler's side of a probed micro-batch: per token, the engine's log-prob log mu, the trainer's log pi_old,
log rho = log pi_old - log mu, and the importance weight the loss applied (the `sampler` record kind).

Read, not re-derived: TRL keeps vLLM's processed log-probs as ``sampling_per_token_logps`` and the weight its loss
multiplies in as ``importance_sampling_ratio`` ((B, 1) in the sequence modes, (B, C) in the token modes; truncated
or masked as ``vllm_importance_sampling_mode`` says). A token's ``seq_masked`` is true when the weight on its
sequence is 0 at every valid token (a sequence mode's mask, or a token mode that masked them all); in a token mode
a single masked token has ``is_weight`` 0 and ``seq_masked`` false. `token_frame` writes the rows from the three
tensors whichever framework holds them (verl's: `tokendyn.integrations.verl.sampler`).

The noise floor (the `floor` kind, `split_logps`): the trainer's log-probs of the same tokens recomputed in two halves
at the same parameters, against the forward the loss used, in the same columns. Taken on the first micro-batch of each
probed optimizer step, on its first `FLOOR_ROWS` rows: a reference level needs no more. On the embedded default a
no-grad forward of every probed micro-batch cost 19 % of the update phase; 4 rows of a step's first cost 3.0 %
(`bench/floor_cost.py`). The halves run as a side pass that leaves training untouched (`side_pass`): every module in
eval mode (no dropout), torch's RNG states (CPU, and each accelerator device the model is on) saved and restored, the
training flags restored on any exit; so the trained weights are those of the same run without the floor, bit for bit.
What it measures: without dropout (the embedded Qwen2 default and SmolLM2-135M have none), the trainer against
itself under another micro-batch split, the kernels' difference alone. With dropout > 0 the loss's forward draws its
dropout masks and the halves draw none: the floor is then the dropout's effect on the trainer's log pi plus that
kernel difference, the part of a sampler's log rho (a sampler draws no dropout) that the trainer's dropout alone makes.

With the correction off and the rollout's steps aligned (one optimizer step per generation, no iterations) TRL keeps
no ``old_per_token_logps``: its loss takes the current log-probs, detached, as log pi_old. The probe then passes its
own per-token log-probs of the micro-batch (`needs_logp_old`, ``logp_old=``): the same forward the loss used.

Truncated sampling (top_p < 1, top_k > 0, min_p > 0, or a repetition / frequency / presence penalty, read from the
trainer's args as TRL passes them to vLLM): vLLM's processed log-prob is renormalised over the kept tokens, so log rho
carries log S besides the precision mismatch. `kept_logps` recomputes the trainer's full logits of the micro-batch
(one no-grad forward, a `side_pass`) and gives each token log S and the precision part
log rho_precision = log rho - log S + (log q(o) - log pi(o)) (`tokendyn.hooks.kept_mass`); both null without any
processing, and null (with a `notes` row) when ``generation_kwargs`` hold a logit change that is not modelled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import polars as pl
import torch
from torch import nn

from tokendyn.hooks.kept_mass import Processing, history, kept_mass, processing_from_args
from tokendyn.probe.forward import eval_mode

SAMPLER_KEY = "sampling_per_token_logps"
WEIGHT_KEY = "importance_sampling_ratio"
FLOOR_ROWS = 4  # the floor's rows: the micro-batch's first 4, recomputed as two halves of 2


def needs_logp_old(inputs: dict) -> bool:
    """The batch has the sampler's log-probs but TRL kept no log pi_old (correction off, steps aligned)."""
    return inputs.get(SAMPLER_KEY) is not None and inputs.get("old_per_token_logps") is None


def sampler_frame(
    inputs: dict,
    step: int,
    stage: str,
    micro: int,
    rank: int,
    logp_old: torch.Tensor | None = None,
    kept: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> pl.DataFrame | None:
    """The `sampler` rows of one micro-batch (every valid completion token), None when the batch carries no
    sampler log-probs (TRL's own ``generate``) or no log pi_old (TRL's, else ``logp_old`` [B, C]); ``kept``: log S
    and delta [B, C] (`kept_logps`), None: no truncation (the two columns null)."""
    logp_mu = inputs.get(SAMPLER_KEY)
    if logp_old is None:
        logp_old = inputs.get("old_per_token_logps")
    if logp_mu is None or logp_old is None:
        return None
    mask = inputs["completion_mask"].bool()
    if "tool_mask" in inputs:
        mask = mask & inputs["tool_mask"].bool()
    return token_frame(logp_old, logp_mu, mask, inputs.get(WEIGHT_KEY), step, stage, micro, rank, kept)


def token_frame(
    logp_old: torch.Tensor,
    logp_mu: torch.Tensor,
    mask: torch.Tensor,
    weight: torch.Tensor | None,
    step: int,
    stage: str,
    micro: int,
    rank: int,
    kept: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> pl.DataFrame:
    """The `sampler` rows of the tokens where ``mask`` [B, C] is true: log pi_old, log mu [B, C], and the weight
    the loss multiplied in ([B, C], or [B, 1] for a sequence's; None: 1), whichever framework read them. ``kept``
    = (log S, delta) [B, C] of a truncated sampler (`tokendyn.hooks.kept_mass`): ``log_kept`` = log S and
    ``log_rho_precision`` = log rho + delta (= log rho - log S without a penalty); None: both null."""
    mask = mask.bool()
    weight = torch.ones_like(logp_old) if weight is None else weight.expand_as(logp_old)
    weight = weight.double()
    seq_masked = ((weight == 0) | ~mask).all(dim=1, keepdim=True).expand_as(mask)
    rows, pos = mask.nonzero(as_tuple=True)
    old, mu = logp_old.double()[mask], logp_mu.double()[mask]
    n = int(rows.numel())
    if kept is None:
        log_kept = precision = [None] * n
    else:
        log_kept = kept[0].double()[mask].tolist()
        precision = (old - mu + kept[1].double()[mask].to(old.device)).tolist()
    return pl.DataFrame(
        {
            "step": [int(step)] * n,
            "stage": [stage] * n,
            "rank": [int(rank)] * n,
            "micro": [int(micro)] * n,
            "row": rows.int().tolist(),
            "pos": pos.int().tolist(),
            "logp_old": old.tolist(),
            "logp_sampler": mu.tolist(),
            "log_rho": (old - mu).tolist(),
            "is_weight": weight[mask].tolist(),
            "seq_masked": seq_masked[mask].tolist(),
            "log_kept": log_kept,
            "log_rho_precision": precision,
        },
        schema_overrides={"log_kept": pl.Float64, "log_rho_precision": pl.Float64},
    )


def split_logps(trainer, inputs: dict, rows: int = FLOOR_ROWS) -> torch.Tensor | None:
    """log pi [R, C] of the completion tokens of the micro-batch's first R = min(rows, B) rows recomputed in two
    halves, each cut after its own longest completion (fewer rows, a shorter sequence: other kernel shapes; the
    positions and every token's context unchanged), through TRL's own ``_get_per_token_logps_and_entropies``, no
    grad, as a `side_pass` (eval mode: no dropout; the RNG untouched); 0 past each half's cut. None for a single
    row."""
    from trl import GRPOTrainer

    rows = min(rows, inputs["prompt_ids"].size(0))
    prompt, completion = inputs["prompt_ids"][:rows], inputs["completion_ids"][:rows]
    mask = inputs["completion_mask"][:rows]
    if rows < 2:
        return None
    out = torch.zeros(completion.shape, dtype=torch.float32, device=completion.device)
    h = (rows + 1) // 2
    with torch.no_grad(), side_pass(trainer.model):
        for part in (slice(0, h), slice(h, rows)):
            cut = max(1, int(mask[part].sum(1).max()))
            ids = torch.cat([prompt[part], completion[part, :cut]], dim=1)
            attn = torch.cat([inputs["prompt_mask"][:rows][part], mask[part, :cut]], dim=1)
            # TRL's method, not tokendyn's override (which consumes a pending KL stage)
            logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
                trainer, trainer.model, ids, attn, cut
            )
            out[part, :cut] = logps.detach().float()
    return out


def kept_logps(trainer, inputs: dict, proc: Processing) -> tuple[torch.Tensor, torch.Tensor]:
    """log S and delta(o) [B, C] (float64, `tokendyn.hooks.kept_mass.kept_mass`) of every completion token of the
    micro-batch, from the trainer's full logits at the token's position: one no-grad forward of the micro-batch as
    the loss sees it (prompt and completion, the same attention mask), as a `side_pass` (eval mode; the RNG
    untouched). Row by row in float64; a penalty's history is the row's real prompt ids and its completion so far.
    At the parameters of this forward: theta_old at a rollout's first optimizer step (TRL's default: one optimizer
    step per rollout); at a later step of the same rollout (``num_iterations`` > 1, ``steps_per_generation`` >
    ``gradient_accumulation_steps``, Lopti's second stage) log S carries the drift of the updates since."""
    prompt, completion = inputs["prompt_ids"], inputs["completion_ids"]
    c = completion.size(1)
    ids = torch.cat([prompt, completion], dim=1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad(), side_pass(trainer.model):
        logits = trainer.model(input_ids=ids, attention_mask=attn, logits_to_keep=c + 1).logits[:, :-1]
        out = torch.zeros(2, *completion.shape, dtype=torch.float64, device=completion.device)
        for b in range(completion.size(0)):
            seen = counts = None
            if proc.penalises:
                real = prompt[b][inputs["prompt_mask"][b].bool()]
                seen, counts = history(real, completion[b], logits.size(-1))
            kept = kept_mass(logits[b], completion[b], proc, seen, counts)
            out[0, b], out[1, b] = kept.log_kept, kept.shift
    return out[0], out[1]


@contextmanager
def side_pass(model: nn.Module) -> Iterator[nn.Module]:
    """A forward that is not a training pass and must not change training: every submodule in eval mode (no dropout
    mask drawn, no layer dropped), its training flag restored on exit, exception or not; torch's CPU RNG state and
    that of each accelerator device holding a parameter saved on entry and restored on exit (whatever the pass drew,
    the training forwards after it draw what they would have drawn without it)."""
    devices = {p.device for p in model.parameters() if p.device.type not in ("cpu", "meta")}
    kinds = {d.type for d in devices}
    if len(kinds) > 1:
        raise ValueError(f"side_pass: the model's parameters are on several device types {sorted(kinds)}")
    kind = kinds.pop() if kinds else None
    indices = sorted({d.index if d.index is not None else 0 for d in devices})
    with torch.random.fork_rng(devices=indices, device_type=kind), eval_mode(model, checkpoint=False):
        yield model


def floor_frame(inputs: dict, logp_loss: torch.Tensor, logp_split: torch.Tensor, *key) -> pl.DataFrame | None:
    """The `floor` rows of the first R rows (``logp_split`` [R, C]): ``logp_loss`` (the loss's forward, [B, C]) as
    log pi_old, ``logp_split`` in the sampler's column."""
    r = logp_split.size(0)
    mask = {k: inputs[k][:r] for k in ("completion_mask", "tool_mask") if k in inputs}
    return sampler_frame({**mask, SAMPLER_KEY: logp_split}, *key, logp_old=logp_loss[:r])


class SamplerSide:
    """The `sampler` and `floor` records of a trainer's probed micro-batches. At ``begin`` (before the loss's
    forward): the sampler rows where TRL kept both sides, and the floor's two halves (with ``quiet``, a context that
    keeps the probe's hooks off); what needs the loss's own forward waits for ``end(logp)``."""

    def __init__(self, trainer, write: Callable[[dict], None], quiet: Callable, floor: bool) -> None:
        self.trainer, self.write, self.quiet, self.floor = trainer, write, quiet, floor
        self._sampler = None  # (inputs, key, kept): sampler rows waiting for the forward's log-probs
        self._floor = None  # (inputs, log-probs in halves, key): the floor, waiting for the same
        self.processing, self._unmodelled = processing_from_args(trainer.args)
        self._noted = False

    def _kept(self, inputs: dict, key: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
        """log S and delta of the micro-batch's tokens (`kept_logps`), None without processing or when the
        processing is not modelled (noted once)."""
        if not self.processing.active:
            return None
        if self._unmodelled is not None:
            if not self._noted:
                self._noted = True
                message = (f"sampler: generation_kwargs {self._unmodelled} change the engine's logits in a way "
                           "tokendyn does not model; log_kept and log_rho_precision are null")  # fmt: skip
                self.write({"notes": {"step": [None], "rank": [key[3]], "code": ["kept_mass_unmodelled"],
                                      "message": [message]}})  # fmt: skip
            return None
        with self.quiet():
            return kept_logps(self.trainer, inputs, self.processing)

    def begin(self, inputs: dict, *key) -> None:
        """``key`` = (step, stage, micro, rank) of the micro-batch; the floor at micro 0 (a step's first)."""
        has_mu = inputs.get(SAMPLER_KEY) is not None
        kept = self._kept(inputs, key) if has_mu else None
        sampler = sampler_frame(inputs, *key, kept=kept)
        if sampler is not None:  # vLLM sampled: its log-probs beside the trainer's, and the weight applied
            self.write({"sampler": sampler})
        elif needs_logp_old(inputs):  # TRL's loss takes this forward's log-probs as pi_old: read at the end
            self._sampler = (inputs, key, kept)
        if (
            self.floor and key[2] == 0
        ):  # the trainer against itself, before the loss's forward: a step's first
            with self.quiet():
                split = split_logps(self.trainer, inputs, FLOOR_ROWS)
            if split is not None:
                self._floor = (inputs, split, key)

    def end(self, logp: torch.Tensor | None) -> None:
        """``logp`` [B, C]: the loss's forward log-probs (None: the step recorded nothing; drop what waits)."""
        pending, self._sampler = self._sampler, None
        floor, self._floor = self._floor, None
        if logp is None:
            return
        if pending is not None:
            inputs, key, kept = pending
            self.write({"sampler": sampler_frame(inputs, *key, logp_old=logp, kept=kept)})
        if floor is not None:
            inputs, split, key = floor
            self.write({"floor": floor_frame(inputs, logp, split.to(logp.device), *key)})
