"""Warm start of the embedded default policy: a tokenizer and a small Qwen2 trained from
scratch, by supervised fine-tuning on generated K&K prompts with varied reference completions.

Training puzzles come from seeds other than the official 1234, with every puzzle whose
statement structure equals a held-out (evaluation) puzzle's removed.
"""

from __future__ import annotations

import math
import platform
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..policy import EOS, ModelPreset


@dataclass(frozen=True)
class WarmstartPreset:
    model: ModelPreset
    people: tuple[int, ...]
    people_weights: tuple[float, ...]
    steps: int
    batch_size: int
    lr: float
    puzzles_per_size: int
    eval_n: int
    warmup_frac: float = 0.05
    # curriculum: the first name_pool_frac of the steps draw every puzzle's names from a small pool
    # (name_pool names), which makes name copying (what a from-scratch policy learns last) emerge early
    name_pool: int = 0
    name_pool_frac: float = 0.0
    # phase 1: copy_steps of repeating random word sequences, where content-based copying (an induction
    # circuit) forms in a few hundred steps; K&K needs it to copy the puzzle's names (measured: without this
    # phase, 8M tokens of K&K alone never learned to copy names)
    copy_steps: int = 0
    weight_decay: float = 0.01
    tokenizer_corpus: int = 300  # puzzles per size used to train the BPE
    reasoning: str = "v1"  # reference reasoning style (trainers.completions.STYLES)


PRESETS: dict[str, WarmstartPreset] = {
    # seconds: for tests (trains, saves, reloads and generates; learns little)
    "tiny": WarmstartPreset(
        model=ModelPreset(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
        ),
        people=(3,),
        people_weights=(1.0,),
        steps=6,
        batch_size=4,
        lr=3e-3,
        puzzles_per_size=40,
        copy_steps=2,
        eval_n=4,
        tokenizer_corpus=40,
    ),
    # the first embedded default (v1): conclusions about 1-3 people, 1,200 steps (docs/warmstart_v1/seed0.json)
    "cpu_v1": WarmstartPreset(
        model=ModelPreset(
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=512,
        ),
        people=(3, 4, 5, 6, 7),
        people_weights=(0.4, 0.25, 0.15, 0.1, 0.1),
        steps=1200,
        batch_size=32,
        lr=2e-3,
        puzzles_per_size=5000,
        eval_n=100,
        copy_steps=600,
    ),
    # one modern GPU: a wider, deeper model trained longer
    "gpu": WarmstartPreset(
        model=ModelPreset(
            hidden_size=512,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=1536,
        ),
        people=(3, 4, 5, 6, 7),
        people_weights=(0.2, 0.2, 0.2, 0.2, 0.2),
        steps=20000,
        batch_size=64,
        lr=6e-4,
        puzzles_per_size=50000,
        copy_steps=2000,
        eval_n=100,
    ),
}


# second version (docs/warmstart_v2/): reasoning about 2..N people in varied orders with varied openers, a
# 3-person-heavier mix, 700 steps; closer to an LLM's probability histogram but less accurate (not shipped)
PRESETS["cpu_v2"] = replace(
    PRESETS["cpu_v1"],
    people_weights=(0.5, 0.2, 0.1, 0.1, 0.1),
    steps=700,
    puzzles_per_size=10000,
    copy_steps=500,
    reasoning="v2",
)


# third version: the reasoning restates claims and decides no role before the answer (style v3), 2-person puzzles
# join the mix (the smallest logic first), 3 people weighted most; evaluated on 3..7 people as the others
PRESETS["cpu_v3"] = replace(
    PRESETS["cpu_v1"],
    people=(2, 3, 4, 5, 6, 7),
    people_weights=(0.15, 0.4, 0.2, 0.1, 0.075, 0.075),
    steps=1800,
    puzzles_per_size=10000,
    copy_steps=500,
    reasoning="v3",
)


# fourth version: v3 with interjections (more free choices per token), trained longer
PRESETS["cpu_v4"] = replace(PRESETS["cpu_v3"], steps=2000, reasoning="v4")
# fifth version: twice v4's interjections, trained longer still
PRESETS["cpu_v5"] = replace(PRESETS["cpu_v3"], steps=2400, reasoning="v5")
# sixth version: v5 with more 3-person puzzles in the mix, trained longer (v5's loss was still falling)
PRESETS["cpu_v6"] = replace(PRESETS["cpu_v5"], people_weights=(0.1, 0.5, 0.15, 0.1, 0.075, 0.075), steps=2750)
# seventh version: v6's data on a deeper model (6 layers: 1.6 M parameters), for the logic the answer needs
PRESETS["cpu_v7"] = replace(
    PRESETS["cpu_v6"], model=replace(PRESETS["cpu_v6"].model, num_hidden_layers=6), steps=1900
)

# eighth version: v6's mix and steps, interjections ending in ".", "!" or "..." (reasoning style v6): the token after
# an interjection becomes a free choice too
PRESETS["cpu_v8"] = replace(PRESETS["cpu_v6"], reasoning="v6")
# the embedded default (shipped in tokendyn/default_policy/: seed 1 of the three trained; warmstart.json there holds its
# numbers and the target table of every seed trained)
DEFAULT_CPU_PRESET = "cpu_v8"
PRESETS["cpu"] = PRESETS[DEFAULT_CPU_PRESET]


