"""Cost of the probe at real vocabulary sizes: a training step with the probe on every step against the same step
without it, at V = 32,000 and V = 152,064 (Qwen2's), hidden size and layers reduced so that a CPU fits (targets:
<= 1.05x amortised over 30 steps, the first probed step <= 2x).

The model is a random untied Qwen2 (`memory.build_model`, float32), the batch `--rows` rows of `--prompt` +
`--completion` random tokens (`memory.make_batch`). One step is a custom loop's: forward with visible logits,
log pi_t of the completion at T = 0.7, the clipped GRPO loss on-policy, backward, AdamW step (``--head fused``: TRL's
fused LM head instead, which shows the probe no logits). The probed step is the same step inside
`tokendyn.instrument` with the default `ProbeConfig` (at most 256 check tokens at the LM head and the direct
gradients' replays on at most every 10th step, each within 2 % of the training flops (`tokendyn.probe.budget`;
``--no-budget``: 256 tokens and every 10th step whatever they cost), sigma_max refreshed every 16 checks, records
written to a temporary run directory). Plain and probed steps
alternate on the same model, optimizer and batch (the probe's hooks are removed for the plain ones, the order
flips every pair), so machine noise hits both; every ratio is of times measured in this one run, after one warm-up
plain step:

  first probed step   its time / the median plain step (a fresh probe: sigma_max computed from nothing)
  amortised           sum of the probed steps / sum of the plain steps over the --steps pairs

Where the probe's extra time goes (sum probed - sum plain): the functions the probe calls are timed inside the probed
steps (calls, seconds, float64 pieces of the head they streamed, power-iteration counts), the rest is hooks, norms
and bookkeeping.

    python bench/probe_vocab_cost.py             # 30 pairs at each vocabulary, ~12 min on 2 cores
    python bench/probe_vocab_cost.py --quick     # 12 pairs, 2 rows, ~4 min
    python bench/probe_vocab_cost.py --model smollm2-135m --steps 8 --rows 2 --prompt 32 --completion 128
                                                 # the real LLM (its own weights; 30 layers, V = 49,152)
"""

from __future__ import annotations

import argparse
import importlib
import math
import statistics
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from memory import DELTA, EPS_HIGH, EPS_LOW, Size, build_model, make_batch

T = 0.7
VOCABS = (32_000, 152_064)  # a Llama-2-sized vocabulary and Qwen2's own
TARGET_AMORTISED, TARGET_FIRST = 1.05, 2.0
# (module, attribute, label): what the probe calls, timed where it is looked up; missing ones are skipped, so the
# bench runs on the code before and after a change of the head checks
TIMED = [
    ("tokendyn.probe.probe", "sigma_max_power", "sigma_max"),
    ("tokendyn.probe.probe", "sigma_max_gram", "sigma_max"),
    ("tokendyn.probe.parallel", "head_partial", "head_partial"),
    ("tokendyn.probe.probe", "logits_identity_error", "logits identity"),
    ("tokendyn.probe.probe", "replay_direct_norms", "direct gradients"),
    ("tokendyn.probe.probe", "reduce_step", "reduce_step"),
    ("tokendyn.records", "RecordWriter.add", "records"),
]


