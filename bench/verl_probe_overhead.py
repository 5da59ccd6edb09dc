"""Cost of tokendyn's probe on verl's own actor update (`engine.train_batch`, FSDP2 on CPU, no Ray), the probe on
every step against off, as ratios measured in this one run (target <= 1.05x).

verl 0.9's FSDP2 actor engine (`tests/_verl_engine.py`: gloo, float32, one process) around a random untied Qwen2
(default 8 layers, hidden 512, 8/4 heads, MLP 1536, vocab 4096: a micro-batch takes ~1 s on one CPU thread, as a
real policy's does on a GPU; its LM head scaled x25 so that pi spreads over the default bins), trained with verl's `ppo_loss` (vanilla clipped policy loss,
token-mean) by SGD at lr 0, so the weights never move and every step costs the same. The batch: 16 sequences,
prompts of 16-32 random tokens, responses of 48-96 tokens sampled from the model at T = 1, pi_old = the engine's own
log-probs plus noise (so that some ratios clip), one advantage per sequence; micro-batches of 4. Both of verl's
layouts: remove-padding (verl's default, one packed row per micro-batch) and padded (one row per sequence).

Variants, each an engine of its own built from the same saved model with the same config, the probe (if any)
attached once for the whole run as a user attaches it (`probe_engine`, records written to a temporary run
directory at the writer's own cadence):

  off        no probe
  default    `ProbeConfig()`, what a user gets
  cheapest   direct_tokens=0, check_tokens=0, sample_tokens=0 (no direct gradients, no exact LM-head checks, no
             raw token rows): the hooks, norms and per-bin statistics only

The timed call is `train_step` (one `engine.train_batch` inside `engine.train_mode()`, as verl's
`TrainingWorker.train_batch`). Steps are interleaved: each repetition runs one step of every variant, the order
rotating per repetition, so machine noise hits all of them; warm-up repetitions are dropped. Reported per layout:
the median s/step, the ratio to off of the medians, of the minima, and the median of the per-repetition ratios
(robust to a burst that hits one repetition), and the bytes of records written per probed step. No time is
asserted. ``--profile N``: afterwards, N more steps of off and of the default variant (remove-padding) under
cProfile: both totals, and the probed steps' top tokendyn functions by cumulative time.

torch runs on ``--threads`` intra-op threads (`torch.set_num_threads`; default 1, at most the machine's cores), the
same for every variant: on a shared 2-core machine two spinning OpenMP threads turn another process's load into
10-40x spikes of single steps, one thread only slows down in proportion (a step of four micro-batches takes ~4 s
on one thread, ~1 s in the small shape below).

    python bench/verl_probe_overhead.py                 # ~6 min on 2 cores
    python bench/verl_probe_overhead.py --hidden 256 --intermediate 768 --layers 4 --heads 4 --kv-heads 2 --steps 20
                                                        # ~3 min on 2 cores: 0.24 s micro-batches, where the fixed
                                                        # ~10 ms of the probe's bookkeeping per micro-batch shows
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from contextlib import ExitStack, redirect_stdout
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import _verl_engine as ve  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from tokendyn.integrations.verl.probe import probe_engine  # noqa: E402

TARGET = 1.05
T = 1.0
VARIANTS = {
    "off": None,
    "default": {},
    "cheapest": {"direct_tokens": 0, "check_tokens": 0, "sample_tokens": 0},
}
LAYOUTS = {"remove-padding": True, "padded": False}


def build_model(path: Path, args) -> Path:
    """The random Qwen2, its LM head scaled by ``--sharpen`` (pi_old then spreads over (0, 1)), saved at `path`."""
    ve.save_tiny_qwen2(
        path,
        seed=0,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt + args.response + 8,
    )
    model = ve.load_hf_model(path, attn_implementation="sdpa")
    with torch.no_grad():
        model.lm_head.weight.mul_(args.sharpen)
    model.save_pretrained(path)
    return path


def rollout(path: Path, args) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of random tokens and responses sampled from the model at T (lengths drawn per sequence)."""
    model = ve.load_hf_model(path, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(0)
    n = args.batch
    p_lens = torch.randint(args.prompt // 2, args.prompt + 1, (n,), generator=g).tolist()
    r_lens = torch.randint(args.response // 2, args.response + 1, (n,), generator=g).tolist()
    prompts = [
        [ve.BOS_TOKEN_ID, *torch.randint(3, args.vocab, (k - 1,), generator=g).tolist()] for k in p_lens
    ]
    width = max(p_lens)
    ids = torch.full((n, width), ve.PAD_TOKEN_ID, dtype=torch.long)
    attn = torch.zeros(n, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], attn[i, width - len(p) :] = torch.tensor(p), 1
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=True,
            temperature=T,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max(r_lens),
            min_new_tokens=max(r_lens),
            pad_token_id=ve.PAD_TOKEN_ID,
        )
    responses = [out[i, width : width + k].tolist() for i, k in enumerate(r_lens)]
    return prompts, responses


def engine_batch(prompts, responses, old, adv):
    return ve.make_batch(prompts, responses, old_log_probs=old, advantages=adv, temperature=T)


def record_bytes(run_dir: Path) -> int:
    return sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file())


def measure(model_dir: Path, rmpad: bool, prompts, responses, args, tmp: Path) -> dict:
    """Interleaved steps of every variant on engines of one layout; returns variant -> times, and bytes per step."""
    loss_fn = partial(ppo_loss, config=ve.actor_config(micro_batch_size=args.micro))
    with redirect_stdout(io.StringIO()):  # verl's and transformers' build-time prints
        engines = {
            name: ve.build_engine(model_dir, use_remove_padding=rmpad, micro_batch_size=args.micro, lr=0.0)
            for name in VARIANTS
        }
    # pi_old: the engine's own log-probs, perturbed so that some ratios leave [1 - eps, 1 + eps]
    g = torch.Generator().manual_seed(1)
    logp = ve.infer_log_probs(engines["off"], engine_batch(prompts, responses, None, None))
    old = (logp + 0.1 * torch.randn(logp.shape, generator=g)).clamp(max=-1e-4)
    adv = torch.randn(len(prompts), 1, generator=g).expand_as(old).contiguous()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    probes = {}
    names = list(VARIANTS)
    with ExitStack() as stack:
        for name, options in VARIANTS.items():
            if options is not None:
                probes[name] = stack.enter_context(
                    probe_engine(engines[name], tmp / f"{'rmpad' if rmpad else 'padded'}-{name}", **options)
                )
        for rep in range(args.warmup + args.steps):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                data = engine_batch(prompts, responses, old, adv)
                gc.collect()
                t0 = time.perf_counter()
                ve.train_step(engines[name], data, loss_fn)
                dt = time.perf_counter() - t0
                if rep >= args.warmup:
                    times[name].append(dt)
            if rep >= args.warmup:
                print(
                    f"  {'remove-padding' if rmpad else 'padded'} rep {rep - args.warmup + 1}/{args.steps}: "
                    + ", ".join(f"{n} {times[n][-1]:.3f} s" for n in names),
                    flush=True,
                )
    per_step = {
        name: record_bytes(probe.run_dir) / max(1, probe.step) for name, probe in probes.items()
    }  # after the exit: every record flushed
    out = {"times": times, "bytes": per_step}
    if args.profile and rmpad:
        out["profile"] = profile(engines, prompts, responses, old, adv, loss_fn, args, tmp)
    del engines
    gc.collect()
    return out


def profile(engines, prompts, responses, old, adv, loss_fn, args, tmp: Path) -> str:
    """cProfile over ``--profile`` steps of the off engine and as many probed steps of the default variant's (a fresh
    probe, one untimed step first): both totals, and the probed run's tokendyn functions by cumulative time."""
    totals = {}
    with probe_engine(engines["default"], tmp / "profile"):
        for name in ("off", "default"):
            ve.train_step(engines[name], engine_batch(prompts, responses, old, adv), loss_fn)
            prof = cProfile.Profile()
            for _ in range(args.profile):
                data = engine_batch(prompts, responses, old, adv)
                prof.enable()
                ve.train_step(engines[name], data, loss_fn)
                prof.disable()
            totals[name] = pstats.Stats(prof).total_tt
    buf = io.StringIO()
    buf.write(
        f"under cProfile: off {totals['off'] / args.profile:.3f} s/step, default "
        f"{totals['default'] / args.profile:.3f} s/step\n"
    )
    stats = pstats.Stats(prof, stream=buf).sort_stats("cumulative")
    stats.print_stats(r"tokendyn/(probe|integrations/verl/(probe|layout|loss)|hooks|records|common)", 40)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant and layout (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed repetitions first (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4, help="micro-batch size (default 4)")
    ap.add_argument("--prompt", type=int, default=32, help="longest prompt (lengths drawn from half of it)")
    ap.add_argument(
        "--response", type=int, default=96, help="longest response (lengths drawn from half of it)"
    )
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument(
        "--sharpen", type=float, default=25.0, help="LM-head scale of the random model (default 25)"
    )
    ap.add_argument("--layout", choices=[*LAYOUTS, "both"], default="both")
    ap.add_argument(
        "--profile", type=int, default=0, help="probed steps under cProfile afterwards (default 0)"
    )
    args = ap.parse_args()
    threads = max(1, min(args.threads, os.cpu_count() or 1))
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")  # verl's and transformers' deprecation chatter
    t_start = time.perf_counter()
    layouts = LAYOUTS if args.layout == "both" else {args.layout: LAYOUTS[args.layout]}
    results = {}
    with tempfile.TemporaryDirectory(prefix="tokendyn-verl-bench-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = build_model(tmp / "model", args)
        prompts, responses = rollout(model_dir, args)
        for layout, rmpad in layouts.items():
            print(f"{layout}: {args.warmup} warm-up + {args.steps} timed repetitions ...", flush=True)
            results[layout] = measure(model_dir, rmpad, prompts, responses, args, tmp)
    elapsed = time.perf_counter() - t_start

    n_tok = sum(map(len, responses))
    print()
    print(
        f"verl {ve_version()} FSDP2 actor engine on CPU; torch {torch.__version__}, {threads} threads "
        f"(torch.set_num_threads; {os.cpu_count()} cores)"
    )
    print(
        f"Qwen2 {args.layers} layers, hidden {args.hidden}, {args.heads}/{args.kv_heads} heads, MLP "
        f"{args.intermediate}, vocab {args.vocab}, untied, float32; {args.batch} sequences, prompts <= {args.prompt}, "
        f"responses <= {args.response} ({n_tok} response tokens), micro-batches of {args.micro}; "
        f"ppo_loss, SGD lr 0; {args.steps} timed steps per variant after {args.warmup} warm-up, interleaved"
    )
    head = (
        f"{'layout':<15} {'variant':<9} {'median s':>9} {'min s':>7} {'ratio med':>10} {'ratio min':>10} "
        f"{'paired med':>11} {'target':>7} {'KB/probed step':>15}"
    )
    print(head)
    print("-" * len(head))
    for layout, r in results.items():
        times = r["times"]
        off_med, off_min = statistics.median(times["off"]), min(times["off"])
        for name in VARIANTS:
            t = times[name]
            med, mn = statistics.median(t), min(t)
            paired = statistics.median(a / b for a, b in zip(t, times["off"], strict=True))
            kb = f"{r['bytes'][name] / 1e3:.1f}" if name in r["bytes"] else "-"
            target = "-" if name == "off" else f"<= {TARGET:.2f}x"
            print(
                f"{layout:<15} {name:<9} {med:>9.3f} {mn:>7.3f} {med / off_med:>9.3f}x {mn / off_min:>9.3f}x "
                f"{paired:>10.3f}x {target:>7} {kb:>15}"
            )
    print(
        "ratio med = median / off's median; ratio min = min / off's min; paired med = median of per-rep ratios"
    )
    print(f"runtime: {elapsed:.0f} s")
    for layout, r in results.items():
        if "profile" in r:
            print(
                f"\ncProfile, {args.profile} probed steps (default ProbeConfig, {layout}), tokendyn functions:"
            )
            print(r["profile"])


def ve_version() -> str:
    import verl

    return getattr(verl, "__version__", "?")


if __name__ == "__main__":
    main()
