"""Cost of the rebalancing analyses and of the paired comparison at a real vocabulary (V = 32,000), as ratios to
the update phase of one rollout: the part of a probed step they add to, with the LM head no longer negligible.

The model is a random untied Qwen2 (`memory.build_model`, float32; hidden and layers reduced so that a CPU fits),
the rollout `--rollout` rows of `--prompt` + `--completion` random tokens (`memory.make_batch`). The update phase is
a custom loop's: micro-batches of `--micro` rows, each forward with visible logits, log pi_t at T = 0.7, the clipped
loss on-policy, backward, then one AdamW step (`probe_vocab_cost.train_step` without its optimizer step per
micro-batch). The analyses run on the first `--sample` rows, as the trainer runs them on its analysis sample
(`analyze_update`: shares, per-token shares, the counterfactual update, the influence matrix, the token view), and
the comparison on the same rows (`compare_rules`: base, Reweight, Lopti; equal_norm, then both modes with a copy
of the AdamW state). Every ratio is of medians measured in this one run (this machine is noisy: compare ratios).

    python bench/analysis_vocab_cost.py                 # V = 32k, a rollout of 64, sample 8, ~3 min on 2 cores
    python bench/analysis_vocab_cost.py --vocab 152064  # Qwen2's vocabulary
"""

from __future__ import annotations

import argparse

import torch
from memory import Size, build_model, make_batch
from probe_vocab_cost import T, clipped_loss
from share_cost import timed  # median of repeats


def update_phase(model, opt, batch: dict, c_len: int, micro: int) -> None:
    """Gradient accumulation over micro-batches of ``micro`` rows (the loss of each scaled by its share of the
    rows), then one AdamW step."""
    rows = batch["input_ids"].size(0)
    for lo in range(0, rows, micro):
        b = {k: v[lo : lo + micro] for k, v in batch.items()}
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        logp = torch.log_softmax(logits[:, -c_len - 1 : -1] / T, -1)
        logp = logp.gather(-1, b["completion_ids"].unsqueeze(-1)).squeeze(-1)
        loss = clipped_loss(logp, b["advantages"], b["completion_mask"]) * (b["input_ids"].size(0) / rows)
        loss.backward()
        del logits, logp, loss
    opt.step()
    opt.zero_grad(set_to_none=True)


@torch.no_grad()
def sampled_completions(model, batch: dict, c_len: int, head_scale: float, seed: int = 0) -> dict:
    """The batch with its completion tokens drawn from the model at T (each position from the logits of the random
    prefix, one forward) after the LM head is scaled by ``head_scale``: a random model's pi of a random token is
    ~1/V, every token in the lowest bin; scaled and sampled, the tokens spread over the bins as a policy's do."""
    model.lm_head.weight.mul_(head_scale)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    probs = torch.softmax(logits[:, -c_len - 1 : -1].double() / T, -1)
    g = torch.Generator().manual_seed(seed)
    drawn = torch.multinomial(probs.reshape(-1, probs.size(-1)), 1, generator=g).reshape(probs.shape[:2])
    ids = batch["input_ids"].clone()
    ids[:, -c_len:] = drawn
    return {**batch, "input_ids": ids, "completion_ids": drawn}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--completion", type=int, default=192)
    ap.add_argument(
        "--rollout", type=int, default=64, help="rows of the rollout (the embedded default: 8 x 8)"
    )
    ap.add_argument("--micro", type=int, default=8, help="rows per micro-batch of the update phase")
    ap.add_argument("--sample", type=int, default=8, help="rows of the analysis sample")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--head-scale", type=float, default=40.0, help="LM head scale (spreads pi over the bins)")
    args = ap.parse_args()

    from tokendyn.effects.compare import compare_rules, make_rule
    from tokendyn.effects.rebalance import RebalanceOptions, analyze_update
    from tokendyn.probe.tokenloss import Objective, ProbeBatch

    torch.manual_seed(0)
    s = Size(
        layers=args.layers,
        hidden=args.hidden,
        vocab=args.vocab,
        completion=args.completion,
        prompt=args.prompt,
        rows=args.micro,
        sample=args.sample,
    )
    model = build_model(s)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rollout = sampled_completions(model, make_batch(s, args.rollout), s.completion, args.head_scale)
    update_phase(
        model, opt, rollout, s.completion, args.micro
    )  # warm-up, and an AdamW state for the optimizer mode
    plain = timed(
        lambda: update_phase(model, opt, rollout, s.completion, args.micro), args.repeats, warmup=False
    )

    sample = {k: v[: args.sample] for k, v in rollout.items()}
    batch = ProbeBatch(
        sample["input_ids"],
        sample["attention_mask"],
        sample["completion_mask"],
        sample["advantages"].to(torch.float64),
        temperature=T,
    )
    objective = Objective(eps_low=0.2, eps_high=0.28, loss_type="dapo")
    opts = RebalanceOptions(view_sequences=4)
    rules = [make_rule(n, objective) for n in ("base", "reweight", "lopti")]
    model.eval()
    held: dict = {}

    def analyses():
        held["frames"], held["full"] = analyze_update(model, batch, step=0, options=opts, objective=objective)

    def compare(names, modes, full=True):
        def run():
            chosen = [r for r in rules if r.name in names]
            compare_rules(
                model, batch, chosen, modes=modes, lr=1e-3, optimizer=opt, full=held["full"] if full else None
            )

        return run

    analyses()  # warm-up (the head split's one check)
    t_analyses = timed(analyses, args.repeats, warmup=False)
    rows = [("every analysis", t_analyses)]
    for label, names, modes in (
        ("+ compare base, equal_norm", ("base",), ("equal_norm",)),
        ("+ compare base, reweight, lopti, equal_norm", ("base", "reweight", "lopti"), ("equal_norm",)),
        (
            "+ compare base, reweight, lopti, both modes",
            ("base", "reweight", "lopti"),
            ("equal_norm", "optimizer"),
        ),
    ):
        rows.append((label, t_analyses + timed(compare(names, modes), args.repeats, warmup=False)))
    model.train()

    print(
        f"V = {s.vocab:,}, {s.layers} layers, hidden {s.hidden}; rollout {args.rollout} x ({s.prompt} + "
        f"{s.completion}) tokens in micro-batches of {args.micro}; analysis sample {args.sample} rows; "
        f"medians of {args.repeats}"
    )
    inf = held["frames"]["influence"]
    tokens = inf.filter((inf["source_bin"] == -1) & (inf["target_bin"] >= 0))
    spread = ", ".join(f"{c}" for c in tokens.sort("target_bin")["count"].to_list())
    print(f"sampled tokens of the analysis sample per bin of pi_old (quarters): {spread}")
    print(f"update phase of one rollout: {plain:.2f} s")
    print(f"{'':<46} {'seconds':>8} {'/ update phase':>15}")
    for label, t in rows:
        print(f"{label:<46} {t:>8.2f} {t / plain:>15.3f}")
    base, three = rows[1][1], rows[2][1]
    print(f"each further compared rule (equal_norm): +{(three - base) / 2 / plain:.3f} x the update phase")


if __name__ == "__main__":
    main()
