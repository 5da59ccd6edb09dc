"""What the token view costs per probed step: time, as ratios measured in one run, and bytes.

On the embedded default policy (its tokenizer decodes the view's tokens) with an analysis sample of ``--rows``
sequences of ``--prompt`` + ``--completion`` tokens (completions sampled from the model at T = 0.7, GRPO advantages
of random rewards), it times:

* the analyses as the trainer runs them by default (shares, token_shares, prob_change, influence) with the view off
  and with it on for ``--view`` sequences: their difference is the view's cost (the head ratios' backbone forward and
  float64 pass over the LM head, the decoding, the frame);
* the view's own work alone (the head ratios of its sequences and their decoding);
* one training step of the same rows (forward + backward of the clipped token-mean surrogate), as the scale;

and writes the view's records once, printing the Parquet bytes per token and per probed step.

    python bench/view_cost.py [--rows 8] [--view 4] [--prompt 120] [--completion 130] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from share_cost import timed  # median of repeats after one warm-up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--view", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=120)
    ap.add_argument("--completion", type=int, default=130)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from tokendyn.effects.rebalance import RebalanceOptions, analyze_batch
    from tokendyn.effects.token_view import head_ratios, token_texts
    from tokendyn.policy import load_policy
    from tokendyn.probe.tokenloss import ProbeBatch, token_loss
    from tokendyn.records import write_frames

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = load_policy()
    model.train()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.rows, args.prompt))
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.completion,
            min_new_tokens=args.completion,
            do_sample=True,
            temperature=0.7,
            pad_token_id=tok.pad_token_id,
        )
    rewards = torch.rand(args.rows)
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    batch = ProbeBatch(
        input_ids=out,
        attention_mask=torch.ones_like(out),
        completion_mask=torch.ones(args.rows, args.completion, dtype=torch.bool),
        advantages=adv,
        temperature=0.7,
    )
    off, on = RebalanceOptions(), RebalanceOptions(view_sequences=args.view)

    def step():
        model.zero_grad(set_to_none=True)
        token_loss(model, batch).loss.backward()
        model.zero_grad(set_to_none=True)

    t_step = timed(step, args.repeats)
    t_off = timed(lambda: analyze_batch(model, batch, step=0, options=off, tokenizer=tok), args.repeats)
    t_on = timed(lambda: analyze_batch(model, batch, step=0, options=on, tokenizer=tok), args.repeats)
    view = batch.select(slice(0, args.view))

    def own_work():  # what the view adds to the analyses: the head ratios and the decoding
        head_ratios(model, view)
        for row in view.completion_ids.tolist():
            token_texts(tok, row)

    t_own = timed(own_work, args.repeats)
    frames = analyze_batch(model, batch, step=0, options=on, tokenizer=tok)
    with tempfile.TemporaryDirectory() as d:
        write_frames(d, {"token_view": frames["token_view"]}, rank=0)
        size = sum(f.stat().st_size for f in Path(d, "records").glob("token_view-*.parquet"))
    n = frames["token_view"].height
    print(
        f"policy: embedded default, {args.rows} x ({args.prompt} + {args.completion}) tokens, view {args.view}"
    )
    print(f"training step (forward + backward)      {t_step:8.3f} s")
    print(f"analyses, view off                      {t_off:8.3f} s  ({t_off / t_step:.2f}x the step)")
    print(f"analyses, view on                       {t_on:8.3f} s  ({t_on / t_step:.2f}x the step)")
    print(
        f"the view, on minus off                  {t_on - t_off:8.3f} s  ({(t_on - t_off) / t_step:+.3f}x the step, "
        f"{(t_on - t_off) / t_off:+.1%} of the analyses; within their noise when small)"
    )
    print(f"the view's own work, timed alone        {t_own:8.3f} s  ({t_own / t_step:.3f}x the step, "
          f"{t_own / t_off:.1%} of the analyses)")  # fmt: skip
    print(f"token_view records: {n} rows, {size} bytes per probed step ({size / n:.0f} bytes per token)")


if __name__ == "__main__":
    main()
