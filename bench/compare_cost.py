"""Cost of the rebalancing analyses and of the paired comparison per probed rollout, as ratios to the plain step.

Every variant trains the embedded default on the same rollouts (8 prompts x 8 samples, GRPO, probed every rollout,
analyses on 8 sequences), each in its own process; the ratios are measured in this one run (this machine is noisy:
compare ratios, not seconds). Targets: the whole step with every analysis and three compared rules <= 1.7x,
each compared rule <= +0.15x of the whole step.

    python bench/compare_cost.py [--rollouts 3] [--modes equal_norm optimizer]

With both modes (the default) it also times the three rules in equal_norm alone (the study's setting).
"""

from __future__ import annotations

import argparse

from _steptime import run_variant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--people", type=int, nargs="+", default=[3])
    ap.add_argument("--modes", nargs="+", default=["equal_norm", "optimizer"])
    args = ap.parse_args()
    probed = {"probe_every": 1, "probe_sample_sequences": 8}
    variants = {
        "plain step": {},
        "probe + every analysis": probed,
        "+ compare base": {**probed, "probe_compare_rules": ["base"], "probe_compare_modes": args.modes},
        "+ compare base, reweight, lopti": {
            **probed,
            "probe_compare_rules": ["base", "reweight", "lopti"],
            "probe_compare_modes": args.modes,
        },
    }
    if args.modes != ["equal_norm"]:  # the study's mode alone, beside the default of both
        variants["+ compare the three, equal_norm only"] = {
            **probed,
            "probe_compare_rules": ["base", "reweight", "lopti"],
            "probe_compare_modes": ["equal_norm"],
        }
    results = {name: run_variant(extra, args.rollouts, args.people) for name, extra in variants.items()}
    off = results["plain step"]
    print(f"compare modes: {', '.join(args.modes)}; {args.rollouts} timed rollouts per variant")
    print(f"{'variant':<34} {'whole s':>8} {'update s':>9} {'whole / plain':>14} {'update / plain':>15}")
    for name, r in results.items():
        print(
            f"{name:<34} {r['whole']:>8.3f} {r['update']:>9.3f} {r['whole'] / off['whole']:>14.3f} "
            f"{r['update'] / off['update']:>15.3f}"
        )
    one, three = results["+ compare base"], results["+ compare base, reweight, lopti"]
    full = results["probe + every analysis"]
    print(f"analyses / plain, whole step: {full['whole'] / off['whole']:.3f}")
    print(
        f"every analysis + three compared rules / plain, whole step: {three['whole'] / off['whole']:.3f} (<= 1.7)"
    )
    print(
        f"the base rule's comparison: +{(one['whole'] - full['whole']) / off['whole']:.3f} x the plain step"
    )
    per_rule = (three["whole"] - one["whole"]) / 2 / off["whole"]
    print(f"each further compared rule (reweight, lopti): +{per_rule:.3f} x the plain step (<= 0.15)")
    if "+ compare the three, equal_norm only" in results:
        en = results["+ compare the three, equal_norm only"]
        print(
            f"every analysis + three compared rules, equal_norm only / plain, whole step: "
            f"{en['whole'] / off['whole']:.3f}; per rule +{(en['whole'] - full['whole']) / 3 / off['whole']:.3f}"
        )


if __name__ == "__main__":
    main()
