"""Cost of the exact update shares, as multiples of one training step measured in the same run.

On the embedded default policy (or, if it is not built yet, a random model of the same shape: Qwen2 hidden 128,
4 layers, 4/2 heads, MLP 512, vocab 870, tied embeddings, sdpa; its logits sharpened x6 through the final norm so
that pi spreads over (0, 1)) with a batch of 64 sequences of ~250 tokens, completions sampled from the model at T=0.7:

* train step: forward + backward + AdamW step of the same loss (clipped token-mean surrogate);
* per-bin shares: g_b for K=4 bins (one forward + one batched backward) and their norms / shares per layer;
  also with K separate backward passes;
* per-token JVP shares: one forward-mode JVP along g (SDPA math kernel), given g; and the whole per-token route
  (g from one forward + backward, then the JVP);
* for planning ``probe_every``: the counterfactual probability change (one SGD step of a copy) and the influence
  matrix (K + 1 counterfactual updates), timed once.

    python bench/share_cost.py [--batch 64] [--prompt 120] [--completion 130] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time


def timed(fn, repeats: int, warmup: bool = True) -> float:
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build():
    """The embedded default policy (shipped as package data)."""
    from tokendyn.policy import load_policy

    model, _ = load_policy()
    return model, "embedded default policy"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=120)
    ap.add_argument("--completion", type=int, default=130)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from tokendyn.effects.change import counterfactual_change
    from tokendyn.effects.influence import influence
    from tokendyn.effects.shares import as_edges, bin_gradients, bin_shares, token_shares
    from tokendyn.probe.tokenloss import Objective, ProbeBatch, bin_index, token_loss

    torch.set_num_threads(args.threads)
    model, what = build()
    vocab = model.config.vocab_size
    n, p, c = args.batch, args.prompt, args.completion
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, vocab, (n, p), generator=g)  # 0 is the pad id
    pmask = (torch.arange(p).unsqueeze(0) >= torch.randint(0, p // 4 + 1, (n, 1), generator=g)).long()
    if "random" in what:  # sharpen (logits x 6) so that the sampled tokens' pi spreads over the four bins
        with torch.no_grad():
            model.model.norm.weight.mul_(6.0)
    torch.manual_seed(0)
    with torch.no_grad():
        ids = model.eval().generate(
            input_ids=prompt,
            attention_mask=pmask,
            do_sample=True,
            temperature=0.7,
            top_k=0,
            top_p=1.0,
            min_new_tokens=c,
            max_new_tokens=c,
            pad_token_id=0,
        )
    lengths = torch.randint(c // 3, c + 1, (n,), generator=g)
    cmask = (torch.arange(c).unsqueeze(0) < lengths.unsqueeze(1)).long()
    attn = torch.cat([pmask, cmask], 1)
    adv = torch.randn(n, generator=g)
    objective = Objective(eps_low=0.2, eps_high=0.24)
    with torch.no_grad():
        old = token_loss(model.eval(), ProbeBatch(ids, attn, cmask, adv, temperature=0.7)).logp
    batch = ProbeBatch(ids, attn, cmask, adv, old_logp=old, temperature=0.7)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)

    def train_step():
        loss = token_loss(model, batch, objective).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    state: dict = {}

    def shares(method: str):
        def run():
            grads = bin_gradients(model, batch, objective=objective, method=method)
            bin_shares(grads)
            state["g"] = grads.total()

        return run

    def jvp():
        token_shares(model, batch, state["g"], objective=objective)

    def per_token_route():
        params = [q for q in model.parameters() if q.requires_grad]
        model.eval()
        grads = torch.autograd.grad(token_loss(model, batch, objective).loss, params)
        model.train()
        names = [nm for nm, q in model.named_parameters() if q.requires_grad]
        token_shares(model, batch, dict(zip(names, grads, strict=True)), objective=objective)

    print(f"model: {what}; {sum(q.numel() for q in model.parameters()) / 1e6:.2f}M parameters, vocab {vocab}")
    counts = torch.bincount(
        bin_index(torch.exp(old.double()), batch.completion_mask, as_edges(None))[batch.completion_mask],
        minlength=4,
    )
    print(f"completion tokens per bin of pi_old [0,.25,.5,.75,1]: {counts.tolist()}")
    print(
        f"batch: {n} sequences x {p + c} tokens ({p} prompt + {c} completion), {batch.n_tokens} completion tokens; "
        f"torch threads {args.threads}; median of {args.repeats} after a warm-up"
    )
    t_train = timed(train_step, args.repeats)
    print(f"{'training step (fwd + bwd + AdamW)':45s} {t_train:8.3f} s   1.00x", flush=True)
    rows = [
        ("per-bin shares, K=4, one batched backward", lambda: timed(shares("batched"), args.repeats)),
        ("per-bin shares, K=4, 4 backward passes", lambda: timed(shares("loop"), args.repeats)),
        ("per-token JVP shares (given g)", lambda: timed(jvp, args.repeats)),
        ("per-token route (g by fwd+bwd, then JVP)", lambda: timed(per_token_route, args.repeats)),
        (
            "counterfactual prob. change (1 SGD step)*",
            lambda: timed(lambda: counterfactual_change(model, batch), 1, False),
        ),
        ("influence matrix (K+1 = 5 SGD steps)*", lambda: timed(lambda: influence(model, batch), 1, False)),
    ]
    for name, run in rows:
        t = run()
        print(f"{name:45s} {t:8.3f} s   {t / t_train:.2f}x", flush=True)
    print("* timed once, no warm-up")


if __name__ == "__main__":
    main()
