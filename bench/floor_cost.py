"""What the noise floor costs (`--probe_floor`, on by default): the time of its extra no-grad forward (each probed
micro-batch recomputed in two halves, `tokendyn.hooks.sampler.split_logps`) against the time of the steps it was
taken in, from the same steps of one run (so the machine's load moves both alike).

Trains the embedded default with the probe on every step (no analyses), as `bench/probe_overhead.py` does, the floor's
forward timed where it runs:

    python bench/floor_cost.py [--rollouts 3]
"""

from __future__ import annotations

import argparse
import time

from _steptime import measure

import tokendyn.hooks.sampler as sampler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--people", type=int, nargs="+", default=[3])
    args = ap.parse_args()
    spent: list[float] = []
    split = sampler.split_logps

    def timed(*args):
        t = time.perf_counter()
        try:
            return split(*args)
        finally:
            spent.append(time.perf_counter() - t)

    sampler.split_logps = timed
    r = measure(
        {"probe_every": 1, "probe_analyses": "none", "probe_floor": True}, args.rollouts, args.people, 160
    )
    per_rollout = sum(spent) / (args.rollouts + 1)  # the warm-up rollout's steps are probed too
    print(f"floor forwards: {len(spent)} over {args.rollouts + 1} rollouts, {per_rollout:.3f} s per rollout")
    print(
        f"update phase per rollout (median): {r['update']:.3f} s; whole rollout (median): {r['whole']:.3f} s"
    )
    print(f"the floor / the update phase: {per_rollout / r['update']:.3f}")
    print(f"the floor / the whole step: {per_rollout / r['whole']:.3f}")


if __name__ == "__main__":
    main()
