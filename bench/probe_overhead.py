"""Overhead of leaving the probe on: training-step time with the probe on every step against off,
peak memory with and without, and bytes of records per probed step (targets: <= 1.05 and <= 1 MB).

Every variant trains the embedded default on the same rollouts (8 prompts x 8 samples) with one method (GRPO by
default; with --method lopti the analyses also decompose each Lopti stage), each in its own process (peak RSS is that
variant's); the ratios are measured in this one run.

    python bench/probe_overhead.py [--rollouts 3] [--method grpo|reweight|lopti]
"""

from __future__ import annotations

import argparse

from _steptime import run_variant

METHODS = {"grpo": {}, "reweight": {"advantage_reweight_alpha": 0.3}, "lopti": {"lopti_eta": 0.5}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--people", type=int, nargs="+", default=[3])
    ap.add_argument("--method", choices=sorted(METHODS), default="grpo")
    args = ap.parse_args()
    method = METHODS[args.method]
    off = run_variant(method, args.rollouts, args.people)
    on = run_variant({**method, "probe_every": 1, "probe_analyses": "none"}, args.rollouts, args.people)
    full = run_variant({**method, "probe_every": 1}, args.rollouts, args.people)
    print(f"method: {args.method}")
    print(f"{'variant':<28} {'update s':>9} {'whole s':>8} {'peak RSS MB':>12} {'MB/probed step':>15}")
    for name, r in (
        ("probe off", off),
        ("probe on (every step)", on),
        ("probe + rebalancing analyses", full),
    ):
        per_step = r["record_bytes"] / max(1, r["probed_steps"]) / 1e6
        print(
            f"{name:<28} {r['update']:>9.3f} {r['whole']:>8.3f} {r['peak_rss_mb']:>12.0f} {per_step:>15.3f}"
        )
    print(f"probe on/off, whole step: {on['whole'] / off['whole']:.3f} (target <= 1.05)")
    print(f"probe on/off, update phase: {on['update'] / off['update']:.3f}")
    print(f"probe on/off, peak memory: {on['peak_rss_mb'] / off['peak_rss_mb']:.3f}")
    print(
        f"records per probed optimizer step: {on['record_bytes'] / max(1, on['probed_steps']) / 1e6:.3f} MB "
        "(target <= 1 MB)"
    )
    print(
        f"probe + analyses / off, whole step: {full['whole'] / off['whole']:.3f} (the analyses are a chosen cost)"
    )


if __name__ == "__main__":
    main()
