"""What a warm start's report holds beside its evaluation (`tokendyn.trainers.warmstart`): the check slice, the
machine it trained on, and the embedded default's targets with each seed's table."""

from __future__ import annotations

import platform
from pathlib import Path

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


# the embedded default's targets (a default policy closer to an LLM), checked on its own measurements
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
