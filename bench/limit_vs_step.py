"""The lr -> 0 limit against the paper's finite step: per bin of pi_old, the correct ratio and the
mean |delta pi| per unit lr at the limit (d pi / d lr at lr = 0, `tokendyn.effects.limit`) and after the counterfactual
SGD step at each `--lrs` (the paper's lr 1e-3 by default; float64 steps, as the analyses make them), on a batch of
the policy's own samples.

The batch: `--prompts` prompts x 2 samples at T = 1 (at most `--tokens` new tokens, cut after the first EOS), the two
samples of a prompt given advantages +1 and -1 (a GRPO group of two whose rewards differ: every sequence carries a
signal); the task the policy is trained on (the embedded default: K&K puzzles of 3 people; SmolLM2: sums of one- and
two-digit numbers, as `tokendyn demo --policy smollm2-135m`). pi_old fixed at the policy (float64), the trainer's
loss (clipped token-mean surrogate, eps 0.2, no KL). One thread.

    python bench/limit_vs_step.py                         # the embedded default, ~1 min
    python bench/limit_vs_step.py --model smollm2-135m    # the real LLM (30 layers, V = 49,152): ~10-20 min on CPU
    python bench/limit_vs_step.py --lrs 1e-4 1e-3 1e-2    # more finite steps beside the limit

Prints a markdown table (bin -1: all tokens); `first-order error` is max_t |lr x dpi_t/dlr - delta pi_t| / max_t
|delta pi_t|, how far the finite step is from its linearisation.
"""

from __future__ import annotations

import argparse
import time

import torch

T = 1.0


@torch.no_grad()
def own_samples(model, tok, task: str, prompts: int, tokens: int, seed: int):
    """(input ids, attention mask, completion mask, advantages): ``prompts`` x 2 samples, advantages +1 / -1."""
    if task == "kk":
        from tokendyn.tasks.kk.datasets import puzzles, trl_rows

        texts = [r["prompt"] for r in trl_rows(puzzles(3, 5, 0, prompts))]
    else:
        from tokendyn.tasks.arith.datasets import arith_problems
        from tokendyn.tasks.arith.prompts import render_prompt

        problems = arith_problems([1, 2], "train", seed=7, count=prompts // 2 + 1)  # one- and two-digit sums
        problems = (problems[: prompts // 2] + problems[-(prompts - prompts // 2) :])[:prompts]
        texts = [render_prompt(p.a, p.b, tok) for p in problems]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    torch.manual_seed(seed)
    out = model.generate(**enc, do_sample=True, temperature=T, top_p=1.0, top_k=0, max_new_tokens=tokens,
                         num_return_sequences=2, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)  # fmt: skip
    comp = out[:, enc["input_ids"].size(1) :]
    is_eos = (comp == tok.eos_token_id).long()
    cmask = (is_eos.cumsum(1) - is_eos) == 0  # up to and including the first EOS
    attn = torch.cat([enc["attention_mask"].repeat_interleave(2, 0), cmask.long()], 1)
    adv = torch.tensor([1.0, -1.0] * prompts, dtype=torch.float64)
    return out, attn, cmask, adv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default=None, help="a policy (default: the embedded default; e.g. smollm2-135m)"
    )
    ap.add_argument("--task", choices=("kk", "arith"), default=None, help="default: kk, arith for smollm2")
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-3])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from tokendyn.effects.change import counterfactual_change, delta_summary, fix_pi_old
    from tokendyn.effects.limit import limit_change
    from tokendyn.effects.shares import as_edges
    from tokendyn.policy import load_policy
    from tokendyn.probe.tokenloss import Objective, ProbeBatch, bin_index

    t0 = time.perf_counter()
    model, tok = load_policy(args.model, dtype=torch.float32)
    model.eval()
    task = args.task or ("arith" if args.model and "smollm2" in str(args.model) else "kk")
    ids, attn, cmask, adv = own_samples(model, tok, task, args.prompts, args.tokens, args.seed)
    objective = Objective(eps_low=0.2, eps_high=0.2)
    batch, _ = fix_pi_old(model, ProbeBatch(ids, attn, cmask, adv, temperature=T), precision="float64")
    edges = as_edges(None)
    bins = bin_index(torch.exp(batch.old_logp.double()), batch.completion_mask, edges)
    t_gen = time.perf_counter() - t0

    t0 = time.perf_counter()
    lim = limit_change(model, batch, objective=objective)
    t_lim = time.perf_counter() - t0
    steps, t_step = {}, {}
    for lr in args.lrs:
        t0 = time.perf_counter()
        steps[lr] = counterfactual_change(model, batch, lr=lr, objective=objective).delta["train"]
        t_step[lr] = time.perf_counter() - t0

    name = args.model or "embedded default"
    print(f"{name}: {batch.input_ids.size(0)} sequences, {batch.n_tokens} completion tokens ({task}, T = {T:g}); "
          f"sampling {t_gen:.0f} s, the limit {t_lim:.1f} s, "
          + ", ".join(f"the step at lr {lr:g} {t:.1f} s" for lr, t in t_step.items()))  # fmt: skip
    for lr, d in steps.items():
        err = float((lim.rate * lr - d).abs().max() / d.abs().max())
        print(f"first-order error at lr {lr:g}: {err:.2e}")
    head = ["bin (π_old)", "tokens", "A>0"]
    head += ["correct A>0: limit", *(f"lr {lr:g}" for lr in steps)]
    head += ["correct A<0: limit", *(f"lr {lr:g}" for lr in steps)]
    head += ["mean \\|Δπ\\|/lr: limit", *(f"lr {lr:g}" for lr in steps)]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for b in [-1, *range(edges.numel() - 1)]:
        mask = batch.completion_mask if b < 0 else bins == b
        at = {0.0: delta_summary(lim.rate, batch.advantages, mask)}
        at.update({lr: delta_summary(d, batch.advantages, mask) for lr, d in steps.items()})
        if not at[0.0]["count"]:
            continue
        label = (
            "all"
            if b < 0
            else f"[{float(edges[b]):g}, {float(edges[b + 1]):g}{']' if b == edges.numel() - 2 else ')'}"
        )
        row = [label, str(at[0.0]["count"]), str(at[0.0]["n_pos"])]
        row += [_pct(at[k]["correct_pos"]) for k in at]
        row += [_pct(at[k]["correct_neg"]) for k in at]
        row += [f"{at[k]['mean_abs'] / (k or 1.0):.3g}" for k in at]
        print("| " + " | ".join(row) + " |")


def _pct(x: float) -> str:
    return "n/a" if x != x else f"{100 * x:.1f} %"


if __name__ == "__main__":
    main()
