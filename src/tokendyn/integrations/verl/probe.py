"""The probe inside verl's actor engine: `probe_engine(engine, run_dir)` attaches a `GradientProbe` to the engine's
actor module and records every micro-batch of every `engine.train_batch` into RUN_DIR/records/, one shard per
data-parallel rank, in the TRL path's schema (`tokendyn analyze`, `figures` and the report read it unchanged).

What it hooks, and why there: verl's `FSDPEngineWithLMHead.forward_step` runs the module, turns its logits into
per-token log-probs (`prepare_model_outputs`: a nested [B, j] tensor over prompt and response), and calls the loss
function (`ppo_loss` with whichever policy loss is registered). The probe wraps that loss function, so it works under
every loss mode, and inside it

    log_prob = no_padding_2_padding(model_output["log_probs"])      [B, W], as ppo_loss reads it
    model_output["log_probs"] <- the same values, rebuilt from log_prob   (a copy: the loss is computed from log_prob)

so that w = dL/dlog_prob (the whole loss: policy term, KL, and the entropy bonus, whose entropies are rebuilt the
same way) reaches the probe, while the loss's value and every parameter gradient stay bitwise what they were. Each
response token's place in the engine's forward comes from `layout.response_layout` (packed row with remove-padding,
one row per sequence without). The loss's normalisation (token sum / the global batch's tokens x dp size, then FSDP's
average over the data-parallel ranks) makes each rank's records d/d of the global loss once divided by the dp size,
so merged shards equal one process.

Where the batch carries the rollout's log-probs (``rollout.calculate_log_probs``), each micro-batch also writes its
`sampler` records: log mu, log pi_old and verl's rollout-correction weight per token (`integrations.verl.sampler`),
over every generated response token, those verl's rejection sampling removed from ``response_mask`` with weight 0.

After each `train_batch` the step's per-bin numbers are added to verl's metrics (the same on every rank: counts are
summed over the data-parallel group first): ``actor/tokendyn/token_share/bin{b}``, ``actor/tokendyn/bound_violations``,
``actor/tokendyn/identity_rel_err_worst`` (no "max" / "min" in a key: verl's `reduce_metrics` would treat it so).

Not supported, each a one-line error when the probe is attached: Ulysses sequence parallelism > 1 (each rank sees a
slice of every sequence) and fused kernels (no logits, so no exact checks).
"""

from __future__ import annotations

import contextlib
import os
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from tokendyn.common import write_json
from tokendyn.config import ProbeConfig
from tokendyn.config import resolve as resolve_config
from tokendyn.effects.precision import MeasuredPrecision
from tokendyn.hooks.live import check_sums, final_point_sums
from tokendyn.integrations.verl.layout import response_layout
from tokendyn.integrations.verl.loss import LOSS_NAME, VerlConfigError, stage_advantages
from tokendyn.integrations.verl.probe_sample import (  # noqa: F401  (probe_batch re-exported)
    _no_signal_note,
    _response_tensor,
    _temperature,
    probe_batch,
)
from tokendyn.integrations.verl.sampler import sampler_frame
from tokendyn.probe.probe import GradientProbe
from tokendyn.records import RecordWriter
from tokendyn.vocab import TRAIN

METRIC_PREFIX = "actor/tokendyn/"


def check_engine(engine) -> None:
    """The engine options the probe cannot follow, each a one-line error naming the option."""
    sp = int(getattr(engine.engine_config, "ulysses_sequence_parallel_size", 1) or 1)
    if sp > 1:
        raise VerlConfigError(
            f"actor.ulysses_sequence_parallel_size: the tokendyn probe supports 1 (each rank would see a slice of "
            f"every sequence), got {sp}"
        )
    if bool(getattr(engine.model_config, "use_fused_kernels", False)):
        raise VerlConfigError(
            "actor_rollout_ref.model.use_fused_kernels: the tokendyn probe needs the logits, so False, got True"
        )


