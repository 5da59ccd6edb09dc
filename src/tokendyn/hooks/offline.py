"""The offline probe: the training records of one rollout batch from any RL stack, without training.

`probe_rollouts(model, tokenizer, rollouts, run_dir)` mirrors `tokendyn.hooks.trainer.TrainerProbe` on a batch
read from a rollouts file (`tokendyn.hooks.rollouts`):

1. micro-batches of ``batch_size`` rows, padded as TRL pads them (prompts left, completions right; rows keep the
   padding they were given; position ids from the masks, as the sampler had them: `positions_from_masks`), each
   run through one forward and one backward of the token-mean loss

       L = sum_t m_t l_t / N,   l_t = the clipped policy-gradient term (+ beta k3) of `tokendyn.probe.tokenloss`

   with N = the scored tokens of the whole file (so the micro-batch gradients add up to the gradient of the file's
   token mean, as one TRL step over the batch), under a `GradientProbe` (step 0, stage "train"); pi_old is the
   file's old_logp, else the model's own pi (on-policy). Only activation gradients are computed (parameters are
   frozen for the pass, the embedding output carries the gradient): the probed gradients are those of the full
   backward, no parameter gradient is written;
2. the rebalancing analyses (`tokendyn.effects.rebalance.analyze_batch`) on the first ``sample_sequences`` rows that
   carry a signal (some scored token with A != 0, `tokendyn.probe.batch.signal_rows`: the rows the trainer's probe
   analyses, `tokendyn.hooks.trainer.TrainerProbe.rollout`), fewer when the file has fewer (the `ProbeConfig`'s
   analyses, less ``real_change``: no update is made here); a file with no such row gets one ``notes`` record and no
   analyses (a row without an advantage moves nothing: an analysis of it would measure rounding);
3. everything is written to a staging folder beside RUN_DIR, renamed onto RUN_DIR at the end: RUN_DIR (absent or
   empty before) gets records/ and run.json all at once, or nothing.

The model is left as it was (parameters, requires_grad flags, .grad, train/eval mode).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from tokendyn.common import write_json
from tokendyn.config import ProbeConfig
from tokendyn.config import resolve as resolve_config
from tokendyn.effects.precision import MeasuredPrecision
from tokendyn.effects.rebalance import analyze_update
from tokendyn.effects.shares import jvp_attention
from tokendyn.hooks.model_fit import POSITIONS, check_fits, model_limits, positions_from_masks
from tokendyn.hooks.offline_records import no_signal_note, offline_sampler_frame, signal_sample, versions
from tokendyn.hooks.options import rebalance_options
from tokendyn.hooks.rollouts import Rollouts, read_rollouts
from tokendyn.probe.probe import GradientProbe
from tokendyn.probe.tokenloss import Objective, ProbeBatch, eval_mode, token_loss
from tokendyn.records import RecordWriter, write_frames
from tokendyn.vocab import TRAIN

METHOD = "offline probe"


def check_run_dir(run_dir: str | os.PathLike) -> Path:
    """RUN_DIR must be absent or an empty directory in a writable place (the probe never mixes runs)."""
    from tokendyn.common import check_writable

    path = Path(run_dir)
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"out: {str(path)!r} exists and is not a directory")
        if any(path.iterdir()):
            raise ValueError(f"out: {str(path)!r} is not empty; give a new (or empty) run directory")
    check_writable(path, "out")
    return path


def resolve_temperature(rollouts: Rollouts, temperature: float | None) -> float:
    """The file's temperature column, else ``temperature``, else 1.0; a conflict between the two is an error."""
    file_t = rollouts.temperature
    if temperature is not None:
        t = float(temperature)
        if not t > 0:
            raise ValueError(f"temperature: must be > 0, got {temperature!r}")
        if file_t is not None and abs(file_t - t) > 1e-12 * max(1.0, t):
            raise ValueError(
                f"temperature: the rollouts file says {file_t:g} (column 'temperature') but {t:g} was given; "
                "drop one of them"
            )
        return t
    return 1.0 if file_t is None else file_t


@dataclass
class OfflineResult:
    """What `probe_rollouts` wrote."""

    run_dir: Path
    files: list[Path]
    rows: int
    tokens: int
    micro_batches: int
    analysed_rows: int


@contextlib.contextmanager
def _activation_grads_only(model: nn.Module) -> Iterator[None]:
    """Parameters frozen and the embedding output made to require grad: a backward then computes every activation
    gradient (the same values as a full backward) and no parameter gradient. Flags restored on exit."""
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    embed = model.get_input_embeddings()

    def need_grad(module, args, output):
        return output.requires_grad_(True)

    handle = embed.register_forward_hook(need_grad)
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        handle.remove()
        for p, f in zip(params, flags, strict=True):
            p.requires_grad_(f)


