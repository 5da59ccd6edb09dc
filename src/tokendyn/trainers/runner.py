"""One GRPO run on K&K or the arithmetic task: data, reward, trainer, held-out evaluation, and the run directory.

The run directory holds ``run.json`` (full config, versions, seed, model), ``metrics.parquet``
(every logged step: reward, accuracy, Lopti stage fractions, held-out accuracy per N) and, when
the probe is on, ``records/``. Files are written atomically.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict
from pathlib import Path

from ..analysis.schedule import SCHEDULE_KEY, schedule_entry, steps_per_rollout
from ..probe.rules import SURROGATES
from .run_arguments import (  # noqa: F401  (re-exported: the run's flags and their bounds)
    HELDOUT_SIZE,
    MAX_DIGITS,
    MAX_PEOPLE,
    MIN_DIGITS,
    MIN_PEOPLE,
    TASKS,
    TRAIN_SPLITS,
    RunArguments,
)

# GRPOConfig defaults for the embedded default on CPU (the paper's loss settings, sized for minutes)
EMBEDDED_DEFAULTS = dict(
    learning_rate=1e-4,
    lr_scheduler_type="constant",
    per_device_train_batch_size=32,
    num_generations=8,
    steps_per_generation=2,  # 8 prompts x 8 samples per rollout, 2 optimizer steps per rollout (as the paper)
    max_completion_length=264,
    temperature=0.7,
    top_p=1.0,
    top_k=0,
    beta=0.001,
    use_bias_correction_kl=False,  # the paper's plain k3 estimator
    epsilon=0.2,
    epsilon_high=0.24,
    loss_type="dapo",
    max_grad_norm=1.0,
    bf16=False,
    gradient_checkpointing=False,
    logging_steps=1,
    max_steps=30,  # overridden by --rollouts (default 15 rollouts) unless --max_steps is given
    eval_steps=5,  # in rollouts when --rollouts is set
    save_strategy="steps",  # checkpoint-N folders, to resume from (--resume_from_checkpoint) or to evaluate
    save_steps=5,  # in rollouts (checkpoints fall on rollout boundaries)
    save_total_limit=2,  # the last two checkpoints are kept
    report_to="none",
    seed=0,
    disable_dropout=True,
    ddp_find_unused_parameters=False,
    output_dir="runs/grpo",
)


def kk_accuracy(prompts, completions, ground_truth, **_) -> list[float]:
    """1.0 when the official reward is 3 (logged with weight 0: it never changes the advantages)."""
    from ..tasks.kk.reward import MAX_SCORE, score

    return [
        float(score(p, c, g) == MAX_SCORE) for p, c, g in zip(prompts, completions, ground_truth, strict=True)
    ]


LOSS_NAMES = {"cispo": "CISPO", "sapo": "SAPO", "vespo": "VESPO", "luspo": "LUSPO"}


def method_name(cfg) -> str:
    """The run's name in records and figures: the estimator or loss (GRPO, REINFORCE++, GSPO, CISPO, SAPO, VESPO,
    LUSPO), then each remedy on top."""
    loss_type = getattr(cfg, "loss_type", "dapo")
    estimator = getattr(cfg, "advantage_estimator", "grpo")
    if estimator == "w_reinforce":
        base = f"W-REINFORCE(l={getattr(cfg, 'w_reinforce_lambda', 0.1):g})"
    elif estimator != "grpo":
        base = "REINFORCE++"
    elif loss_type in LOSS_NAMES:
        base = LOSS_NAMES[loss_type]
    elif getattr(cfg, "importance_sampling_level", "token") == "sequence":
        base = "GSPO"
    else:
        base = "GRPO"
    parts = [base]
    top = getattr(cfg, "top_entropy_quantile", 1.0)
    if top < 1.0:
        parts.append("80/20" if top == 0.2 else f"top-entropy(q={top:g})")
    policy_loss = getattr(cfg, "policy_loss", "ppo")
    if policy_loss != "ppo":
        parts.append(SURROGATES[policy_loss].title)
    if getattr(cfg, "advantage_reweight_alpha", 0.0):
        parts.append(f"Reweight(a={cfg.advantage_reweight_alpha:g})")
    if getattr(cfg, "logp_reweight_c", 0.0):
        parts.append(f"LogpReweight(c={cfg.logp_reweight_c:g})")
    if getattr(cfg, "lopti_eta", None) is not None:
        order = "" if cfg.lopti_order == "low_first" else ", high first"
        parts.append(f"Lopti(eta={cfg.lopti_eta:g}{order})")
    if getattr(cfg, "lopti_quantile", None) is not None:
        parts.append(f"Lopti(q={cfg.lopti_quantile:g})")
    if getattr(cfg, "random_halves", False):
        parts.append("RandomHalves")
    return " + ".join(parts)


def optimizer_steps_per_rollout(cfg) -> int:
    """Optimizer steps TRL takes on one generation batch (x2 with Lopti's two stages)."""
    lopti = getattr(cfg, "lopti_eta", None) is not None or getattr(cfg, "lopti_quantile", None) is not None
    stages = 2 if lopti or getattr(cfg, "random_halves", False) else 1
    return steps_per_rollout(
        cfg.steps_per_generation, cfg.num_iterations, cfg.gradient_accumulation_steps, stages
    )


def apply_rollouts(run: RunArguments, cfg) -> None:
    """Set ``max_steps`` from ``rollouts`` (``eval_steps`` counts rollouts then). ``save_steps`` always counts
    rollouts: a checkpoint must fall on a rollout boundary (`tokendyn.trainers.resume`)."""
    per = optimizer_steps_per_rollout(cfg)
    if run.rollouts:
        cfg.max_steps = run.rollouts * per
        if cfg.eval_steps:
            cfg.eval_steps = int(cfg.eval_steps) * per
    if str(getattr(cfg.save_strategy, "value", cfg.save_strategy)) == "steps":
        cfg.save_steps = int(cfg.save_steps) * per


def build_datasets(run: RunArguments, tokenizer=None):
    """The training set: K&K puzzles (official or fresh), or with ``task="arith"`` sums of each difficulty of
    ``arith_digits`` (prompts rendered by ``tokenizer``'s chat template)."""
    if run.task == "arith":
        from ..tasks.arith.datasets import arith_dataset

        return arith_dataset(
            run.arith_digits,
            "train",
            seed=run.train_seed,
            count=run.arith_train_problems,
            tokenizer=tokenizer,
        )
    from ..tasks.kk.datasets import kk_dataset

    if run.train_split == "official":
        train = kk_dataset(run.people, "train", count=run.train_puzzles_per_size, template=run.template)
    else:
        train = kk_dataset(
            run.people, "fresh", seed=run.train_seed, count=run.train_puzzles_per_size, template=run.template
        )
    return train


def versions() -> dict:
    import accelerate
    import torch
    import transformers
    import trl

    from tokendyn.version import __version__

    from ..integrations.vllm_cpu import vllm_version

    return {
        "tokendyn": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "accelerate": accelerate.__version__,
        "vllm": vllm_version(),
    }


def earlier_run(out: str | os.PathLike) -> list[str]:
    """What an earlier run left in a run directory (run.json, metrics.parquet, records/, checkpoint-N/)."""
    from ..records import KINDS, shard_files
    from .resume import checkpoints

    out = Path(out)
    found = [f for f in ("run.json", "metrics.parquet") if (out / f).is_file()]
    if any(shard_files(out, kind) for kind in KINDS):
        found.append("records/")
    found += [f"{c.name}/" for c in checkpoints(out)][-1:]
    return found


def prepare(run: RunArguments, cfg) -> Path | None:
    """Everything checked before any work (nothing is created or changed): the checkpoint cadence, the resume
    checkpoint, that a fresh run does not land on an earlier one (its records would be mixed in), and the model
    source. Returns the checkpoint to resume from (None: a fresh run)."""
    from ..policy import check_model_source
    from .resume import ResumeError, check_save_steps, checkpoint_step, resolve_checkpoint

    check_save_steps(cfg)
    resume = resolve_checkpoint(cfg.resume_from_checkpoint, cfg.output_dir)
    if resume is not None:
        max_steps = run.rollouts * optimizer_steps_per_rollout(cfg) if run.rollouts else cfg.max_steps
        step = checkpoint_step(resume)
        if step >= max_steps:  # transformers would run one more step past max_steps
            raise ResumeError(
                f"resume_from_checkpoint: {str(resume)!r} is at step {step}, the run's last ({max_steps} optimizer "
                "steps): nothing to resume; raise --rollouts (or --max_steps) to train further"
            )
    elif found := earlier_run(cfg.output_dir):
        raise ResumeError(
            f"output_dir: {cfg.output_dir!r} holds an earlier run ({', '.join(found)}); continue it with "
            "--resume_from_checkpoint true, or give a new --output_dir (remove the folder to start over)"
        )
    if run.model_name_or_path is not None:
        check_model_source(run.model_name_or_path, "model_name_or_path")
    return resume


def check_lengths(model, tokenizer, prompts: list[str], cfg) -> None:
    """The longest prompt (tokens, cut to ``max_prompt_length`` if set) + ``max_completion_length`` against the
    model's positions: an error for learned absolute positions (the run would fail mid-way), else a warning (a
    rotary model runs past its trained context)."""
    import warnings

    from ..common import UsageError
    from ..hooks.model_fit import absolute_positions, model_limits

    positions = model_limits(model.config)[1]
    if positions is None or not prompts:
        return
    longest = sorted(prompts, key=len)[-32:]  # by characters: the longest in tokens is among them
    prompt = max(len(tokenizer(text=t)["input_ids"]) for t in longest)
    if getattr(cfg, "max_prompt_length", None):
        prompt = min(prompt, int(cfg.max_prompt_length))
    need = prompt + int(cfg.max_completion_length)
    if need <= positions:
        return
    msg = (
        f"max_completion_length: the longest prompt ({prompt} tokens) + max_completion_length "
        f"({cfg.max_completion_length}) = {need} exceeds the model's {positions} positions (max_position_embeddings)"
    )
    if absolute_positions(model):
        raise UsageError(
            f"{msg}; its positions are a learned table: lower --max_completion_length or the puzzle sizes"
        )
    warnings.warn(f"{msg}; it runs (rotary positions), beyond the context it was trained on", stacklevel=2)


def train(
    run: RunArguments, cfg, callbacks=(), progress: bool = True, reward=None, eval_at_start: bool = True
) -> dict:
    """Build the trainer, train (or resume: `tokendyn.trainers.resume`), evaluate; returns a summary (also written
    into ``run.json``). The run directory is created only once the model and the trainer are built. ``reward``: a
    TRL reward function used instead of the task's own (the official K&K reward, or arith's; the task's accuracy is
    still logged). ``eval_at_start=False``: no held-out evaluation at step 0 (a study evaluates its shared starting
    policy once)."""
    import torch

    from ..common import write_json
    from ..policy import MARKER, default_policy_dir, load_policy
    from .callbacks import ArithHeldoutEvalCallback, HeldoutEvalCallback, ParquetLogCallback, use_reward_bar
    from .grpo import TokendynGRPOTrainer
    from .resume import ResumeCallback, checkpoint_step, kept_metrics, truncate_records
    from .sampler import release_sampler

    out = Path(cfg.output_dir)
    resume = prepare(run, cfg)
    apply_rollouts(run, cfg)
    model_path = run.model_name_or_path or str(default_policy_dir())
    model, tok = load_policy(model_path, dtype=torch.float32)
    train_ds = build_datasets(run, tok)
    check_lengths(model, tok, train_ds["prompt"], cfg)
    if run.task == "arith":
        from ..tasks.arith.reward import arith_accuracy, arith_reward

        reward_funcs = [reward or arith_reward, arith_accuracy]
    else:
        from ..tasks.kk.reward import kk_reward

        reward_funcs = [reward or kk_reward, kk_accuracy]

    trainer = TokendynGRPOTrainer(
        model=model,
        processing_class=tok,
        reward_funcs=reward_funcs,
        args=cfg,
        train_dataset=train_ds,
        callbacks=list(callbacks),
    )
    use_reward_bar(trainer, progress and not cfg.disable_tqdm, method_name(cfg))
    trainer.args.reward_weights = None
    trainer.reward_weights = torch.tensor([1.0, 0.0])
    marker = Path(model_path) / MARKER  # keep the tokendyn tokenizer marker (see load_tokenizer)
    trainer.add_callback(ResumeCallback(trainer, marker if marker.is_file() else None, resume))
    rows, meta_before = [], {}
    if resume is not None:
        step = checkpoint_step(resume)
        if trainer.accelerator.is_main_process:  # one process cuts every rank's shards, before any step runs
            truncate_records(out, step)
        rows = kept_metrics(out / "metrics.parquet", step)
        if (out / "run.json").is_file():
            import json

            meta_before = json.loads((out / "run.json").read_text())
    if [r for r in (trainer.args.report_to or []) if r != "none"]:  # the probe's numbers live, as TRL's are
        from ..hooks.live import attach_live_metrics

        attach_live_metrics(trainer)
    accuracy_key = f"rewards/{reward_funcs[1].__name__}/mean"
    logger = ParquetLogCallback(
        out / "metrics.parquet", method=method_name(cfg), rows=rows, accuracy=accuracy_key
    )
    trainer.add_callback(logger)
    done = {r["step"] for r in rows if "heldout/accuracy" in r}
    if run.eval_n and run.task == "arith":
        trainer.add_callback(
            ArithHeldoutEvalCallback(
                trainer,
                run.arith_eval_digits or run.arith_digits,
                run.eval_n,
                cfg.eval_steps,
                cfg,
                done=done,
                at_start=eval_at_start,
            )
        )
    elif run.eval_n:
        trainer.add_callback(
            HeldoutEvalCallback(
                trainer,
                run.eval_people or run.people,
                run.eval_n,
                cfg.eval_steps,
                cfg.temperature,
                run.template,
                done=done,
                at_start=eval_at_start,
            )
        )
    meta = {
        "method": method_name(cfg),
        "model": model_path,
        "seed": cfg.seed,
        "run": asdict(run),
        "config": cfg.to_dict(),
        SCHEDULE_KEY: schedule_entry(cfg.probe_every, optimizer_steps_per_rollout(cfg)),  # probe_every's unit
        "versions": versions(),
        "sampler": trainer.sampler_info,  # which engine sampled, in which dtype
        "status": "running",
    }
    if resume is not None:
        meta["resumed_from"] = [*meta_before.get("resumed_from", []), str(resume)]
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "run.json", meta)
    t0 = time.time()
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    release_sampler(trainer)  # a colocated vLLM engine goes now, not when collected during a later run
    final = out / "final"
    trainer.save_model(str(final))  # the trained policy: `tokendyn eval --model RUN_DIR/final`
    if trainer.accelerator.is_main_process:
        tok.save_pretrained(str(final))
        if marker.is_file():
            (final / MARKER).write_text(marker.read_text())
    meta.update(status="finished", wall_time_s=round(time.time() - t0, 1), summary=logger.summary())
    write_json(out / "run.json", meta)
    return meta