def canonical_preset(name: str) -> str:
    """The versioned name of a preset: ``cpu`` is an alias of the current default's version, and records name the
    version (they still name their recipe after the default moves on)."""
    return DEFAULT_CPU_PRESET if name == "cpu" else name


def eval_sizes(preset: WarmstartPreset) -> list[int]:
    """The sizes a warm start is evaluated on: its training sizes from 3 people up (the official test sets)."""
    return [n for n in preset.people if n >= 3] or list(preset.people)


def check_preset(name: str) -> WarmstartPreset:
    if name not in PRESETS:
        raise ValueError(f"preset: must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]


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


CHECK_SLICE = (3, 20)  # the first 20 official 3-person test puzzles, greedy


def check_slice(model, tokenizer) -> dict:
    """Greedy rewards on a fixed slice: recorded in ``warmstart.json``, re-checked by the tests."""
    from ..tasks.kk.datasets import heldout
    from ..tasks.kk.prompts import render_prompt
    from ..tasks.kk.reward import compute_score
    from .evaluate import generate, max_new_tokens_for

    people, n = CHECK_SLICE
    items = list(heldout(people))[:n]
    prompts = [render_prompt(p.quiz) for p in items]
    texts, _ = generate(model, tokenizer, prompts, max_new_tokens_for(people), temperature=None)
    rewards = [
        compute_score(pr + t, p.solution_text_format).total
        for pr, t, p in zip(prompts, texts, items, strict=True)
    ]
    return {"people": people, "n": n, "rewards": rewards, "accuracy": sum(r == 3 for r in rewards) / n}


def _threads() -> dict:
    """The CPU threads torch trained with, the machine's cores, and its load (the machine may be shared)."""
    import os

    import torch

    return {
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
    }


def _versions() -> dict:
    import tokenizers
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


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


# the embedded default's targets (issue "A default policy closer to an LLM"), checked on its own measurements
TARGETS = {
    "accuracy_3ppl_T0.7": (0.25, 0.80),  # official 3-person test puzzles, sampled at T = 0.7
    "tokens_below_0.5_3ppl": (0.20, 1.0),  # share of sampled tokens with pi < 0.5 (3 people, T = 0.7)
    "tokens_in_top_bin_3ppl": (0.0, 0.75),  # share with pi in [.75, 1]
    "format_valid_min": (0.95, 1.0),  # lowest format-valid rate over every evaluated size and mode
    "train_cpu_s": (0.0, 3600.0),  # 30 minutes on 2 cores = 3600 CPU seconds
    "package_mb": (0.0, 8.0),  # size of the saved policy folder
}


def target_values(report: dict, folder: str | Path | None = None) -> dict:
    """The measured value of each target from a warmstart.json's own numbers (and the folder's size)."""
    rows = report["evaluation"]
    acc3 = [r["accuracy"] for r in rows if r["people"] == 3 and r["mode"] != "greedy"]
    shares3 = report["bin_shares_T0.7"].get("people_3")
    values = {
        "accuracy_3ppl_T0.7": acc3[0] if acc3 else None,
        "tokens_below_0.5_3ppl": report["tokens_below_0.5_T0.7"].get("people_3"),
        "tokens_in_top_bin_3ppl": shares3[-1] if shares3 else None,
        "format_valid_min": min(r["format_valid"] for r in rows) if rows else None,
        "train_cpu_s": report["training"].get("train_cpu_s"),
    }
    if folder is not None:
        files = [p for p in Path(folder).iterdir() if p.is_file() and p.name != "warmstart.json"]
        values["package_mb"] = round(sum(p.stat().st_size for p in files) / 1e6, 2)
    return values


def check_targets(values: dict) -> dict:
    """{target: {"value", "range", "met"}} for every target with a measured value."""
    return {
        k: {"value": v, "range": list(TARGETS[k]), "met": TARGETS[k][0] <= v <= TARGETS[k][1]}
        for k, v in values.items()
        if v is not None
    }


def with_seed_checks(report: dict, others: list[dict]) -> dict:
    """``report`` (the shipped seed's warmstart.json) with ``seed_checks``: for it and every other seed's report of
    the same preset, the seed and its target table (`check_targets` of `target_values`; the package size is the
    shipped folder's, the same architecture), so one file says whether the targets hold on every seed trained."""
    for r in others:
        if r["preset"] != report["preset"]:
            raise ValueError(f"others: preset {r['preset']!r} differs from the shipped {report['preset']!r}")
    checks = [{"seed": report["seed"], "targets": report["targets"]}]
    for r in sorted(others, key=lambda r: r["seed"]):
        values = target_values(r)
        values["package_mb"] = report["targets"]["package_mb"]["value"]
        checks.append({"seed": r["seed"], "targets": check_targets(values)})
    return {**report, "seed_checks": checks}
