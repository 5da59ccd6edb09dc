"""What vLLM costs on a CPU: its generation against Hugging Face ``generate`` (tokens per second, float32 and bf16,
16 and 128 sequences), and the probe's overhead on a training step whose rollouts vLLM samples, all measured in this run.

Generation: SmolLM2-135M-Instruct (`--model smollm2-135m`; any directory works), one prompt, n sampled completions
of exactly ``--tokens`` tokens each (EOS ignored, so every engine makes the same number of tokens), temperature 1.
Each variant runs in its own process (one vLLM engine per process; its start is timed apart from the generation);
the first call is a warm-up and the best of ``--repeat`` calls is kept. vLLM runs as TRL's CPU colocate mode builds
it (`tokendyn.integrations.vllm_cpu.keep_plain_weights`: plain weights, ``F.linear``), eager and compiled.

Probe overhead: `_steptime.run_variant` (the embedded default on K&K, a warm-up rollout then ``--rollouts`` timed)
with TRL's colocated vLLM sampling, probe off against probe on every step.

    python bench/vllm_generation.py [--threads 2] [--tokens 64] [--sizes 16 128] [--rollouts 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPT = "<|im_start|>user\nWhat is 12 + 35? Explain step by step.<|im_end|>\n<|im_start|>assistant\n"


def measure(engine: str, dtype: str, n: int, tokens: int, model: str, repeat: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from tokendyn import packaged

    path = str(packaged.resolve(model)) if model in packaged.PACKAGED else model
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    t0 = time.perf_counter()
    if engine.startswith("vllm"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        os.environ["OMP_NUM_THREADS"] = str(threads)  # else vLLM drops torch to one thread
        from vllm import LLM, SamplingParams

        from tokendyn.integrations.vllm_cpu import keep_plain_weights

        with keep_plain_weights():
            llm = LLM(
                model=path, dtype=dtype, max_model_len=512, enforce_eager=engine == "vllm-eager", seed=0
            )
        params = SamplingParams(
            n=n, max_tokens=tokens, min_tokens=tokens, temperature=1.0, ignore_eos=True, seed=0
        )

        def generate() -> int:
            out = llm.generate([PROMPT], params, use_tqdm=False)
            return sum(len(c.token_ids) for c in out[0].outputs)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
        ids = tok(PROMPT, return_tensors="pt")["input_ids"].repeat(n, 1)

        def generate() -> int:
            with torch.no_grad():
                out = hf.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                    max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=tok.pad_token_id,
                )  # fmt: skip
            return int((out.shape[1] - ids.shape[1]) * n)

    start = time.perf_counter() - t0
    generate()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        made = generate()
        best = min(best, time.perf_counter() - t)
    return {"engine": engine, "dtype": dtype, "n": n, "tokens": made, "seconds": best, "tok_s": made / best,
            "start_s": start}  # fmt: skip


def run(args: argparse.Namespace, engine: str, dtype: str, n: int) -> dict:
    cmd = [sys.executable, __file__, "--one", json.dumps([engine, dtype, n]), "--tokens", str(args.tokens),
           "--model", args.model, "--repeat", str(args.repeat), "--threads", str(args.threads)]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--skip-probe", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        engine, dtype, n = json.loads(args.one)
        print(json.dumps(measure(engine, dtype, n, args.tokens, args.model, args.repeat, args.threads)))
        return

    print(
        f"generation: {args.model}, {args.tokens} tokens a sequence, {args.threads} threads, best of {args.repeat}"
    )
    print(f"{'dtype':<9} {'n':>4} {'HF generate tok/s':>18} {'vLLM eager tok/s':>17} {'vLLM compiled tok/s':>20} "
          f"{'eager / HF':>11} {'compiled / HF':>14} {'start s (HF, eager, compiled)':>30}")  # fmt: skip
    for dtype in ("float32", "bfloat16"):
        for n in args.sizes:
            hf, eager, comp = (run(args, e, dtype, n) for e in ("hf", "vllm-eager", "vllm"))
            print(f"{dtype:<9} {n:>4} {hf['tok_s']:>18.0f} {eager['tok_s']:>17.0f} {comp['tok_s']:>20.0f} "
                  f"{eager['tok_s'] / hf['tok_s']:>11.2f} {comp['tok_s'] / hf['tok_s']:>14.2f} "
                  f"{hf['start_s']:>9.1f} {eager['start_s']:>9.1f} {comp['start_s']:>9.1f}", flush=True)  # fmt: skip
    if args.skip_probe:
        return

    from _steptime import run_variant

    vllm = {"use_vllm": True, "vllm_mode": "colocate"}
    off = run_variant(vllm, args.rollouts, [3])
    on = run_variant({**vllm, "probe_every": 1, "probe_analyses": "none"}, args.rollouts, [3])
    plain = run_variant({}, args.rollouts, [3])
    print(
        f"\nprobe on a vLLM-sampled step (embedded default, K&K, median of {args.rollouts} rollouts after a warm-up)"
    )
    print(f"{'variant':<32} {'rollout s':>10} {'update s':>9} {'whole s':>8}")
    for name, r in (
        ("generate, probe off", plain),
        ("vLLM, probe off", off),
        ("vLLM, probe on (every step)", on),
    ):
        print(f"{name:<32} {r['rollout']:>10.3f} {r['update']:>9.3f} {r['whole']:>8.3f}")
    print(f"vLLM step, probe on / off, whole step: {on['whole'] / off['whole']:.3f}; "
          f"update phase: {on['update'] / off['update']:.3f}")  # fmt: skip
    print(f"vLLM / generate, whole step (probe off): {off['whole'] / plain['whole']:.3f}")


if __name__ == "__main__":
    main()