def clipped_loss(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The clipped dapo loss on-policy (`memory.measure.grpo_step`): r = exp(logp - logp.detached),
    mean over the completion tokens of -min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A)."""
    ratio = torch.exp(logp - logp.detach())
    a = adv.to(logp.dtype).unsqueeze(1)
    pg = -torch.minimum(ratio.clamp(max=DELTA) * a, ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * a)
    m = mask.to(logp.dtype)
    return (pg * m).sum() / m.sum()


def train_step(model, opt, b: dict, c_len: int, head: str, probe=None) -> None:
    """Forward, log pi_t at T, loss, backward, optimizer step; with `probe`: the step told to it (a custom loop's
    ``logps=`` after the forward, or the trainer's way before a fused-head forward) and ended after the update."""
    told = dict(completion_mask=b["completion_mask"], advantages=b["advantages"], temperature=T)
    told["completion_ids"] = b["completion_ids"]
    if head == "fused":
        labels = b["input_ids"].clone()
        labels[:, :-c_len] = -100
        if probe is not None:
            probe.begin_step(**told)
        out = model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=labels, fused_lm_head=True
        )
        logp = out.log_probs[:, -c_len:]
    else:
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        logp = torch.log_softmax(logits[:, -c_len - 1 : -1] / T, -1)
        logp = logp.gather(-1, b["completion_ids"].unsqueeze(-1)).squeeze(-1)
        if probe is not None:
            probe.begin_step(**told, logps=logp)
    clipped_loss(logp, b["advantages"], b["completion_mask"]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if probe is not None:
        probe.end_step()


class Clock:
    """Seconds and calls of labelled functions, the float64 pieces of the head (`HeadShard.chunks`) streamed under
    each, and the power-iteration counts where the sigma_max function returns them (its third value)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.chunks: dict[str, int] = defaultdict(int)
        self.sigma: list[tuple[float, int | None, int]] = []  # (seconds, iterations, chunks) per call
        self.stack: list[str] = []

    def wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            self.stack.append(label)
            before = self.chunks[label]
            t = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                self.stack.pop()
                self.seconds[label] += dt
                self.calls[label] += 1
            if label == "sigma_max":
                its = out[2] if isinstance(out, tuple) and len(out) == 3 else None
                self.sigma.append((dt, its, self.chunks[label] - before))
            return out

        return timed

    def count_chunks(self, chunks):
        clock = self

        def counted(shard, rows):
            for item in chunks(shard, rows):
                clock.chunks[clock.stack[-1] if clock.stack else "other"] += 1
                yield item

        return counted


@contextmanager
def timing(clock: Clock):
    """Install the clock's wrappers on `TIMED` and `HeadShard.chunks`; put the originals back after."""
    from tokendyn.probe.head import HeadShard

    saved = [(HeadShard, "chunks", HeadShard.chunks)]
    HeadShard.chunks = clock.count_chunks(HeadShard.chunks)
    for mod_name, attr, label in TIMED:
        owner = importlib.import_module(mod_name)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        if hasattr(owner, name):
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, clock.wrap(label, getattr(owner, name)))
    try:
        yield clock
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


def measure(s: Size, steps: int, head: str, options: dict, model_name: str | None = None) -> dict:
    """`steps` pairs of plain and probed steps (order flipping every pair) after one warm-up plain step; the model
    ``model_name`` (a packaged model, a directory or a hub id: its own weights) instead of a random one."""
    from tokendyn import instrument

    if model_name is None:
        model = build_model(s)
    else:
        from tokendyn.policy import load_policy

        model = load_policy(model_name, dtype=torch.float32)[0].train()
    if head == "fused":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, temperature=T)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    b = make_batch(s, s.rows)
    train_step(model, opt, b, s.completion, head)  # warm-up
    plain, probed = [], []
    clock = Clock()
    with tempfile.TemporaryDirectory(prefix="tokendyn-vocab-") as run_dir, timing(clock):
        with instrument(model, run_dir, temperature=T, **options) as probe:
            for i in range(steps):
                for on in (False, True) if i % 2 == 0 else (True, False):
                    if not on:
                        probe.detach()
                    t = time.perf_counter()
                    train_step(model, opt, b, s.completion, head, probe if on else None)
                    (probed if on else plain).append(time.perf_counter() - t)
                    if not on:
                        probe.attach()
                print(
                    f"  pair {i + 1}/{steps}: plain {plain[-1]:.2f} s, probed {probed[-1]:.2f} s", flush=True
                )
    return {"plain": plain, "probed": probed, "clock": clock}


def describe(s: Size, head: str, model_name: str | None = None) -> str:
    if model_name is not None:
        return (
            f"{model_name} (its own weights, float32, V {s.vocab:,}); {s.rows} rows x ({s.prompt} + {s.completion}) "
            f"random tokens; {'fused LM head (TRL)' if head == 'fused' else 'visible logits (custom loop)'}"
        )
    return (
        f"Qwen2, {s.layers} layers, hidden {s.hidden}, {s.heads}/{s.kv} heads, MLP {s.intermediate}, V {s.vocab:,}, "
        f"untied, float32; {s.rows} rows x ({s.prompt} + {s.completion}) tokens; "
        f"{'fused LM head (TRL)' if head == 'fused' else 'visible logits (custom loop)'}"
    )


