"""The probe inside TRL's GRPO loop: thin glue between `TokendynGRPOTrainer` and `GradientProbe`.

The trainer calls three methods: `begin(inputs, stage)` at the top of its loss (after the Lopti
stage masking, with exactly the tensors the loss uses), `end()` after the micro-step's backward,
and `close()` at the end of training. ``probe_every`` counts rollouts (`tokendyn.analysis.schedule`): every
micro-batch of every optimizer step of a probed rollout is recorded, Lopti's two stages apart (stage "low" / "high",
`tokendyn.vocab.stage_name`); plain GRPO is stage "train". No extra forward or backward pass is made for these
statistics: they are read from the training backward.

The rebalancing analyses (`tokendyn.effects.rebalance`) are the one deliberate extra cost: once per probed
rollout, at its first micro-step, `analyze(inputs)` runs them on the first
``probe_sample_sequences`` sequences of the global rollout batch (before any update of that batch; the model is not
modified), and after the batch's last optimizer step the same sequences are re-scored for the real change. The
global rollout batch is the ranks' generation batches concatenated in rank order, in the sampler's order, before
TRL shuffles it into micro-batches: the batch one process would generate from the same prompts (TRL hands process
r the prompts r * n .. (r + 1) * n - 1 of it). `rollout(output)` gathers those rows on every rank (padded across
processes as one process pads them); under DDP the analyses then run on rank 0 alone, on the unwrapped model (they
make no collective call); under FSDP2 every rank runs them on the same gathered rows (each forward and backward is a
collective; norms and inner products are summed over the ranks' shards, `tokendyn.probe.parallel`), and the per-token
shares are skipped there (`tokendyn.effects.shares.FSDP_NO_TOKEN_SHARES`, a `notes` record that `tokendyn analyze`
prints). Only rank 0 writes their records. With Lopti, the
`shares` record also holds each stage's decomposition (stage "low" / "high", `stage_shares_frame`): the gradient of
the stage's loss on the same sequences, at the parameters the stage starts from (stage 2: after the real stage-1
optimizer steps), recorded at the global step where it is taken (stage 2: later than the rollout's other records).
The full-loss shares keep stage "train".
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import polars as pl
import torch
from transformers import TrainerCallback

from tokendyn.analysis.schedule import probed_rollout, rollout_of, steps_per_rollout
from tokendyn.effects.change import completion_probs, fix_pi_old, real_change
from tokendyn.effects.precision import MeasuredPrecision
from tokendyn.effects.rebalance import analyze_update, real_change_frame, stage_shares_frame
from tokendyn.effects.shares import FSDP_NO_TOKEN_SHARES
from tokendyn.effects.token_view import token_rules_frame, with_real_change
from tokendyn.hooks.options import rebalance_options
from tokendyn.hooks.paired_step import paired_comparison
from tokendyn.hooks.rollouts import dump_rollouts
from tokendyn.hooks.sampler import SamplerSide
from tokendyn.hooks.spikes import LiveSpikes
from tokendyn.probe.batch import signal_first, signal_rows
from tokendyn.probe.parallel import is_fully_sharded
from tokendyn.probe.probe import GradientProbe
from tokendyn.probe.tokenloss import Objective, ProbeBatch
from tokendyn.records import RecordWriter, write_frames
from tokendyn.vocab import stage_name

# the rows of a rollout batch the analyses read (TRL's keys, and the Lopti masks of `TokendynGRPOTrainer`)
SAMPLE_KEYS = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "tool_mask",
    "advantages",
    "raw_advantages",  # before Reweight (the paired comparison's base rule)
    "old_per_token_logps",
    "ref_per_token_logps",
    "lopti_stage1_mask",
    "lopti_stage2_mask",
    "sampling_per_token_logps",  # vLLM's log-probs (the off-policy mask's)
    "importance_sampling_ratio",  # vLLM's importance-sampling correction, (B, T) or (B, 1)
    "lp_reg_proxy_logp",  # Lp-Reg's min-p proxy of pi_old (policy_loss lp_reg)
    "sequence_rewards",  # the rewards, for the paired comparison's W-REINFORCE rule
)


def step_objective(objective: Objective, trainer) -> Objective:
    """The objective of the step about to run: with TRL's adaptive entropy, the coefficient it applies now
    (``entropy_coef`` if the last window's entropy is <= ``entropy_target``, else 0; TRL 1.16 ``_compute_loss``);
    with Clip-Cov, the seed of the step's random draw (`tokendyn.trainers.grpo.cov_seed`)."""
    from dataclasses import replace

    if getattr(trainer, "use_adaptive_entropy", False):
        applied = trainer.entropy_coef if trainer._last_world_entropy <= trainer.args.entropy_target else 0.0
        objective = replace(objective, entropy_coef=float(applied))
    if objective.policy_loss == "clip_cov":
        objective = replace(objective, cov_seed=trainer.cov_seed())
    return objective


class TrainerProbe(TrainerCallback):
    """Owns the probe and its record writer for one trainer (also a callback: closes at train end)."""

    def __init__(self, trainer, run_dir: str | Path):
        args = trainer.args
        cfg = self.config = args.probe_config()
        self.trainer = trainer
        self.every = int(args.probe_every)
        self.order = getattr(args, "lopti_order", "low_first")
        self.writer = RecordWriter(
            run_dir,
            rank=trainer.accelerator.process_index,
            flush_every=8,
            flush_seconds=cfg.flush_seconds,
        )
        self.probe = GradientProbe(
            trainer.accelerator.unwrap_model(trainer.model),
            cfg,
            temperature=args.temperature,
            seed=args.seed,
            sink=self.writer.add,
            rank=trainer.accelerator.process_index,
            # DDP / FSDP average the ranks' gradients: the update is the gradient of the mean of their losses
            data_parallel_size=trainer.accelerator.num_processes,
        ).attach()
        self._open = False
        floor = bool(getattr(trainer.args, "probe_floor", False))
        self.sampler = SamplerSide(trainer, self.writer.add, self._quiet, floor)
        self._micro: dict[tuple[int, str], int] = {}  # micro-batches begun per (step, stage)
        self.run_dir = Path(run_dir)
        self.analyses = cfg.active_analyses
        self.sample = cfg.sample_sequences
        self._pending_real = None
        self._pending_stage2 = None  # (batch, stage-2 mask) of a Lopti rollout, for the stage-2 shares
        self._sample_rows: dict | None = None  # the analysed rows of the global batch (rank 0; FSDP2: all)
        # the spike trigger (on the analyses' values; one process: every rank must agree on the extra rollout)
        one = trainer.accelerator.num_processes == 1
        self.spikes = LiveSpikes(cfg.spike_k) if self.analyses and cfg.spike_k and one else None
        if self.analyses:
            self.options = rebalance_options(cfg, seed=args.seed)
            self.precision = MeasuredPrecision(every=cfg.precision_check_every)  # (step_precision "measured")
            self.objective = Objective.from_config(args)  # the trained loss, or an error naming what is not
            edges = self.probe.bins.edges
            self.edges = list(edges) if edges is not None else None  # quantile bins: the paper's edges here

    def _generate_every(self) -> int:
        """Micro-steps of one rollout batch (both Lopti stages: TRL's ``num_iterations`` is doubled then)."""
        return self.trainer.args.steps_per_generation * self.trainer.num_iterations

    def _in_rollout(self) -> int:
        """The micro-step about to run, counted from its rollout batch's first (0: the rollout's start)."""
        return self.trainer._step % self._generate_every()

    def rollout(self, output: dict) -> None:
        """Called by the trainer with each rollout batch it generates (this rank's rows, before TRL's shuffle): on a
        probed rollout, keep the analysed sample: the first ``probe_sample_sequences`` rows of the global batch that
        carry a signal (some scored token with A != 0; `tokendyn.probe.batch.signal_rows`), fewer when the batch
        has fewer, none when it has none (a collective: every rank calls it)."""
        t = self.trainer
        if not self.analyses or not self.due() or self._in_rollout():
            return
        acc = t.accelerator
        mask = output["completion_mask"]
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]
        # the first S global rows with signal lie in the first min(S, n) rows of each rank's n, signal rows first
        rows = signal_first(output["advantages"], mask, self.sample)
        output = {**output, "has_signal": signal_rows(output["advantages"], mask)}
        pad_id = t._tokenizer.pad_token_id  # (pad value, left side) as TRL pads each rank's batch
        padding = {"prompt_ids": (pad_id, True), "prompt_mask": (0, True), "completion_ids": (pad_id, False)}
        padding["tool_mask"] = (1, False)
        sample = {}
        for key in (*SAMPLE_KEYS, "has_signal"):
            value = output.get(key)
            if value is None:
                continue
            value = value[rows]
            if acc.num_processes > 1:
                pad_index, first = padding.get(key, (0, False))
                dtype = value.dtype
                value = value.long() if dtype == torch.bool else value
                if value.dim() > 1:
                    value = acc.pad_across_processes(value, dim=1, pad_index=pad_index, pad_first=first)
                value = acc.gather(value).to(dtype)
            sample[key] = value
        keep = sample.pop("has_signal").bool().nonzero().squeeze(1)[: self.sample]
        sample = {key: value[keep] for key, value in sample.items()}
        self._sample_rows = sample if acc.is_main_process or self._sharded() else None

    def _sharded(self) -> bool:
        """FSDP2: every rank takes part in the analyses (their forwards and backwards are collectives)."""
        return is_fully_sharded(self.trainer.accelerator.unwrap_model(self.trainer.model))

    def _write(self, frames: dict) -> None:
        """Rank 0 writes the analyses' records (under FSDP2 every rank computed the same ones)."""
        if self.trainer.accelerator.is_main_process:
            write_frames(self.run_dir, frames, rank=self.trainer.accelerator.process_index)

    def analyze(self, inputs: dict) -> None:
        """The rebalancing analyses of a rollout batch (first micro-step of a probed rollout only); with Lopti also
        the update shares of each stage, at the start of that stage (stage 2 after the real stage-1 update)."""
        t = self.trainer
        if not t.model.training:
            return
        if self._pending_stage2 is not None and self._in_rollout() == self._stage2_start():
            self._stage2_shares()
        if not self.due() or self._in_rollout():  # once per probed rollout, at its start
            return
        if t.args.probe_dump_rollouts and t.accelerator.is_main_process:
            dump_rollouts(
                inputs, self.run_dir / "rollouts" / f"step-{t.state.global_step:06d}.parquet", t.temperature
            )
        if not self.analyses:
            return
        model = t.accelerator.unwrap_model(t.model)
        sharded = is_fully_sharded(model)
        sample, self._sample_rows = self._sample_rows, None
        if not (t.accelerator.is_main_process or sharded):
            return  # DDP: rank 0 analyses the global sample; FSDP2: every rank does, on the same rows
        if sharded and "token_shares" in self.analyses:
            self.probe.note("fsdp_no_token_shares", FSDP_NO_TOKEN_SHARES, step=t.state.global_step)
        if sample is None:
            raise RuntimeError(
                "probe: no rollout batch was handed to TrainerProbe.rollout before its analyses"
            )
        if (
            sample["completion_ids"].size(0) == 0
        ):  # every group's rewards equal: nothing to analyse but rounding
            self.probe.note(
                f"no_signal_sample_step_{t.state.global_step}",
                f"step {t.state.global_step}: no sequence of the rollout batch has a non-zero advantage (every "
                "group's rewards are equal), so this step's analyses are skipped",
                step=t.state.global_step,
                warn=False,
            )
            return
        mask = sample["completion_mask"]
        if "tool_mask" in sample:
            mask = mask * sample["tool_mask"]
        batch = ProbeBatch(
            input_ids=torch.cat([sample["prompt_ids"], sample["completion_ids"]], dim=1),
            attention_mask=torch.cat([sample["prompt_mask"], sample["completion_mask"]], dim=1),
            completion_mask=mask,
            advantages=sample["advantages"],
            old_logp=sample.get("old_per_token_logps"),
            ref_logp=sample.get("ref_per_token_logps"),
            temperature=t.temperature,
            sampling_logp=sample.get("sampling_per_token_logps"),
            is_ratio=sample.get("importance_sampling_ratio") if self.objective.is_correction else None,
            proxy_logp=sample.get("lp_reg_proxy_logp"),
            rewards=sample.get("sequence_rewards"),
        )
        self.objective = step_objective(self.objective, t)
        stage_masks = None
        if "lopti_stage1_mask" in sample:
            stage_masks = (sample["lopti_stage1_mask"], sample["lopti_stage2_mask"])
        step = t.state.global_step
        with self._quiet():  # the analyses' own forwards are not training passes
            frames, full = analyze_update(
                model,
                batch,
                step=step,
                edges=self.edges,
                options=self.options,
                objective=self.objective,
                stage_masks=stage_masks,
                lopti_order=self.order,
                tokenizer=getattr(t, "processing_class", None),
                precision_state=self.precision,
                # (the comparison's Lopti: its first stage from the influence matrix's sources)
                first_stage=(self._compare_eta(), "low_first")
                if "lopti" in self.config.compare_rules
                else None,
            )
            if self.spikes is not None:
                found = self.spikes.observe(model, batch, step=step, rollout=self._rollout(), frames=frames,
                                            objective=self.objective, edges=self.edges,
                                            tokenizer=getattr(t, "processing_class", None))  # fmt: skip
                if found is not None:
                    frames["spikes"] = found
            if self.config.compare_rules:
                frames["paired"], results = paired_comparison(self, model, batch, sample, step, full)
                if "token_view" in frames:
                    named = {key: r for key, r in results.items() if r.sweep is None}  # sweep points apart
                    frames["token_view_rules"] = token_rules_frame(named, frames["token_view"])
            if "real_change" in self.analyses:
                view = frames.pop("token_view", None)  # written with its real dpi, after the optimizer step
                self._pending_real = (completion_probs(model, batch), batch, step, view)
            if stage_masks is not None and self.options.shares:
                if batch.old_logp is None:  # on-policy: fix pi_old now, it stays the rollout's for stage 2
                    batch, _ = fix_pi_old(model, batch)
                frames["shares"] = pl.concat([frames["shares"], self._stage_shares(batch, stage_masks[0], 1)])
                self._pending_stage2 = (batch, stage_masks[1])
        self._write(frames)

    def _compare_eta(self) -> float:
        """Lopti's eta in the paired comparison: the run's, else the paper's 0.5."""
        return getattr(self.trainer.args, "lopti_eta", None) or 0.5

    def _stage2_start(self) -> int:
        """Micro-step (modulo the rollout period) at which Lopti's stage 2 begins."""
        return self.trainer.args.steps_per_generation * self.trainer.passes_per_stage

    def _stage_shares(self, batch, mask, stage: int):
        """`shares` rows of one Lopti stage (stage "low"/"high") at the current parameters."""
        t = self.trainer
        return stage_shares_frame(
            t.accelerator.unwrap_model(t.model),
            batch,
            mask,
            step=t.state.global_step,
            stage=stage_name(stage, self.order),
            edges=self.edges,
            method=self.options.share_method,
            objective=self.objective,
        )

    def _stage2_shares(self) -> None:
        batch, mask = self._pending_stage2
        self._pending_stage2 = None
        with self._quiet():
            frame = self._stage_shares(batch, mask, 2)
        self._write({"shares": frame})

    def on_step_end(self, args, state, control, **kwargs):
        """After the rollout batch's last optimizer step: the real probability change of the sample."""
        if self._pending_real is None or self._in_rollout():
            return
        pi_before, batch, step, view = self._pending_real
        self._pending_real = None
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        with self._quiet():
            delta = real_change(pi_before, model, batch)
            frames = {
                "prob_change": real_change_frame(
                    pi_before, model, batch, step=step, edges=self.edges, delta=delta
                )
            }
            if view is not None:
                frames["token_view"] = with_real_change(view, delta)
        self._write(frames)

    @contextmanager
    def _quiet(self):
        """The probe's hooks off: a forward / backward that is not a training pass (the analyses', the floor's)."""
        self.probe.enabled = False
        try:
            yield
        finally:
            self.probe.enabled = True

    def due(self) -> bool:
        """Whether the current optimizer step is probed: it updates on a probed rollout (every ``probe_every``-th,
        and the one after a spike), so every step of that rollout is, both Lopti stages included."""
        t = self.trainer
        if probed_rollout(t.state.global_step, self.every, self._per_rollout()):
            return True
        return self.spikes is not None and self.spikes.extra(self._rollout())  # (the rollout after a spike)

    def _per_rollout(self) -> int:
        t = self.trainer
        stages = t.num_iterations // t.passes_per_stage  # 2 with Lopti (or random halves), else 1
        return steps_per_rollout(
            t.args.steps_per_generation, t.passes_per_stage, t.args.gradient_accumulation_steps, stages
        )

    def _rollout(self) -> int:
        return rollout_of(self.trainer.state.global_step, self._per_rollout())

    def begin(self, inputs: dict, stage: int) -> None:
        if not self.due() or not self.trainer.model.training:
            return
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        step, stage_label = self.trainer.state.global_step, stage_name(stage, self.order)
        micro = self._micro[(step, stage_label)] = self._micro.get((step, stage_label), -1) + 1
        rank = self.trainer.accelerator.process_index
        self.sampler.begin(inputs, step, stage_label, micro, rank)
        self.probe.begin_step(
            step,
            stage_label,
            completion_mask=mask,
            advantages=inputs["advantages"],
            old_logp=inputs.get("old_per_token_logps"),
            completion_ids=inputs["completion_ids"],
            temperature=self.trainer.temperature,
        )
        self._open = True

    def end(self) -> None:
        if self._open:
            self._open = False
            result = self.probe.end_step()
            # the loss's forward (float64 of the model's log-probs) for the sampler / floor rows waiting on it
            self.sampler.end(None if result is None else torch.log(result.pi))

    def close(self) -> None:
        """End the last probed micro-batch (its backward has run), then detach and write every record. A probed
        rollout whose last optimizer step never came (max_steps inside it) has no real change to read: its token
        view is written with dpi_real null, not lost."""
        self.end()
        if self._pending_real is not None:
            view = self._pending_real[3]
            self._pending_real = None
            if view is not None:
                self._write({"token_view": view})
        self.probe.detach()
        self.writer.flush()

    def on_train_end(self, args, state, control, **kwargs):
        self.close()