def _rebuilt(
    values_like: torch.Tensor, per_token: torch.Tensor, flat_index: torch.Tensor, valid: torch.Tensor
):
    """A nested [B, j] tensor like ``values_like`` whose response entries are ``per_token`` [B, W] (zeros elsewhere;
    nothing reads them): the loss then reads exactly ``per_token``'s values, on its graph."""
    flat = torch.zeros_like(values_like.values()).index_put((flat_index[valid],), per_token[valid])
    return torch.nested.nested_tensor_from_jagged(flat, values_like.offsets())


class EngineProbe:
    """The probe attached to one verl engine; see the module docstring. ``step`` counts this engine's
    `train_batch` calls (the optimizer steps), ``stage`` names the records' stage (Lopti's two updates set it)."""

    def __init__(
        self,
        engine,
        run_dir: str | os.PathLike,
        config: ProbeConfig | None = None,
        *,
        method: str = "verl",
        run_config: dict | None = None,
        analyses_every: int = 0,
        flush_every: int = 64,
        seed: int = 0,
        **options,
    ) -> None:
        check_engine(engine)
        self.engine, self.run_dir = engine, Path(run_dir)
        self.packed = bool(engine.use_remove_padding)
        self.config = resolve_config(config, options)
        self.rank = int(engine.get_data_parallel_rank())
        self.dp_size = int(engine.get_data_parallel_size())
        self.probe = GradientProbe(
            engine.module,
            self.config,
            seed=seed,
            auto=True,
            rank=self.rank,
            data_parallel_size=self.dp_size,
        )
        self.writer = RecordWriter(
            self.run_dir, rank=self.rank, flush_every=flush_every, flush_seconds=self.config.flush_seconds
        )
        self.method, self.run_config = method, dict(run_config or {})
        if isinstance(analyses_every, bool) or not isinstance(analyses_every, int) or analyses_every < 0:
            raise VerlConfigError(
                f"probe analyses_every: must be an integer >= 0 (0: off), got {analyses_every!r}"
            )
        self.analyses_every, self.seed = analyses_every, seed
        self.last_analysis: dict | None = None
        self._precision = MeasuredPrecision(
            every=self.config.precision_check_every
        )  # (step_precision measured)
        self.step, self.stage = 0, TRAIN
        self.results: list = []  # the StepResults of the latest train_batch, one per micro-batch
        self._records: list[dict] = []
        self._original = None
        self._temperature: float | None = None
        self._micro = 0  # the micro-batches of the running train_batch (the sampler records' `micro`)

    # ---- attaching -----------------------------------------------------------------------------------------
    def attach(self) -> EngineProbe:
        if self._original is not None:
            return self
        self.probe.sink = self._sink
        self.probe.attach()
        self._original = self.engine.train_batch
        self.engine.train_batch = self.train_batch  # an instance attribute: this engine only
        return self

    def detach(self) -> None:
        if self._original is None:
            return
        del self.engine.train_batch
        self._original = None
        self.probe.detach()
        self.writer.flush()

    def __enter__(self) -> EngineProbe:
        return self.attach()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.detach()

    # ---- the step --------------------------------------------------------------------------------------------
    def _sink(self, records: dict) -> None:
        self.writer.add(records)
        self._records.append(records)
        self.results.append(self.probe.last)

    def train_batch(self, data, loss_function):
        """`engine.train_batch` with the probe on: every micro-batch's loss goes through `_probed_loss`."""
        self.results, self._records, self._micro = [], [], 0
        if self.analyses_every and self.step % self.analyses_every == 0:
            self.analyze(data, loss_function)
        try:
            outputs = self._original(data, partial(self._probed_loss, loss_function))
            if self.probe._pass is not None:  # the last micro-batch ends with the step
                self.probe.end_step()
        except BaseException:
            # what finished is recorded (an unfinished micro-batch is dropped with a warning); verl's error wins
            with contextlib.suppress(Exception):
                self.probe.end_step()
            raise
        metrics = self.step_metrics()
        if isinstance(outputs, dict) and "metrics" in outputs:
            # one-element lists, as verl keeps a loss metric per micro-batch
            outputs["metrics"].update({key: [value] for key, value in metrics.items()})
        if self.rank == 0 and self.step == 0:
            self._write_run_json()
        self.step += 1
        return outputs

    def _probed_loss(self, loss_function, model_output, data, dp_group=None):
        from verl.workers.utils.padding import no_padding_2_padding

        log_prob = no_padding_2_padding(model_output["log_probs"], data)  # [B, W] on the graph
        width = log_prob.shape[1]
        layout = response_layout(data["input_ids"], data, width, self.packed)
        valid = layout.valid
        # the nested index of the log-prob of response token t: the position before o_t in the sequence's values
        start = 0 if self.packed else data["input_ids"].offsets()[:-1].to(log_prob.device)[:, None]
        flat_index = layout.positions - 1 + start
        mask = _response_tensor(data, "response_mask").bool()
        out = dict(model_output)
        out["log_probs"] = _rebuilt(model_output["log_probs"], log_prob, flat_index, valid)
        entropy = None
        ent = model_output.get("entropy")
        if ent is not None and ent.requires_grad:
            entropy = no_padding_2_padding(ent, data)
            out["entropy"] = _rebuilt(ent, entropy, flat_index, valid)
        old = _response_tensor(data, "old_log_probs")
        adv = self._advantages(_response_tensor(data, "advantages"), old, mask, loss_function)
        self._temperature = _temperature(data)
        self.probe.begin_step(
            self.step,
            self.stage,
            completion_mask=mask,
            advantages=adv,
            old_logp=old,
            completion_ids=layout.completion_ids,
            token_positions=layout.positions,
            token_rows=layout.rows,
            logps=log_prob,
            entropy=entropy,
            temperature=self._temperature,
        )
        # the rollout's log-probs and verl's rollout-correction weights beside pi_old (`integrations.verl.sampler`)
        # over every generated token: verl's rejection sampling narrowed ``mask``, the rejected tokens weighted 0
        sampler = sampler_frame(data, valid, mask, self.step, self.stage, self._micro, self.rank)
        if sampler is not None:
            self.writer.add({"sampler": sampler})
        self._micro += 1
        return loss_function(model_output=out, data=data, dp_group=dp_group)

    def analyze(self, data, loss_function) -> dict:
        """The rebalancing analyses the probe config switches on (update shares per bin and per token, the
        counterfactual probability change, the influence matrix), on the first ``sample_sequences`` sequences of
        the batch with a non-zero advantage (`probe_batch`; none: a ``notes`` record, no analyses), with verl's
        own loss as the objective (`objective.VerlObjective`), at the current weights and before the step's forward
        (the model is left bitwise as it was); written to RUN_DIR/records. Under several data-parallel ranks every
        rank analyses data-parallel rank 0's sample (FSDP2's collectives run on all of them, and the averaged
        gradients are then that sample's), and rank 0 writes the records."""
        from tokendyn.effects.rebalance import analyze_batch
        from tokendyn.hooks.options import rebalance_options
        from tokendyn.integrations.verl.objective import VerlObjective
        from tokendyn.records import write_frames

        config = getattr(loss_function, "keywords", {}).get("config")
        if config is None:
            raise VerlConfigError(
                "probe analyses: the loss function must be partial(ppo_loss, config=actor_config)"
            )
        batch = probe_batch(data, self.config.sample_sequences, _temperature(data))
        group = self.engine.get_data_parallel_group()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            shared = [batch]
            dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
            batch = shared[0]
        if batch is None:  # no sequence with an advantage: an analysis would measure rounding
            frames = {"notes": _no_signal_note(self.step, self.rank)}
            if self.rank == 0:
                write_frames(self.run_dir, frames, rank=self.rank)
            self.last_analysis = frames
            return frames
        edges = self.probe.bins.edges if self.probe.bins.kind != "quantiles" else None
        self.probe.enabled = False  # the analyses' forwards and backwards are not training passes
        try:
            frames = analyze_batch(
                self.engine.module,
                batch,
                step=self.step,
                stage=self.stage,
                edges=edges,
                options=rebalance_options(self.config, self.seed),
                objective=VerlObjective(config, seed=self.seed),
                precision_state=self._precision,
            )
        finally:
            self.probe.enabled = True
        if self.rank == 0:
            write_frames(self.run_dir, frames, rank=self.rank)
        self.last_analysis = frames
        return frames

    @staticmethod
    def _advantages(adv, old, mask, loss_function):
        """The advantages the loss optimises: tokendyn's loss mode rewrites them (Reweight, the Lopti stage)."""
        config = getattr(loss_function, "keywords", {}).get("config")
        opts = getattr(config, "policy_loss", None)
        if opts is None or getattr(opts, "loss_mode", None) != LOSS_NAME:
            return adv
        return stage_advantages(adv, old, mask, opts.reweight_alpha, opts.eta, opts.lopti_stage)

    # ---- metrics and the run file ----------------------------------------------------------------------------
    def step_metrics(self) -> dict[str, float]:
        """The latest train_batch's live numbers over every micro-batch of every data-parallel rank (counts and
        sums all-reduced first, so every rank reports the same): per bin b at the deepest probe point (the final
        norm), ``token_share/bin{b}`` = n_b / n (scored tokens) and ``grad_sq_share/bin{b}`` =
        sum_{t in b} ||delta_t||^2 / sum_t ||delta_t||^2 (how the per-token gradient energy at the final hidden
        states splits over the bins); ``bound_violations`` (logits + head, summed: must be 0) and
        ``identity_rel_err_worst`` (the LM-head identity's largest relative error)."""
        spec = self.probe.bins
        n_bins = spec.n if spec.kind == "quantiles" else len(spec.edges) - 1
        sums = torch.zeros(
            2 * n_bins + 1, dtype=torch.float64
        )  # token counts, then sum of norm^2, violations
        worst = torch.zeros(1, dtype=torch.float64)
        for rec in self._records:
            for b, (count, sumsq) in final_point_sums(rec).items():
                sums[b] += count
                sums[n_bins + b] += sumsq
            violations, err = check_sums(rec)
            sums[2 * n_bins] += violations or 0.0
            worst[0] = max(worst[0].item(), err or 0.0)
        group = self.engine.get_data_parallel_group()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
        n, energy = sums[:n_bins].sum().item(), sums[n_bins : 2 * n_bins].sum().item()
        out = {}
        for b in range(n_bins):
            out[f"{METRIC_PREFIX}token_share/bin{b}"] = sums[b].item() / n if n else 0.0
            out[f"{METRIC_PREFIX}grad_sq_share/bin{b}"] = sums[n_bins + b].item() / energy if energy else 0.0
        out[f"{METRIC_PREFIX}bound_violations"] = sums[2 * n_bins].item()
        out[f"{METRIC_PREFIX}identity_rel_err_worst"] = worst.item()
        return out

    def _write_run_json(self) -> None:
        path = self.run_dir / "run.json"
        if not path.is_file():
            info = {
                "method": self.method,
                "config": {"temperature": self._temperature, **self.run_config},
                "probe": self.config.to_dict(),
                "source": "verl",
                "data_parallel_size": self.dp_size,
                "remove_padding": self.packed,
            }
            write_json(path, info)


@contextmanager
def probe_engine(engine, run_dir: str | os.PathLike, config: ProbeConfig | None = None, **kwargs):
    """Probe every `engine.train_batch` inside the block (see `EngineProbe` for the arguments)::

    with probe_engine(worker.engine, "runs/verl", ProbeConfig(bins="intervals:4")) as probe:
        worker.train_mini_batch(batch)        # or engine.train_batch(data, loss_function)
    """
    with EngineProbe(engine, run_dir, config, **kwargs) as probe:
        yield probe
