"""The sampler's mismatch per probability bin on a real LLM, beside its noise floor.

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

vLLM's own kernels (``own_bf16``, ``own_float32``): the same engine built without tokendyn's `keep_plain_weights`
(vLLM's packed oneDNN / sgl CPU GEMMs, the engine a CPU user gets from vLLM itself; no weight sync happens here, so
its first rollout is all it samples, which is what such an engine can give before a sync). The patched engine
(``bf16``, ``float32``) computes every 2-D linear with ``F.linear`` from a weight the sync reaches.

Truncated sampling (``bf16_top_p``, ``--top-p``, default 0.9): the patched bf16 engine sampling at that top_p; the
trainer's log S per token from its float32 full logits (`tokendyn.hooks.kept_mass`, as the `sampler` records'
``log_kept``), the table's total log rho beside its precision part log rho - log S.

    python bench/sampler_mismatch.py [--batches 4] [--prompts 8] [--n 8] [--tokens 32] [--threads 2]   # ~6 min
    python bench/sampler_mismatch.py --batches 2 --prompts 8 --n 4 --threads 1 --sources own_bf16,bf16,...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import numpy as np

SOURCES = ("bf16", "float32", "own_bf16", "own_float32", "bf16_top_p", "floor")
LABELS = {
    "bf16": "vLLM bf16 (F.linear)",
    "float32": "vLLM float32 (F.linear)",
    "own_bf16": "vLLM bf16 (own kernels)",
    "own_float32": "vLLM float32 (own kernels)",
    "bf16_top_p": "vLLM bf16 top_p",
    "floor": "floor (trainer vs itself)",
}


def sample(
    dtype: str, prompts: list[str], n: int, tokens: int, seed: int, plain: bool = True, top_p: float = 1.0
) -> list[dict]:
    """vLLM's completions and their processed log-probs: one dict per sequence. ``plain``: the engine built with
    tokendyn's `keep_plain_weights` (F.linear from each 2-D weight), else with vLLM's own packed CPU kernels."""
    from contextlib import nullcontext

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from tokendyn.integrations.vllm_cpu import keep_plain_weights

    path = model_path()
    with keep_plain_weights() if plain else nullcontext():
        llm = LLM(model=path, dtype=dtype, max_model_len=512, enforce_eager=True, seed=seed,
                  logprobs_mode="processed_logprobs")  # fmt: skip
    # the engine's seed only: a per-request seed failed here with 256 prompts ("CPU Generator does not use offset")
    params = SamplingParams(n=n, max_tokens=tokens, temperature=1.0, logprobs=0, top_p=top_p)
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


def trainer_logps(seqs: list[dict], micro: int, dtype=None) -> list[np.ndarray]:
    """log pi_old of each sampled token: a forward in ``dtype`` (float32 unless given) over left-padded micro-batches
    of ``micro`` sequences, the log-softmax of its logits in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path(), dtype=dtype or torch.float32).eval()
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


