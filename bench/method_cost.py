"""Cost of the remedies: update-phase and whole-step time of +Reweight and +Lopti against GRPO.

On the embedded default each method trains the same rollout batches (8 prompts x 8 samples, after
one warm-up rollout). The rollout phase is TRL's ``_generate_and_score_completions`` (generation,
reward, pi_old); the update phase is the rest of the step (forward, backward, optimizer). Printed
as ratios to GRPO measured in this one run. The paper's bound for Lopti is 2x the update phase;
Reweight should cost nothing measurable (it may add one no-grad forward for pi_old when TRL
would have skipped it).

    python bench/method_cost.py [--rollouts 3] [--people 3]
"""

from __future__ import annotations

import argparse

from _steptime import run_variant

METHODS = {"GRPO": {}, "+Reweight": {"advantage_reweight_alpha": 0.3}, "+Lopti": {"lopti_eta": 0.5}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--people", type=int, nargs="+", default=[3])
    args = ap.parse_args()
    rows = {name: run_variant(extra, args.rollouts, args.people) for name, extra in METHODS.items()}
    base = rows["GRPO"]
    print(
        f"{'method':<10} {'opt steps':>9} {'rollout s':>10} {'update s':>9} {'whole s':>8} "
        f"{'update/GRPO':>12} {'whole/GRPO':>11}"
    )
    for name, r in rows.items():
        print(
            f"{name:<10} {r['optimizer_steps_per_rollout']:>9} {r['rollout']:>10.2f} {r['update']:>9.2f} "
            f"{r['whole']:>8.2f} {r['update'] / base['update']:>12.2f} {r['whole'] / base['whole']:>11.2f}"
        )


if __name__ == "__main__":
    main()
