"""Held-out gain of a GRPO run on the arithmetic task, paired by problem: the start policy and the trained one answer
the same held-out problems greedily; their accuracies with 95 % Wilson intervals, and the gain with a 95 % interval
from a bootstrap over problems (the pairing kept: each resample draws problems, both policies' answers with them).

    python bench/arith_gain.py --start smollm2-135m --end runs/arith/final --digits 2 --n 200
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tokendyn.policy import load_policy  # noqa: E402
from tokendyn.trainers.arith_eval import arith_outcomes, wilson  # noqa: E402


def paired_gain(
    before: np.ndarray, after: np.ndarray, draws: int = 10_000, seed: int = 0
) -> tuple[float, ...]:
    """(gain, lo, hi): mean(after - before) over problems and its 2.5 / 97.5 % bootstrap quantiles, problems drawn
    with replacement (both answers of a problem together)."""
    diff = after.astype(float) - before.astype(float)
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(draws, len(diff)))].mean(axis=1)
    return float(diff.mean()), float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", required=True, help="the policy before training (a model source)")
    ap.add_argument("--end", required=True, help="the trained policy (a model directory)")
    ap.add_argument("--digits", type=int, nargs="+", default=[2])
    ap.add_argument("--n", type=int, default=200, help="held-out problems per difficulty")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {}
    for d in args.digits:
        correct = {}
        for name, source in (("start", args.start), ("end", args.end)):
            model, tok = load_policy(source, dtype=torch.float32)
            rows = arith_outcomes(model.eval(), tok, [d], args.n)
            correct[name] = np.array([r["correct"] for r in rows]) > 0
            del model
        n = len(correct["start"])
        gain, lo, hi = paired_gain(correct["start"], correct["end"])
        res = {"n": n, "gain": gain, "gain_lo": lo, "gain_hi": hi}
        for name in ("start", "end"):
            k = int(correct[name].sum())
            res[name] = k / n
            res[f"{name}_lo"], res[f"{name}_hi"] = wilson(k, n)
        res["both"] = int((correct["start"] & correct["end"]).sum())
        res["gained"] = int((~correct["start"] & correct["end"]).sum())
        res["lost"] = int((correct["start"] & ~correct["end"]).sum())
        out[d] = res
        print(
            f"{d} digit(s), {n} held-out problems, greedy: start {res['start']:.3f} "
            f"[{res['start_lo']:.3f}, {res['start_hi']:.3f}] -> end {res['end']:.3f} "
            f"[{res['end_lo']:.3f}, {res['end_hi']:.3f}]; gain {gain:+.3f} [{lo:+.3f}, {hi:+.3f}] "
            f"(paired bootstrap; {res['gained']} problems gained, {res['lost']} lost, {res['both']} right in both)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