def trainer_kept(seqs: list[dict], top_p: float) -> list[np.ndarray]:
    """log S of each sampled token (the kept mass at ``top_p``, temperature 1, under the float32 trainer's full
    logits; `tokendyn.hooks.kept_mass`): one sequence at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    from tokendyn.hooks.kept_mass import Processing, kept_mass

    model = AutoModelForCausalLM.from_pretrained(model_path(), dtype=torch.float32).eval()
    proc = Processing(temperature=1.0, top_p=top_p)
    out = []
    for s in seqs:
        p, c = s["prompt_ids"], s["ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : -1]
        out.append(kept_mass(logits, torch.tensor(c), proc).log_kept.numpy())
    return out


def tokens_frame(old: list[np.ndarray], mu: list[np.ndarray], batch: list[int], kept: list | None = None):
    """The `sampler` record columns of these tokens, with TRL's default weight (sequence_mask, clip 3); with
    ``kept`` (log S per token) also ``log_kept`` and ``log_rho_precision`` = log rho - log S."""
    import polars as pl

    rows = []
    for i, (o, m) in enumerate(zip(old, mu, strict=True)):
        log_rho = o - m
        total = float(log_rho.sum())
        weight = math.exp(total) if math.exp(min(total, 50.0)) <= 3.0 else 0.0
        for j in range(len(o)):
            s = None if kept is None else float(kept[i][j])
            prec = None if s is None else float(log_rho[j]) - s
            rows.append(
                (batch[i], i, j, float(o[j]), float(m[j]), float(log_rho[j]), weight, weight == 0.0, s, prec)
            )
    names = ["micro", "row", "pos", "logp_old", "logp_sampler", "log_rho", "is_weight", "seq_masked", "log_kept",
             "log_rho_precision"]  # fmt: skip
    schema = dict.fromkeys(names[3:7], pl.Float64) | {"log_kept": pl.Float64, "log_rho_precision": pl.Float64}
    return pl.DataFrame(rows, schema=names, orient="row", schema_overrides=schema)


def one(source: str) -> None:
    """Print one JSON line of token columns for ``source`` (`SOURCES`), in a process of its own."""
    from transformers import AutoTokenizer

    from tokendyn.tasks.arith.generator import train_problems
    from tokendyn.tasks.arith.prompts import render_prompt

    tok = AutoTokenizer.from_pretrained(model_path())
    problems = train_problems(2, seed=7, count=ARGS.batches * ARGS.prompts)
    prompts = [render_prompt(p.a, p.b, tok) for p in problems]
    name = source.removeprefix("own_").removesuffix("_top_p")
    dtype = {"floor": "float32", "bf16": "bfloat16"}.get(name, name)
    top_p = getattr(ARGS, "top_p", 0.9) if source.endswith("_top_p") else 1.0
    seqs = sample(
        dtype, prompts, ARGS.n, ARGS.tokens, seed=0, plain=not source.startswith("own_"), top_p=top_p
    )
    old = trainer_logps(seqs, ARGS.micro)
    if source == "floor":  # the trainer against itself: another micro-batch split of the same tokens
        mu = trainer_logps(seqs, ARGS.floor_micro)
    else:
        mu = [np.asarray(s["logp_mu"], dtype=np.float64) for s in seqs]
    batch = [s["prompt"] // ARGS.prompts for s in seqs]
    frame = tokens_frame(old, mu, batch, trainer_kept(seqs, top_p) if top_p < 1.0 else None)
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


def run_sources(sources: list[str], cache: str | None = None) -> tuple[dict, dict]:
    """{source: token frame} of each source that ran (a process each), {source: the last lines of its stderr} of
    each that failed. With ``cache`` (a folder) each frame is saved there as ``<source>.parquet`` and a source
    already saved is read back, not rerun (the same settings are the caller's to keep)."""
    import time
    from pathlib import Path

    import polars as pl

    frames, errors = {}, {}
    for source in sources:
        saved = Path(cache) / f"{source}.parquet" if cache else None
        if saved is not None and saved.exists():
            frames[source] = pl.read_parquet(saved)
            print(f"# {source}: read from {saved}", file=sys.stderr, flush=True)
            continue
        t0 = time.time()
        cmd = [sys.executable, __file__, "--one", source, *sys.argv[1:]]
        done = subprocess.run(cmd, capture_output=True, text=True)
        print(f"# {source}: {time.time() - t0:.0f} s, exit {done.returncode}", file=sys.stderr, flush=True)
        if done.returncode != 0:
            errors[source] = "\n".join(done.stderr.strip().splitlines()[-6:])
            continue
        frames[source] = pl.DataFrame(json.loads(done.stdout.strip().splitlines()[-1]))
        if saved is not None:
            saved.parent.mkdir(parents=True, exist_ok=True)
            frames[source].write_parquet(saved)
    return frames, errors


def markdown(frames: dict) -> str:
    """One markdown table: per pi_old bin, each source's mean |log rho| and signed mean log rho (tokens); for a
    truncated source also its mean log S and the precision part's signed mean."""
    import polars as pl

    from tokendyn.analysis.mismatch import EDGES, mismatch_table

    tables = {
        k: mismatch_table(f.with_columns(pl.lit(0).alias("step")), EDGES).filter(pl.col("side") == "pi_old")
        for k, f in frames.items()
    }
    names = ["all"] + [f"[{EDGES[b]:.2f}, {EDGES[b + 1]:.2f}{']' if b == len(EDGES) - 2 else ')'}"
                       for b in range(len(EDGES) - 1)]  # fmt: skip
    head = "| source | " + " | ".join(names) + " |"
    lines = [head, "|" + "---|" * (len(names) + 1)]
    for k, t in tables.items():
        by = {r["bin"]: r for r in t.iter_rows(named=True)}
        cells = [by.get(b) for b in range(-1, len(EDGES) - 1)]
        lines.append(f"| {LABELS[k]}: mean \\|log ρ\\| (mean log ρ; n) | " + " | ".join(
            "" if r is None else f"{r['abs_mean']:.2e} ({r['mean_log_rho']:+.1e}; {r['count']})" for r in cells
        ) + " |")  # fmt: skip
        if t["kept_count"].sum():
            lines.append(f"| {LABELS[k]}: mean log S; precision part mean log ρ − log S (mean \\|.\\|) | "
                         + " | ".join("" if r is None else f"{r['mean_log_kept']:+.2e}; {r['mean_log_rho_prec']:+.1e}"
                                      f" ({r['abs_mean_prec']:.2e})" for r in cells) + " |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    import polars as pl

    from tokendyn.analysis.mismatch import EDGES, mismatch_table

    sources = ARGS.sources.split(",")
    frames, errors = run_sources(sources, ARGS.cache)
    print(f"{ARGS.model}: {ARGS.batches} batches x {ARGS.prompts} sums x {ARGS.n} completions, <= {ARGS.tokens} tokens,"
          f" T = 1; trainer float32 in micro-batches of {ARGS.micro}; floor: micro-batches of {ARGS.floor_micro};"
          f" {ARGS.threads} thread(s); top_p source at {ARGS.top_p}")  # fmt: skip
    for source, error in errors.items():
        print(f"\n{source} FAILED:\n{error}")
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
            print(f"  {LABELS[source]:<26} {name:<13} {m:.2e} [{lo:.2e}, {hi:.2e}]  n={r['count']:<5} "
                  f"mean log rho {r['mean_log_rho']:+.2e}  p99 {r['abs_p99']:.2e}  envelope {r['envelope'] or 0:.3g}"
                  + (f"  in dropped sequences {r['frac_seq_masked']:.3f}" if source == "bf16" else ""))  # fmt: skip

        def slope(f):
            x = 1.0 - f["logp_old"].exp().to_numpy()
            y = f["log_rho"].abs().to_numpy()
            return float((x * y).sum() / (x * x).sum())

        s, lo, hi = bootstrap(frame, slope, ARGS.boot)
        print(f"  {LABELS[source]:<26} slope of |log rho| on 1 - pi_old: {s:.3e} [{lo:.3e}, {hi:.3e}]")
    if "bf16" in frames:
        by_mu = mismatch_table(frames["bf16"].with_columns(pl.lit(0).alias("step")), EDGES).filter(
            pl.col("side") == "mu"
        )
        print("\nvLLM bf16 binned by mu (the twin view): " + "; ".join(
            f"{'all' if r['bin'] < 0 else r['bin_lo']}: mean log rho {r['mean_log_rho']:+.2e}, "
            f"mean |.| {r['abs_mean']:.2e}" for r in by_mu.iter_rows(named=True)))  # fmt: skip
    print("\n" + markdown(frames))


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
    ap.add_argument("--top-p", type=float, default=0.9, help="the bf16_top_p source's top_p, in (0, 1)")
    ap.add_argument(
        "--sources", default=",".join(SOURCES), help=f"comma-separated, from {', '.join(SOURCES)}"
    )
    ap.add_argument(
        "--cache", help="a folder: each source's tokens saved there, and read back instead of rerun"
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ARGS = ap.parse_args()
    bad = sorted(set(ARGS.sources.split(",")) - set(SOURCES))
    if bad:
        ap.error(f"--sources: unknown {bad}; allowed: {', '.join(SOURCES)}")
    if not 0.0 < ARGS.top_p < 1.0:
        ap.error(f"--top-p: {ARGS.top_p} is not in (0, 1)")
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)  # else vLLM's CPU worker drops torch to one thread
    import torch

    torch.set_num_threads(ARGS.threads)
    if ARGS.one:
        one(ARGS.one)
    else:
        main()
