"""What the spike trigger costs on a probed step that does not spike: the probed step's analyses (what the trainer runs
once per probed rollout, `tokendyn.effects.rebalance.analyze_update` with the default options) with the trigger off,
against the same with the trigger on (`tokendyn.hooks.spikes.LiveSpikes.observe` after them, as `TrainerProbe` calls
it), in one process, on one batch of the model's own samples.

The trigger is warmed up on the same batch first (``min_history`` probed steps with the same values), so every timed
step is calm (ratio 1 to its running median, k = 3): it reads ||g|| and L from the step's `shares` frame and max
|log rho|, max w from the batch, and makes no pass of its own. The two variants run in pairs, ``--repeats`` pairs,
which one goes first alternating; the ratio printed is the median of the pairs' ratios (each pair's two steps ran
seconds apart, under the same load), beside the ratio of the medians. The trigger's own call is also timed alone (median of many calls), and the probe's
own budget is printed beside it: `bench/probe_overhead.py`'s target, probe on / off <= 1.05 of the whole step.

    python bench/spike_trigger_cost.py [--model default|smollm2-135m] [--prompts 4] [--per-prompt 2] [--tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _spike import sampled_batch  # noqa: E402

from tokendyn.config import ProbeConfig  # noqa: E402
from tokendyn.effects.rebalance import analyze_update  # noqa: E402
from tokendyn.effects.spike_trigger import DEFAULT_K, DEFAULT_MIN_HISTORY  # noqa: E402
from tokendyn.hooks.options import rebalance_options  # noqa: E402
from tokendyn.hooks.spikes import LiveSpikes  # noqa: E402
from tokendyn.policy import load_policy  # noqa: E402
from tokendyn.probe.objective import Objective  # noqa: E402
from tokendyn.probe.tokenloss import ProbeBatch  # noqa: E402

PROBE_BUDGET = 1.05  # bench/probe_overhead.py: probe on / off, whole training step
PROMPTS = [
    "A very special island is inhabited only by knights and knaves. Zoey says that Oliver is a knave.",
    "Knights always tell the truth, and knaves always lie. Emma says that Zoey is a knight.",
    "You meet 2 inhabitants: Ava and Liam. Ava says that Liam is a knave.",
    "Oliver says that Emma is a knight. Emma says that Oliver is a knave.",
]
EDGES = [0.0, 0.25, 0.5, 0.75, 1.0]


def calm_batch(model, tok, prompts: int, per_prompt: int, tokens: int) -> ProbeBatch:
    """The model's own samples, advantages +-1 within each prompt's group (no planted token)."""
    ids, attn, cmask, p = sampled_batch(
        model, tok, PROMPTS[:prompts], n_return=per_prompt, max_new_tokens=tokens, seed=0
    )
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(ids.size(0))])
    return ProbeBatch(ids, attn, cmask, adv, temperature=0.7)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default="default", help="default (the embedded policy) or a packaged model's name"
    )
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--per-prompt", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200, help="calls of the trigger alone, timed")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: least sensitive to other jobs)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = load_policy(None if args.model == "default" else args.model)
    model.eval()
    batch = calm_batch(model, tok, args.prompts, args.per_prompt, args.tokens)
    options = rebalance_options(ProbeConfig(), seed=0)
    objective = Objective()

    def analyses() -> dict:
        frames, _ = analyze_update(model, batch, step=0, edges=EDGES, options=options, objective=objective,
                                   tokenizer=tok)  # fmt: skip
        return frames

    live = LiveSpikes(DEFAULT_K)

    def trigger(frames: dict) -> None:
        found = live.observe(model, batch, step=0, rollout=0, frames=frames, objective=objective, edges=EDGES,
                             tokenizer=tok)  # fmt: skip
        assert found is None, "the timed step spiked: it must not"

    frames = analyses()  # warm-up, and the trigger's warm-up on the same values
    for _ in range(DEFAULT_MIN_HISTORY):
        trigger(frames)
    off, on = [], []

    def timed_off() -> None:
        t = time.perf_counter()
        analyses()
        off.append(time.perf_counter() - t)

    def timed_on() -> None:
        t = time.perf_counter()
        trigger(analyses())
        on.append(time.perf_counter() - t)

    for i in range(args.repeats):
        for run in (timed_off, timed_on) if i % 2 == 0 else (timed_on, timed_off):
            run()
    pairs = [a / b for a, b in zip(on, off, strict=True)]
    alone = []
    for _ in range(args.calls):
        t = time.perf_counter()
        trigger(frames)
        alone.append(time.perf_counter() - t)
    scored = int(batch.completion_mask.sum())
    print(f"model: {args.model}, {batch.completion_mask.size(0)} sequences, {scored} scored tokens, "
          f"{args.repeats} repeats each, {torch.get_num_threads()} threads")  # fmt: skip
    print(f"probed step (analyses), trigger off: {statistics.median(off):.4f} s (median)")
    print(f"probed step (analyses), trigger on:  {statistics.median(on):.4f} s (median)")
    print(f"trigger on/off, probed step that does not spike: {statistics.median(pairs):.3f} (median of the "
          f"{len(pairs)} pairs' ratios, {min(pairs):.3f}-{max(pairs):.3f}; ratio of the medians "
          f"{statistics.median(on) / statistics.median(off):.3f})")  # fmt: skip
    own = statistics.median(alone)
    print(f"the trigger's call alone: {own * 1e3:.3f} ms (median of {args.calls}), "
          f"{own / statistics.median(off):.2e} of the probed step")  # fmt: skip
    print(f"the probe's own budget: probe on/off <= {PROBE_BUDGET} of the whole training step "
          "(bench/probe_overhead.py); a spike's localisation (one backward, one JVP) is paid on spiking steps only")  # fmt: skip


if __name__ == "__main__":
    main()