def _probe_batch(b: dict, temperature: float, normalizer: float | None) -> ProbeBatch:
    return ProbeBatch(
        input_ids=torch.cat([b["prompt_ids"], b["completion_ids"]], dim=1),
        attention_mask=torch.cat([b["prompt_mask"], b["completion_mask"]], dim=1),
        completion_mask=b["loss_mask"],
        advantages=b["advantages"],
        old_logp=b.get("old_per_token_logps"),
        ref_logp=b.get("ref_per_token_logps"),
        sampling_logp=b.get("sampling_per_token_logps"),
        temperature=temperature,
        normalizer=normalizer,
    )


def _check_ids(rollouts: Rollouts, model: nn.Module) -> None:
    config = getattr(model, "config", None)
    embeddings = model.get_input_embeddings().num_embeddings
    if config is None:
        check_fits(rollouts, embeddings, None)
    else:
        check_fits(rollouts, *model_limits(config, embeddings))


def _progress(enabled: bool):
    if not enabled:
        return contextlib.nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )


def probe_rollouts(
    model: nn.Module,
    tokenizer,
    rollouts: Rollouts | str | os.PathLike,
    run_dir: str | os.PathLike,
    config: ProbeConfig | None = None,
    *,
    temperature: float | None = None,
    batch_size: int = 16,
    objective: Objective | None = None,
    seed: int = 0,
    progress: bool = False,
    meta: dict | None = None,
    positions: str = "mask",
    **options,
) -> OfflineResult:
    """Probe one rollout batch offline and write the training records to RUN_DIR (see the module docstring).

    rollouts: a validated `Rollouts` or anything `read_rollouts` takes; tokenizer: needed for text rollouts (and
    for the pad id; None: 0). config: the probe's `ProbeConfig` (``**options`` override its fields: points, bins,
    sample_sequences, analyses, lr, lr_sweep, ...). temperature: None = the file's, else 1.0.
    objective: default `Objective(0.2, 0.28)` (TRL's clipped surrogate, beta 0; any TRL loss option: `Objective`).
    meta: extra run.json fields.
    positions: "mask" (position ids from the attention masks, as the sampler had them) or "model" (the model's
    default; TRL's training forward passes none); see `positions_from_masks`.
    Everything is checked before any forward; on any error nothing is written."""
    t0 = time.time()
    rollouts = read_rollouts(rollouts)
    temperature = resolve_temperature(rollouts, temperature)
    cfg = resolve_config(config, options)
    wanted = cfg.active_analyses
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: must be an integer >= 1, got {batch_size!r}")
    if positions not in POSITIONS:
        raise ValueError(f"positions: must be one of {', '.join(POSITIONS)}, got {positions!r}")
    objective = objective or Objective(eps_low=0.2, eps_high=0.28)
    if objective.beta > 0 and rollouts.ref_logp is None:
        raise ValueError(
            f"beta: {objective.beta:g} > 0 needs a 'ref_logp' column (log pi_ref per completion token); "
            "give it or use beta 0"
        )
    run_dir = check_run_dir(run_dir)
    rollouts = rollouts.encode(tokenizer)
    _check_ids(rollouts, model)
    if cfg.compare_rules and cfg.compare_modes == ("optimizer",):
        raise ValueError("compare_modes: an offline probe has no run optimizer; use equal_norm")
    analysing = set(wanted) - {"real_change"} or (cfg.compare_rules and cfg.sample_sequences)
    rows_analysed = signal_sample(rollouts, cfg.sample_sequences) if analysing else []
    n_analysed = len(rows_analysed)
    analyses = rebalance_options(cfg, seed)
    if analyses.token_shares and n_analysed:
        jvp_attention(model)  # raises for attention kernels forward-mode AD cannot go through
    probe = GradientProbe(model, cfg, temperature=temperature, seed=seed, rank=0)
    pad_id = 0
    if tokenizer is not None:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    device = next(model.parameters()).device
    n_tokens = rollouts.n_scored()
    chunks = [range(s, min(s + batch_size, rollouts.n)) for s in range(0, rollouts.n, batch_size)]

    run_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = run_dir.parent / f".{run_dir.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        writer = RecordWriter(staging, rank=0, flush_every=16, flush_seconds=cfg.flush_seconds)
        probe.sink = writer.add
        with _progress(progress) as bar:
            task = bar.add_task("probing micro-batches", total=len(chunks)) if bar is not None else None
            with (
                eval_mode(model, checkpoint=False),
                _activation_grads_only(model),
                positions_from_masks(model, positions),
                probe,
            ):
                for micro, rows in enumerate(chunks):
                    b = rollouts.batch(rows, pad_id, device)
                    batch = _probe_batch(b, temperature, normalizer=float(max(n_tokens, 1)))
                    probe.begin_step(
                        0,
                        TRAIN,
                        completion_mask=batch.completion_mask,
                        advantages=b["advantages"],
                        old_logp=b.get("old_per_token_logps"),
                        completion_ids=b["completion_ids"],
                        temperature=temperature,
                    )
                    loss = token_loss(model, batch, objective)
                    probe.watch_logps(loss.logp)
                    loss.loss.backward()
                    probe.end_step()
                    if (
                        rollouts.sampler_logp is not None
                    ):  # the file's sampler beside pi_old (the column, or pi)
                        own = None if rollouts.old_logp is not None else loss.logp.detach()
                        writer.add({"sampler": offline_sampler_frame(b, batch.completion_mask, micro, own)})
                    if bar is not None:
                        bar.advance(task)
            writer.flush()
            if analysing and not n_analysed:
                write_frames(staging, {"notes": no_signal_note()}, rank=0)
            if n_analysed:
                if bar is not None:
                    bar.update(task, description=f"analyses on {n_analysed} sequences", completed=0, total=1)
                sample = rollouts.batch(rows_analysed, pad_id, device)
                with positions_from_masks(model, positions):
                    _analyse(
                        model,
                        _probe_batch(sample, temperature, None),
                        probe,
                        analyses,
                        objective,
                        staging,
                        cfg,
                        tokenizer,
                    )
        files = [p.relative_to(staging) for p in sorted((staging / "records").glob("*.parquet"))]
        info = {
            "method": METHOD,
            "model": getattr(getattr(model, "config", None), "_name_or_path", None) or type(model).__name__,
            "rollouts": rollouts.source,
            "rows": rollouts.n,
            "tokens": n_tokens,
            "micro_batches": len(chunks),
            "analysed_rows": n_analysed,
            "analysed_row_indices": rows_analysed,
            "advantages": rollouts.advantage_source,
            "pi_old": "old_logp column" if rollouts.old_logp is not None else "on-policy (the model's pi)",
            "sampler": "sampler_logp column" if rollouts.sampler_logp is not None else None,
            "input": "token ids" if rollouts.prompts is None else "text (tokenized here)",
            "ignored_columns": list(rollouts.ignored),
            "probe": cfg.to_dict(),
            "options": {
                "points": probe.point_names,
                "temperature": temperature,
                "batch_size": batch_size,
                "analyses": [a for a in wanted if a != "real_change"],
                "objective": asdict(objective),
                "normalizer": "scored tokens of the whole file",
                "positions": positions,
                "seed": seed,
            },
            "versions": versions(),
            "status": "finished",
            "wall_time_s": round(time.time() - t0, 2),
            **(meta or {}),
        }
        write_json(staging / "run.json", info)
        if run_dir.exists():
            run_dir.rmdir()  # empty (checked above); the rename below puts the whole run in its place
        os.replace(staging, run_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return OfflineResult(run_dir, [run_dir / f for f in files], rollouts.n, n_tokens, len(chunks), n_analysed)


def _analyse(
    model, batch: ProbeBatch, probe: GradientProbe, options, objective, out: Path, cfg, tokenizer=None
) -> None:
    """The rebalancing analyses on the sample, as the trainer runs them on its own (token mean over the sample,
    pi_old fixed once); bins: the probe's fixed edges (quantile bins: the paper's). With ``compare_rules``, the
    paired comparison in equal_norm mode (no run optimizer here)."""
    edges = probe.bins.edges
    edges = list(edges) if edges is not None else None
    frames, full = {}, None
    state = MeasuredPrecision(every=cfg.precision_check_every)
    if cfg.active_analyses:
        frames, full = analyze_update(
            model,
            batch,
            step=0,
            stage=TRAIN,
            edges=edges,
            options=options,
            objective=objective,
            tokenizer=tokenizer,
            precision_state=state,
            first_stage=(0.5, "low_first") if "lopti" in cfg.compare_rules else None,  # (make_rule's Lopti)
        )
    if cfg.compare_rules:
        from tokendyn.effects.axis import axis_rules
        from tokendyn.effects.compare import compare_rules, make_rule, paired_frame
        from tokendyn.effects.shares import as_edges
        from tokendyn.probe.tokenloss import pi_old

        rules = [make_rule(name, objective, seed=options.seed) for name in cfg.compare_rules]
        rules += axis_rules(objective, cfg.compare_c_sweep, cfg.compare_eta_sweep)
        checked = state if cfg.active_analyses else None  # (no analysis: no check, float64 steps)
        with MeasuredPrecision.quiet(checked):  # (model-dtype steps a check agreed to)
            results = compare_rules(
                model,
                batch,
                rules,
                modes=("equal_norm",),
                lr=cfg.comparison_lr,
                full=full,
                precision=MeasuredPrecision.used(cfg.step_precision, checked),
                inner_steps=cfg.compare_inner_steps,
            )
        frames["paired"] = paired_frame(results, batch, pi_old(model, batch), as_edges(edges), step=0)
        if "token_view" in frames:
            from tokendyn.effects.token_view import token_rules_frame

            named = {key: r for key, r in results.items() if r.sweep is None}  # sweep points apart
            frames["token_view_rules"] = token_rules_frame(named, frames["token_view"])
    write_frames(out, frames, rank=0)
