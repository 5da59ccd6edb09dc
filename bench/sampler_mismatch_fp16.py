"""The float16 sampler's mismatch per probability bin, beside bf16's, float32's and the noise floor.

The protocol of `bench/sampler_mismatch.py` (imported from it: the same prompts, vLLM's CPU engine at temperature 1
with processed log-probs, the float32 Hugging Face trainer in left-padded micro-batches of ``--micro``, the floor as
the trainer against itself in micro-batches of ``--floor-micro``, a 95 % bootstrap over the batches), with vLLM
sampling in float16 (`--one float16`) beside bf16 and float32. Each source runs in a process of its own.

The FP16 paper's full remedy (arXiv 2510.26788: float16 in both engines) is the source ``fp16_trainer``: the same
float16 vLLM sampler, the trainer's log pi_old from the same model loaded in float16 (a float16 forward on the CPU;
log-softmax of its logits in float32, as the float32 trainer's), with its own floor (the float16 trainer against
itself in micro-batches of ``--floor-micro``), ``fp16_floor``.

Per source and pi_old bin: mean |log rho| [95 % bootstrap over batches], tokens, the signed mean log rho, p99; the
least-squares slope of |log rho_t| on 1 - pi_old(t) through the origin with the same bootstrap; then one markdown
table of every source side by side.

    python bench/sampler_mismatch_fp16.py --batches 8 --prompts 2 --n 4 --tokens 32 --threads 1
    python bench/sampler_mismatch_fp16.py --step flag|pure|amp     # one GRPO step with a float16 trainer
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sampler_mismatch as base  # noqa: E402  (bench/ is not a package)

SOURCES = ("bf16", "float16", "float32", "floor", "fp16_trainer", "fp16_floor")
LABELS = {
    "bf16": "vLLM bf16",
    "float16": "vLLM float16",
    "float32": "vLLM float32",
    "floor": "floor (trainer vs itself)",
    "fp16_trainer": "fp16 trainer, vLLM float16",
    "fp16_floor": "floor of the fp16 trainer",
}


def one_fp16_trainer() -> None:
    """Print one JSON line {fp16_trainer: columns, fp16_floor: columns}: vLLM float16 against a float16 trainer, and
    that trainer against itself under another micro-batch split."""
    import torch
    from transformers import AutoTokenizer

    from tokendyn.tasks.arith.generator import train_problems
    from tokendyn.tasks.arith.prompts import render_prompt

    tok = AutoTokenizer.from_pretrained(base.model_path())
    problems = train_problems(2, seed=7, count=ARGS.batches * ARGS.prompts)
    prompts = [render_prompt(p.a, p.b, tok) for p in problems]
    seqs = base.sample("float16", prompts, ARGS.n, ARGS.tokens, seed=0)
    old = base.trainer_logps(seqs, ARGS.micro, torch.float16)
    mu = [np.asarray(s["logp_mu"], dtype=np.float64) for s in seqs]
    floor = base.trainer_logps(seqs, ARGS.floor_micro, torch.float16)
    batch = [s["prompt"] // ARGS.prompts for s in seqs]
    frames = {
        "fp16_trainer": base.tokens_frame(old, mu, batch),
        "fp16_floor": base.tokens_frame(old, floor, batch),
    }
    print(json.dumps({k: f.to_dict(as_series=False) for k, f in frames.items()}))


STEP_MODES = {
    "flag": "float32 model, fp16=True (TrainingArguments' mixed precision, as given)",
    "pure": "the model loaded in float16, fp16=False (float16 weights, gradients and Adam states)",
    "amp": "float32 master weights, fp16=True with accelerate's float16 autocast and a CPU GradScaler forced on",
}


def trainer_step(mode: str) -> None:
    """One GRPO optimizer step of the project's trainer (`TokendynGRPOTrainer`, the sampler study's settings, 8
    sums x 4 samples from its own generate) with the trainer in float16 as ``mode`` says (`STEP_MODES`); print one
    JSON line: the dtypes the training forward computed in (an MLP output, hooked), the loss, the largest weight
    change, whether any weight is non-finite, the loss scale; or the exception."""
    import tempfile

    import torch

    from tokendyn.commands.llm_study import QUICK, TRAINER, _settings
    from tokendyn.policy import load_policy
    from tokendyn.tasks.arith.reward import arith_reward
    from tokendyn.trainers.config import TokendynGRPOConfig
    from tokendyn.trainers.grpo import TokendynGRPOTrainer
    from tokendyn.trainers.runner import EMBEDDED_DEFAULTS, RunArguments, build_datasets

    result: dict = {"mode": mode, "what": STEP_MODES[mode]}
    run_fields, fields = _settings(QUICK)
    fields = {**EMBEDDED_DEFAULTS, **fields, **TRAINER, "per_device_train_batch_size": 32, "max_steps": 1,
              "probe_every": 0, "use_cpu": True, "save_strategy": "no", "output_dir": tempfile.mkdtemp(),
              "fp16": mode != "pure"}  # fmt: skip
    model, tok = load_policy(base.model_path(), dtype=torch.float16 if mode == "pure" else torch.float32)
    seen: set[str] = set()
    mlp = model.model.layers[0].mlp
    mlp.register_forward_hook(lambda _m, _i, o: seen.add(str(o.dtype)) if torch.is_grad_enabled() else None)
    before = [p.detach().clone() for p in model.parameters()]
    run = RunArguments(model_name_or_path=base.model_path(), **run_fields)
    trainer = TokendynGRPOTrainer(model=model, processing_class=tok, reward_funcs=[arith_reward],
                                  args=TokendynGRPOConfig(**fields), train_dataset=build_datasets(run, tok))  # fmt: skip
    acc = trainer.accelerator
    result["accelerate"] = {"mixed_precision": acc.mixed_precision, "native_amp": acc.native_amp,
                            "scaler": type(acc.scaler).__name__ if acc.scaler is not None else None}  # fmt: skip
    if (
        mode == "amp"
    ):  # what accelerate does on a GPU for fp16=True, here on the CPU (it leaves both off there)
        acc.native_amp, acc.scaler = True, torch.amp.GradScaler("cpu")
    try:
        out = trainer.train()
        after = list(trainer.model.parameters())
        result.update(
            loss=out.training_loss,
            grad_dtypes=sorted(seen),
            param_dtype=str(after[0].dtype),
            max_abs_dweight=max(
                float((a.detach().float() - b.float()).abs().max())
                for a, b in zip(after, before, strict=True)
            ),
            all_finite=all(bool(torch.isfinite(a).all()) for a in after),
            loss_scale=float(acc.scaler.get_scale()) if acc.scaler is not None else None,
        )
    except Exception as exc:  # the exact error is the result
        result["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(result))


def bin_stat(b: int):
    """mean |log rho| of the tokens in pi_old bin ``b`` (every token when b < 0)."""
    from tokendyn.analysis.mismatch import EDGES

    def stat(f):
        p = f["logp_old"].exp()
        sel = f if b < 0 else f.filter((p >= EDGES[b]) & ((p < EDGES[b + 1]) | (b == len(EDGES) - 2)))
        return float(sel["log_rho"].abs().mean()) if sel.height else float("nan")

    return stat


def slope(f) -> float:
    """Least-squares slope through the origin: sum x y / sum x^2, x = 1 - pi_old(t), y = |log rho_t|."""
    x = 1.0 - f["logp_old"].exp().to_numpy()
    y = f["log_rho"].abs().to_numpy()
    return float((x * y).sum() / (x * x).sum())


def run_sources() -> tuple[dict, dict]:
    """{source: token frame} of every source that ran, {source: error} of those that failed (the last lines of
    their stderr)."""
    import polars as pl

    frames, errors = {}, {}
    argv = sys.argv[1:]  # the child reads only its own source's settings
    for source in ARGS.sources.split(","):
        t0 = time.time()
        cmd = [sys.executable, __file__, "--one", source, *argv]
        done = subprocess.run(cmd, capture_output=True, text=True)
        print(f"# {source}: {time.time() - t0:.0f} s, exit {done.returncode}", file=sys.stderr, flush=True)
        if done.returncode != 0:
            errors[source] = f"exit {done.returncode}: " + "\n".join(done.stderr.strip().splitlines()[-3:])
            continue
        data = json.loads(done.stdout.strip().splitlines()[-1])
        if source == "fp16_trainer":
            frames.update({k: pl.DataFrame(v) for k, v in data.items()})
        else:
            frames[source] = pl.DataFrame(data)
    return frames, errors


def main() -> None:
    import polars as pl

    from tokendyn.analysis.mismatch import EDGES, mismatch_table

    frames, errors = run_sources()
    print(f"{ARGS.model}: {ARGS.batches} batches x {ARGS.prompts} sums x {ARGS.n} completions, <= {ARGS.tokens} tokens,"
          f" T = 1; trainer in micro-batches of {ARGS.micro}; floors: micro-batches of {ARGS.floor_micro};"
          f" {ARGS.threads} thread(s)")  # fmt: skip
    for source, err in errors.items():
        print(f"\n{LABELS[source]}: FAILED\n{err}")
    print(
        "\nmean |log rho| per pi_old bin [95 % bootstrap over batches]; tokens; mean log rho; p99 |log rho|"
    )
    cells: dict[str, dict[str, str]] = {}
    for source, frame in frames.items():
        table = mismatch_table(frame.with_columns(pl.lit(0).alias("step")), EDGES)
        for r in table.filter(pl.col("side") == "pi_old").iter_rows(named=True):
            b = r["bin"]
            m, lo, hi = base.bootstrap(frame, bin_stat(b), ARGS.boot)
            close = "]" if b == len(EDGES) - 2 else ")"
            name = "all" if b < 0 else f"[{r['bin_lo']:.2f}, {r['bin_hi']:.2f}{close}"
            print(f"  {LABELS[source]:<27} {name:<13} {m:.2e} [{lo:.2e}, {hi:.2e}]  n={r['count']:<5} "
                  f"mean log rho {r['mean_log_rho']:+.2e}  p99 {r['abs_p99']:.2e}")  # fmt: skip
            cells.setdefault(name, {})[source] = f"{m:.2e} [{lo:.1e}, {hi:.1e}] (n {r['count']})"
        s, lo, hi = base.bootstrap(frame, slope, ARGS.boot)
        print(f"  {LABELS[source]:<27} slope of |log rho| on 1 - pi_old: {s:.3e} [{lo:.3e}, {hi:.3e}]")
        cells.setdefault("slope on 1 − π", {})[source] = f"{s:.2e} [{lo:.1e}, {hi:.1e}]"
    shown = [s for s in SOURCES if s in frames]
    print("\n| π_old bin | " + " | ".join(LABELS[s] for s in shown) + " |")
    print("|---" * (len(shown) + 1) + "|")
    for name, row in cells.items():
        print(f"| {name} | " + " | ".join(row.get(s, "–") for s in shown) + " |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--floor-micro", type=int, default=3)
    ap.add_argument("--boot", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--one", choices=[*SOURCES[:4], "fp16_trainer"], help=argparse.SUPPRESS)
    ap.add_argument("--sources", default="bf16,float16,float32,floor,fp16_trainer",
                    help="the sources to run, comma-separated (fp16_trainer also makes fp16_floor)")  # fmt: skip
    ap.add_argument(
        "--step", choices=list(STEP_MODES), help="take one GRPO step with a float16 trainer instead"
    )
    ARGS = ap.parse_args()
    for name, value in vars(ARGS).items():
        if name != "one" and isinstance(value, int) and value < 1:
            ap.error(f"--{name.replace('_', '-')}: must be an integer >= 1, got {value}")
    wrong = set(ARGS.sources.split(",")) - {*SOURCES[:4], "fp16_trainer"}
    if wrong:
        ap.error(
            f"--sources: names from bf16, float16, float32, floor, fp16_trainer; got {', '.join(sorted(wrong))}"
        )
    base.ARGS = ARGS  # the imported protocol reads its settings from its module's ARGS
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)  # else vLLM's CPU worker drops torch to one thread
    import torch

    torch.set_num_threads(ARGS.threads)
    if ARGS.step:
        trainer_step(ARGS.step)
    elif ARGS.one == "fp16_trainer":
        one_fp16_trainer()
    elif ARGS.one:
        base.one(ARGS.one)
    else:
        main()
