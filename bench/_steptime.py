"""Shared by the benchmarks: train the embedded default for a few rollouts with some config fields
set and time each phase; run in a fresh process per variant so peak memory is that variant's.

    python bench/_steptime.py '{"lopti_eta": 0.5}' --rollouts 3   # prints one JSON line
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure(extra: dict, rollouts: int, people: list[int], max_completion_length: int) -> dict:
    import torch
    from transformers import TrainerCallback

    from tokendyn.policy import load_policy
    from tokendyn.tasks.kk.reward import kk_reward
    from tokendyn.trainers.config import TokendynGRPOConfig
    from tokendyn.trainers.grpo import TokendynGRPOTrainer
    from tokendyn.trainers.runner import (
        EMBEDDED_DEFAULTS,
        RunArguments,
        build_datasets,
        optimizer_steps_per_rollout,
    )

    torch.manual_seed(0)
    model, tok = load_policy()
    out = tempfile.mkdtemp(prefix="tokendyn-bench-")
    kw = dict(EMBEDDED_DEFAULTS)
    kw.update(
        output_dir=out,
        use_cpu=True,
        max_completion_length=max_completion_length,
        disable_tqdm=True,
        logging_steps=10**6,
        save_strategy="no",  # the defaults checkpoint every 5 rollouts: not part of a step's cost
    )
    kw.update(extra)
    cfg = TokendynGRPOConfig(**kw)
    per = optimizer_steps_per_rollout(cfg)
    cfg.max_steps = (rollouts + 1) * per  # the first rollout is warm-up
    trainer = TokendynGRPOTrainer(
        model=model,
        processing_class=tok,
        reward_funcs=[kk_reward],
        args=cfg,
        train_dataset=build_datasets(RunArguments(people=people)),
    )
    gen_times: list[float] = []
    step_times: list[float] = []
    original = trainer._generate_and_score_completions

    def timed(inputs):
        t = time.perf_counter()
        result = original(inputs)
        gen_times.append(time.perf_counter() - t)
        return result

    trainer._generate_and_score_completions = timed

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            step_times.append(time.perf_counter() - self.t)

    trainer.add_callback(StepClock())
    trainer.train()
    whole = [sum(step_times[i * per : (i + 1) * per]) for i in range(1, rollouts + 1)]
    update = [w - g for w, g in zip(whole, gen_times[1 : rollouts + 1], strict=True)]
    records = Path(out) / "records"
    record_bytes = sum(f.stat().st_size for f in records.glob("*.parquet")) if records.is_dir() else 0
    probed_steps = cfg.max_steps // extra.get("probe_every", 1) if extra.get("probe_every") else 0
    return {
        "whole": statistics.median(whole),
        "update": statistics.median(update),
        "rollout": statistics.median(gen_times[1 : rollouts + 1]),
        "optimizer_steps_per_rollout": per,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "record_bytes": record_bytes,
        "probed_steps": probed_steps,
    }


def run_variant(extra: dict, rollouts: int, people: list[int], max_completion_length: int = 160) -> dict:
    """``measure`` in a fresh Python process (isolated peak memory)."""
    cmd = [
        sys.executable,
        __file__,
        json.dumps(extra),
        "--rollouts",
        str(rollouts),
        "--people",
        *map(str, people),
        "--max_completion_length",
        str(max_completion_length),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("extra")
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--people", type=int, nargs="+", default=[3])
    ap.add_argument("--max_completion_length", type=int, default=160)
    a = ap.parse_args()
    print(json.dumps(measure(json.loads(a.extra), a.rollouts, a.people, a.max_completion_length)))