def report(s: Size, head: str, r: dict, model_name: str | None = None) -> dict:
    plain, probed, clock = r["plain"], r["probed"], r["clock"]
    med = statistics.median(plain)
    first = probed[0] / med
    amortised = sum(probed) / sum(plain)
    later = sum(probed[1:]) / sum(plain[1:]) if len(plain) > 1 else math.nan
    n = len(probed)
    # robust to a load burst that hits one step of a pair: the median of the pairs' own ratios after the first
    pairwise = (
        statistics.median(a / b for a, b in zip(probed[1:], plain[1:], strict=True)) if n > 1 else math.nan
    )
    print(describe(s, head, model_name))
    print(f"  plain step: median {med:.2f} s (min {min(plain):.2f}, max {max(plain):.2f}) over {n} steps")
    print(f"  first probed step: {probed[0]:.2f} s = {first:.2f}x the plain step (target <= {TARGET_FIRST}x)")
    print(
        f"  amortised over {n} steps: {amortised:.3f}x (target <= {TARGET_AMORTISED}x); steps 2..{n}: {later:.3f}x, "
        f"median pair ratio {pairwise:.3f}x"
    )
    extra = sum(probed) - sum(plain)
    print(f"  where the probed steps' extra {extra:.1f} s went ({n} probed steps; inclusive seconds):")
    print(f"    {'':<18} {'calls':>5} {'seconds':>8} {'s/call':>7} {'head pieces':>12} {'per step':>9}")
    for label in dict.fromkeys(label for _, _, label in TIMED):
        if clock.calls[label]:
            calls, sec = clock.calls[label], clock.seconds[label]
            print(
                f"    {label:<18} {calls:>5} {sec:>8.2f} {sec / calls:>7.3f} {clock.chunks[label]:>12} "
                f"{sec / n / med:>8.1%}"
            )
    rest = extra - sum(clock.seconds[label] for label in set(label for _, _, label in TIMED))
    print(
        f"    {'rest (hooks, norms, noise)':<18} {'':>5} {rest:>8.2f} {'':>7} {'':>12} {rest / n / med:>8.1%}"
    )
    print("    (per step: seconds / probed steps / the median plain step)")
    for i, (sec, its, pieces) in enumerate(clock.sigma):
        its_text = "" if its is None else f", {its} power iterations"
        print(f"    sigma_max refresh {i + 1}: {sec:.2f} s, {pieces} head pieces{its_text}")
    return {
        "vocab": s.vocab,
        "first": first,
        "amortised": amortised,
        "later": later,
        "pairwise": pairwise,
        "plain": med,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="12 pairs and 2 rows per vocabulary (~4 min)")
    ap.add_argument("--steps", type=int, default=30, help="pairs of plain and probed steps (default 30)")
    ap.add_argument("--vocab", type=int, nargs="+", default=list(VOCABS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--head", choices=("logits", "fused"), default="logits")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--model",
        default=None,
        help="a real model instead of the random ones (e.g. smollm2-135m: 30 layers, V = 49,152, tied head); "
        "--vocab, --layers and --hidden are then its own",
    )
    ap.add_argument(
        "--no-budget",
        action="store_true",
        help="check_budget and direct_budget None: 256 check tokens and direct gradients every 10th step whatever "
        "they cost (the probe before its cost budget)",
    )
    args = ap.parse_args()
    steps, rows = (12, 2) if args.quick else (args.steps, args.rows)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows_out = []
    if args.model is not None:
        from tokendyn.policy import check_model_source

        args.vocab = [check_model_source(args.model, "--model").vocab_size]
    for vocab in args.vocab:
        s = Size(
            layers=args.layers,
            hidden=args.hidden,
            vocab=vocab,
            completion=args.completion,
            rows=rows,
            prompt=args.prompt,
        )
        print(f"V = {vocab:,}: {steps} pairs of steps ...", flush=True)
        options = {"check_budget": None, "direct_budget": None} if args.no_budget else {}
        rows_out.append(report(s, args.head, measure(s, steps, args.head, options, args.model), args.model))
    budgets = (
        "no budgets (--no-budget)"
        if args.no_budget
        else "default ProbeConfig (check and direct budgets 0.02)"
    )
    print(f"\nsummary ({args.threads} threads, {budgets}; ratios within this run):")
    print(f"  {'V':>8} {'plain s':>8} {'first':>7} {'amortised':>10} {'steps 2..':>10} {'median pair':>12}")
    for r in rows_out:
        print(
            f"  {r['vocab']:>8,} {r['plain']:>8.2f} {r['first']:>6.2f}x {r['amortised']:>9.3f}x {r['later']:>9.3f}x "
            f"{r['pairwise']:>11.3f}x"
        )
    print(
        f"targets: first <= {TARGET_FIRST}x, amortised <= {TARGET_AMORTISED}x; wall {time.perf_counter() - t0:.0f} s"
    )


if __name__ == "__main__":
    main()
