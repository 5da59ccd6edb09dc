"""Zero-shot rates of a policy on the arithmetic task's held-out splits (`tokendyn.tasks.arith`), for docs/arith.md.

Per difficulty (digits of the operands): greedy accuracy on the first ``--greedy_n`` held-out problems (the 1-digit
split has only 30) with a 95 % Wilson interval; per-sample accuracy at ``--temperature`` with ``--samples`` samples
on the first ``--sampled_n`` held-out problems, its Wilson interval over the samples (samples of one problem are not
independent: read it as a lower bound on the width), and how many groups are mixed (some but not all samples right:
the groups GRPO learns from). For 1 digit also greedy on all 100 ordered problems 0..9 + 0..9 (training pairs
included: zero-shot they are equally unseen). Every completion is at most ``--max_new_tokens`` tokens, scored by the
task's reward (the first integer equals a + b).

    python bench/arith_zero_shot.py [--model smollm2-135m] [--digits 1 2] [--threads 1] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--digits", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--greedy_n", type=int, default=100)
    ap.add_argument("--sampled_n", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max_new_tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from tokendyn.policy import load_policy
    from tokendyn.tasks.arith.prompts import render_prompt
    from tokendyn.tasks.arith.reward import score
    from tokendyn.trainers.arith_eval import arith_outcomes, wilson
    from tokendyn.trainers.evaluate import generate

    model, tok = load_policy(args.model, dtype=torch.float32)
    print(f"model {args.model}; prompt of 3 + 5:\n{render_prompt(3, 5, tok)!r}")
    result = {"model": args.model, "settings": vars(args), "rows": []}
    for d in args.digits:
        t0 = time.process_time()
        greedy = arith_outcomes(model, tok, [d], args.greedy_n, max_new_tokens=args.max_new_tokens)
        k, n = int(sum(r["correct"] for r in greedy)), len(greedy)
        lo, hi = wilson(k, n)
        row = {"digits": d, "greedy_correct": k, "greedy_n": n, "greedy": k / n, "greedy_ci": [lo, hi]}
        row["greedy_wrong_examples"] = [
            f"{r['a']} + {r['b']} -> {r['completion']!r}" for r in greedy if not r["correct"]
        ][:5]
        sampled = arith_outcomes(
            model,
            tok,
            [d],
            args.sampled_n,
            args.temperature,
            args.samples,
            args.max_new_tokens,
            seed=args.seed,
        )
        ks, ns = int(sum(r["correct"] for r in sampled)), len(sampled)
        per = {}
        for r in sampled:
            per.setdefault(r["problem"], []).append(r["correct"])
        mixed = sum(0 < sum(v) < len(v) for v in per.values())
        row.update(
            sampled_correct=ks,
            sampled_n=ns,
            sampled=ks / ns,
            sampled_ci=list(wilson(ks, ns)),
            groups=len(per),
            mixed_groups=mixed,
        )
        if d == 1:  # every ordered 1-digit problem, greedy
            pairs = [(a, b) for a in range(10) for b in range(10)]
            texts, _ = generate(
                model, tok, [render_prompt(a, b, tok) for a, b in pairs], args.max_new_tokens, None
            )
            ka = int(sum(score(t, a + b) for t, (a, b) in zip(texts, pairs, strict=True)))
            row.update(
                all_pairs_greedy_correct=ka, all_pairs_n=100, all_pairs_greedy_ci=list(wilson(ka, 100))
            )
        row["cpu_s"] = round(time.process_time() - t0, 1)
        result["rows"].append(row)
        print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
