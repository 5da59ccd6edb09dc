"""Warm start of the embedded default policy: a tokenizer and a small Qwen2 trained from
scratch, by supervised fine-tuning on generated K&K prompts with varied reference completions.

Training puzzles come from seeds other than the official 1234, with every puzzle whose
statement structure equals a held-out (evaluation) puzzle's removed.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..policy import EOS
from .warmstart_presets import (
    DEFAULT_CPU_PRESET,
    PRESETS,
    WarmstartPreset,
    canonical_preset,
    check_preset,
    eval_sizes,
)
from .warmstart_report import (
    CHECK_SLICE,
    TARGETS,
    _threads,
    _versions,
    check_slice,
    check_targets,
    target_values,
    with_seed_checks,
)

# the recipes (`tokendyn.trainers.warmstart_presets`) and the report's checks (`tokendyn.trainers.warmstart_report`),
# re-exported
__all__ = [
    "DEFAULT_CPU_PRESET",
    "PRESETS",
    "WarmstartPreset",
    "canonical_preset",
    "check_preset",
    "eval_sizes",
    "CHECK_SLICE",
    "TARGETS",
    "check_slice",
    "check_targets",
    "target_values",
    "with_seed_checks",
]


def _lr_at(step: int, total: int, base: float, warmup_frac: float, hold_frac: float = 0.6) -> float:
    """Linear warm-up, ``base`` held until ``hold_frac`` of the steps, then cosine decay to 10%."""
    warm = max(1, int(total * warmup_frac))
    hold = max(warm, int(total * hold_frac))
    if step < warm:
        return base * (step + 1) / warm
    if step < hold:
        return base
    t = (step - hold) / max(1, total - hold)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _with_pool_names(p, pool: list[str], rng) -> object:
    """The same puzzle (statements, solution) told with names drawn from ``pool`` and fresh templates."""
    from ..tasks.kk.render import TEMPLATES, Puzzle, quiz_text

    idx = rng.choice(len(pool), size=p.people, replace=False)
    names = [pool[int(i)] for i in idx]
    templates = [int(t) for t in rng.integers(0, len(TEMPLATES), p.people)]
    return Puzzle(p.index, p.statements, p.solution, names, quiz_text(p.statements, names, templates))


@dataclass
class _Pool:
    by_size: dict[int, list] = field(default_factory=dict)


def _training_pool(preset: WarmstartPreset, seed: int) -> _Pool:
    from ..tasks.kk.datasets import fresh_puzzles

    # one stream per (seed, size), never the official seed 1234
    return _Pool(
        {n: fresh_puzzles(n, 100_000 + 1_000 * seed + n, preset.puzzles_per_size) for n in preset.people}
    )


def train_policy(
    preset_name: str,
    seed: int = 0,
    threads: int | None = None,
    progress: bool = True,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 100,
    device: str | None = None,
):
    """Train a fresh tokenizer and model on generated K&K data; returns (model, tokenizer, stats). With
    ``checkpoint_dir``, the policy is also saved there every ``checkpoint_every`` steps (a long run on a shared
    machine leaves a usable policy if it is stopped). ``device``: where to train (`resolve_device`)."""
    import numpy as np
    import torch

    from ..policy import build_model, train_tokenizer
    from ..tasks.kk.prompts import SYSTEM_BLOCK, render_prompt
    from .completions import completion

    preset = check_preset(preset_name)
    preset_name = canonical_preset(preset_name)
    if threads:
        torch.set_num_threads(threads)
    cpu0 = time.process_time()  # CPU seconds of this process: the honest cost on a shared machine
    rng = random.Random(seed)
    pool = _training_pool(preset, seed)
    corpus = [
        render_prompt(p.quiz) + completion(p, rng, preset.reasoning) + EOS
        for n in preset.people
        for p in pool.by_size[n][: preset.tokenizer_corpus]
    ]
    tokenizer = train_tokenizer(corpus, preset.model.vocab_size, SYSTEM_BLOCK)
    model = build_model(preset.model, tokenizer, seed).to(resolve_device(device, preset_name))
    copy_stats = _copy_phase(model, tokenizer, preset, seed, progress)
    opt = torch.optim.AdamW(
        model.parameters(), lr=preset.lr, betas=(0.9, 0.95), weight_decay=preset.weight_decay
    )
    sizes, weights = list(preset.people), np.asarray(preset.people_weights) / sum(preset.people_weights)
    np_rng = np.random.default_rng(seed)
    tokens_trained = 0
    losses = []
    model.train()
    bar = _progress(progress, preset.steps, f"warm start ({preset_name})")
    t_train = time.time()
    from ..tasks.kk.render import COMMON_NAMES

    name_pool = [
        COMMON_NAMES[int(i)] for i in np_rng.choice(len(COMMON_NAMES), preset.name_pool, replace=False)
    ]
    pool_steps = int(preset.steps * preset.name_pool_frac) if preset.name_pool else 0
    for step in range(preset.steps):
        n = int(np_rng.choice(sizes, p=weights))
        batch = [pool.by_size[n][int(i)] for i in np_rng.integers(0, len(pool.by_size[n]), preset.batch_size)]
        if step < pool_steps:
            batch = [_with_pool_names(p, name_pool, np_rng) for p in batch]
        ids, attn, labels = _sft_batch(
            tokenizer,
            [render_prompt(p.quiz) for p in batch],
            [completion(p, rng, preset.reasoning) + EOS for p in batch],
            model.device,
        )
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, preset.steps, preset.lr, preset.warmup_frac)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens_trained += int(attn.sum())
        losses.append(loss.item())
        bar.update(loss=losses[-1])
        if checkpoint_dir is not None and (step + 1) % checkpoint_every == 0:
            _checkpoint(model, tokenizer, checkpoint_dir, preset_name, seed, step + 1, losses)
        if not progress and (step + 1) % 50 == 0:
            print(
                f"step {step + 1}/{preset.steps} loss {np.mean(losses[-50:]):.4f} "
                f"{time.time() - t_train:.0f}s",
                flush=True,
            )
    bar.close()
    model.eval()
    stats = {
        "train_cpu_s": round(time.process_time() - cpu0, 1),
        "copy_phase": copy_stats,
        "tokens_trained": tokens_trained,
        "final_loss_mean_last_50": float(np.mean(losses[-50:])),
        "train_wall_s": round(time.time() - t_train, 1),
        "loss_curve": losses[:: max(1, len(losses) // 50)],
    }
    return model, tokenizer, stats


def _checkpoint(
    model, tokenizer, out: str | Path, preset_name: str, seed: int, step: int, losses: list
) -> None:
    from ..policy import save_policy

    padding = tokenizer.padding_side
    tokenizer.padding_side = "left"
    meta = {
        "preset": preset_name,
        "seed": seed,
        "step": step,
        "loss_last_50": sum(losses[-50:]) / len(losses[-50:]),
    }
    save_policy(model, tokenizer, out, meta)
    tokenizer.padding_side = padding
    model.train()


COPY_WORDS = ("knight", "knave", "is", "a", "not", "and", "or", "If", "then", "claims", "says", "so")


def _copy_phase(model, tokenizer, preset: WarmstartPreset, seed: int, progress: bool) -> dict:
    """Phase 1: learn content-based copying on "w1 ... wL | w1 ... wL" (loss on the repeat), words drawn from
    the puzzle names and role words. Its own AdamW, warm-up then constant lr."""
    import numpy as np
    import torch

    from ..tasks.kk.render import COMMON_NAMES

    if not preset.copy_steps:
        return {"steps": 0}
    words = list(COMMON_NAMES) + list(COPY_WORDS)
    rng = random.Random(10_000 + seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=preset.lr, betas=(0.9, 0.95), weight_decay=preset.weight_decay
    )
    losses, t0 = [], time.time()
    model.train()
    for step in range(preset.copy_steps):
        seqs = [
            " " + " ".join(rng.choice(words) for _ in range(rng.randint(10, 30)))
            for _ in range(preset.batch_size)
        ]
        ids, attn, labels = _sft_batch(tokenizer, [s + " |" for s in seqs], seqs, model.device)
        for g in opt.param_groups:
            g["lr"] = preset.lr * min(1.0, (step + 1) / 50)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if not progress and (step + 1) % 100 == 0:
            print(f"copy step {step + 1}/{preset.copy_steps} loss {np.mean(losses[-100:]):.4f}", flush=True)
    return {
        "steps": preset.copy_steps,
        "final_loss_mean_last_50": float(np.mean(losses[-50:])),
        "wall_s": round(time.time() - t0, 1),
    }


def resolve_device(device: str | None, preset_name: str = "cpu") -> str:
    """Where to train: ``device`` itself ("cpu", "cuda", "cuda:N"), checked; None or "auto": CUDA for the gpu preset
    when there is a CUDA device, else the CPU (the CPU presets stay on the CPU, so they reproduce their
    warmstart.json wherever they run)."""
    import re

    import torch

    if device in (None, "auto"):
        return "cuda" if preset_name == "gpu" and torch.cuda.is_available() else "cpu"
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"device: must be auto, cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} asked for, but torch sees no CUDA device (use auto or cpu)")
    return device


def _sft_batch(tokenizer, prompts: list[str], completions: list[str], device="cpu"):
    """Right-padded ids, attention mask, and labels that score completion tokens only (on ``device``)."""
    import torch

    p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    seqs = [a + b for a, b in zip(p_ids, c_ids, strict=True)]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    labels = torch.full((len(seqs), width), -100)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, (a, s) in enumerate(zip(p_ids, seqs, strict=True)):
        ids[r, : len(s)] = torch.tensor(s)
        attn[r, : len(s)] = 1
        labels[r, len(a) : len(s)] = torch.tensor(s[len(a) :])
    return ids.to(device), attn.to(device), labels.to(device)


def warmstart(
    preset_name: str,
    out_dir: str | Path,
    seed: int = 0,
    threads: int | None = None,
    progress: bool = True,
    device: str | None = None,
) -> dict:
    """Train, save (``save_pretrained``), reload, evaluate; write ``warmstart.json``; return it. ``device``:
    where to train and evaluate (`resolve_device`: auto puts the gpu preset on CUDA when there is one)."""
    import numpy as np

    from ..common import write_json
    from ..policy import load_policy, save_policy
    from .evaluate import PAPER_BINS, bin_shares, evaluate

    preset = check_preset(preset_name)
    preset_name = canonical_preset(preset_name)
    out = Path(out_dir)
    t0 = time.time()
    model, tokenizer, train_stats = train_policy(
        preset_name,
        seed,
        threads,
        progress,
        checkpoint_dir=out / "checkpoint" if preset_name != "tiny" else None,
        device=device,
    )
    if (out / "checkpoint").is_dir():
        import shutil

        shutil.rmtree(out / "checkpoint")
    n_params = sum(p.numel() for p in model.parameters())
    tokenizer.padding_side = "left"
    meta = {"preset": preset_name, "seed": seed, "architecture": asdict(preset.model)}
    save_policy(model, tokenizer, out, meta)
    model, tokenizer = load_policy(out)  # evaluate exactly what was saved
    model = model.to(resolve_device(device, preset_name))
    sizes = eval_sizes(preset)
    results = evaluate(model, tokenizer, sizes, n=preset.eval_n, seed=seed)
    sampled = [r for r in results if r.mode != "greedy"]
    probs3 = [p for r in sampled if r.people == min(sizes) for p in r.token_probs]
    probs_all = [p for r in sampled for p in r.token_probs]
    report = {
        "preset": preset_name,
        "seed": seed,
        "parameters": n_params,
        "vocab_size": len(tokenizer),
        "architecture": asdict(preset.model),
        "training": {
            "steps": preset.steps,
            "batch_size": preset.batch_size,
            "lr": preset.lr,
            "people": list(preset.people),
            "people_weights": list(preset.people_weights),
            "puzzles_per_size": preset.puzzles_per_size,
            **train_stats,
        },
        "wall_time_s": round(time.time() - t0, 1),
        "threads": _threads(),
        "evaluation": [r.row() for r in results],
        "bins": list(PAPER_BINS),
        "bin_shares_T0.7": {
            f"people_{min(sizes)}": bin_shares(probs3),
            "all_people": bin_shares(probs_all),
        },
        "tokens_below_0.5_T0.7": {
            f"people_{min(sizes)}": float(np.mean(np.asarray(probs3) < 0.5)) if probs3 else 0.0,
            "all_people": float(np.mean(np.asarray(probs_all) < 0.5)) if probs_all else 0.0,
        },
        "check_slice": check_slice(model, tokenizer),
        "eval_puzzles": "official test split (seed 1234, stream positions 1000..1099), first eval_n per size",
        "versions": _versions(),
    }
    report["targets"] = check_targets(target_values(report, out))
    write_json(out / "warmstart.json", report)
    return report


class _progress:
    """A rich progress bar (or nothing)."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.bar = None
        if enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("loss {task.fields[loss]:.3f}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
            )
            self.task = self.bar.add_task(label, total=total, loss=float("nan"))
            self.bar.start()

    def update(self, **fields) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, **fields)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
