"""The steps of bench/gpu_check.sh: a shortened warm start of the gpu preset on a device, and short probed GRPO /
+Reweight / +Lopti runs on it (probe off / on / on with the analyses), each variant in its own process.

    python bench/_gpu_run.py warmstart --device cuda --out DIR [--steps 200 --batch 64]
    python bench/_gpu_run.py train --device cuda --policy DIR --method grpo --variant probe --out RUN   # one JSON line
    python bench/_gpu_run.py predict --runs RUNS.jsonl --model bench/memory_model.json
    python bench/_gpu_run.py analyze RUN [--out DIR]     # tokendyn analyze, without importing the figures
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

METHODS = {"grpo": {}, "reweight": {"advantage_reweight_alpha": 0.3}, "lopti": {"lopti_eta": 0.5}}
VARIANTS = {
    "off": {},
    "probe": {"probe_every": 1, "probe_analyses": "none"},
    "analyses": {"probe_every": 1},
}


def warmstart(args) -> None:
    """The gpu preset's architecture and recipe with fewer steps. `tokendyn warmstart` trains on the CPU (it never
    moves the model), so the device is made the default one here."""
    import torch

    from tokendyn.trainers import warmstart as ws

    if args.device != "cpu":
        torch.set_default_device(args.device)
    gpu = ws.PRESETS["gpu"]
    ws.PRESETS["gpu_check"] = dataclasses.replace(
        gpu,
        steps=args.steps,
        copy_steps=args.copy_steps,
        batch_size=args.batch,
        puzzles_per_size=args.puzzles,
        eval_n=args.eval_n,
        tokenizer_corpus=min(gpu.tokenizer_corpus, args.puzzles),
    )
    t = time.time()
    report = ws.warmstart("gpu_check", args.out, seed=0, progress=False)
    print(
        f"warm start (gpu preset, {args.steps} steps of {args.batch}, {args.copy_steps} copy steps) on "
        f"{args.device}: {report['parameters']:,} parameters, vocab {report['vocab_size']}, {time.time() - t:.0f} s"
    )


def train(args) -> None:
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

    cuda = args.device.startswith("cuda")
    torch.manual_seed(0)
    model, tok = load_policy(args.policy)
    kw = dict(EMBEDDED_DEFAULTS)
    kw.update(
        output_dir=args.out,
        use_cpu=not cuda,
        per_device_train_batch_size=args.batch,
        max_completion_length=args.completion,
        disable_tqdm=True,
        logging_steps=10**6,
        save_strategy="no",
        probe_sample_sequences=args.sample,
    )
    kw.update(METHODS[args.method])
    kw.update(VARIANTS[args.variant])
    cfg = TokendynGRPOConfig(**kw)
    per = optimizer_steps_per_rollout(cfg)
    cfg.max_steps = (args.rollouts + 1) * per  # the first rollout is warm-up
    data = build_datasets(RunArguments(people=args.people))
    trainer = TokendynGRPOTrainer(
        model=model, processing_class=tok, reward_funcs=[kk_reward], args=cfg, train_dataset=data
    )
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args_, state, control, **k):
            if cuda:
                torch.cuda.synchronize()
                if state.global_step == per:  # after the warm-up rollout
                    torch.cuda.reset_peak_memory_stats()
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)

    trainer.add_callback(Clock())
    trainer.train()
    whole = [sum(times[i * per : (i + 1) * per]) for i in range(1, args.rollouts + 1)]
    prompt = max(len(tok(row["prompt"])["input_ids"]) for row in data.select(range(min(64, len(data)))))
    n_params = sum(p.numel() for p in model.parameters())
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    print(
        json.dumps(
            {
                "method": args.method,
                "variant": args.variant,
                "rollout_s": statistics.median(whole),
                "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                "n_params": n_params,
                "tied": tied,
                "prompt": prompt,
                "config": {
                    k: getattr(model.config, k)
                    for k in (
                        "num_hidden_layers",
                        "hidden_size",
                        "intermediate_size",
                        "num_attention_heads",
                        "num_key_value_heads",
                        "vocab_size",
                    )
                },
            }
        )
    )


def predict(args) -> None:
    """The memory model's prediction for a run's size (from its JSON line) against the measured peak."""
    import memory as pm

    runs = [json.loads(line) for line in open(args.runs) if line.startswith("{")]
    model = json.load(open(args.model))
    fits = pm.load_fits(model)
    print(
        f"{'method':<9} {'variant':<9} {'rollout s':>10} {'x off':>6} {'peak (measured)':>16} {'predicted':>12}"
    )
    base = {r["method"]: r["rollout_s"] for r in runs if r["variant"] == "off"}
    for r in runs:
        c = r["config"]
        s = pm.Size(
            layers=c["num_hidden_layers"],
            hidden=c["hidden_size"],
            vocab=c["vocab_size"],
            completion=args.completion,
            rows=args.batch,
            sample=args.sample,
            prompt=r["prompt"],
            heads=c["num_attention_heads"],
            kv=c["num_key_value_heads"],
            inter=c["intermediate_size"],
            tied=r["tied"],
        )
        # fp32 parameters, AdamW's two moments and the reference model (beta > 0) live throughout; the step's fit has
        # the gradients. Generation (KV cache) is not modelled: the measured peak is over whole rollouts
        persistent = r["n_params"] * 4 * 4
        pred = persistent + fits["step"].predict(pm.features("step", s))
        if r["variant"] != "off":
            pred += fits["probe"].predict(pm.features("probe", s))
        if r["variant"] == "analyses":
            pred = max(pred, persistent + fits["all"].predict(pm.features("all", s)))
        peak = r["peak_bytes"]
        ratio = r["rollout_s"] / base[r["method"]] if r["method"] in base else float("nan")
        print(
            f"{r['method']:<9} {r['variant']:<9} {r['rollout_s']:>10.2f} {ratio:>6.3f} "
            f"{'n/a (cpu)' if peak is None else pm.gb(peak):>16} {pm.gb(pred):>12}"
        )


def analyze(args) -> None:
    """`tokendyn analyze RUN` without the CLI's other commands (the figures need seaborn, which the GPU check does
    not install)."""
    from tokendyn.analysis import cli

    ap = argparse.ArgumentParser(prog="tokendyn")
    cli.register(ap.add_subparsers(dest="cmd"))
    ns = ap.parse_args(["analyze", *args.rest])
    raise SystemExit(cli.run(ns))


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("warmstart")
    w.add_argument("--device", default="cuda")
    w.add_argument("--out", required=True)
    w.add_argument("--steps", type=int, default=200)
    w.add_argument("--copy_steps", type=int, default=50)
    w.add_argument("--batch", type=int, default=64)
    w.add_argument("--puzzles", type=int, default=2000)
    w.add_argument("--eval_n", type=int, default=20)
    t = sub.add_parser("train")
    t.add_argument("--device", default="cuda")
    t.add_argument("--policy", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--method", choices=sorted(METHODS), default="grpo")
    t.add_argument("--variant", choices=sorted(VARIANTS), default="probe")
    t.add_argument("--rollouts", type=int, default=2)
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--completion", type=int, default=256)
    t.add_argument("--sample", type=int, default=8)
    t.add_argument("--people", type=int, nargs="+", default=[3])
    p = sub.add_parser("predict")
    p.add_argument("--runs", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--completion", type=int, default=256)
    p.add_argument("--sample", type=int, default=8)
    a = sub.add_parser("analyze")
    a.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    {"warmstart": warmstart, "train": train, "predict": predict, "analyze": analyze}[args.cmd](args)


if __name__ == "__main__":
    main()
