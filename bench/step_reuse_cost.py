"""Time of `analyze_batch` with the lr sweep's point at the analyses' own lr read off the counterfactual update
already made (the default) and made again (``_reuse=False``, the separate computation), on the same model and batch,
in one run, one thread; the two interleaved, the median of each.

The analyses as `make demo` asks for them: shares with per-token shares, the influence matrix (K = 4 sources and the
all-token update, which is also the counterfactual update), the lr sweep (1e-3, 1e-1, 1, 10) with its lr -> 0 limit,
the float64 steps; once with one update stage and once with Lopti's two. The model: the tests' tiny Qwen2
(`tests/_rebalance.tiny_model`, hidden 32, 2 layers, vocab 97) or, with ``--hidden``/``--layers``, a wider one.

    python bench/step_reuse_cost.py [--rows 16] [--completion 24] [--repeats 5] [--hidden 32] [--layers 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--completion", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    import torch
    from _models import tiny_qwen2
    from _rebalance import VOCAB, tiny_batch

    from tokendyn.effects.influence import lopti_stage_masks
    from tokendyn.effects.rebalance import RebalanceOptions, analyze_batch

    torch.set_num_threads(1)
    model = tiny_qwen2(0, vocab=VOCAB, hidden=args.hidden, layers=args.layers, attn="eager", sharpen=20.0)
    model = model.float().train()
    batch = tiny_batch(model, n=args.rows, completion=args.completion, old_logp=True)
    masks = lopti_stage_masks(batch, eta=0.5)
    opts = RebalanceOptions(token_shares=4, lr_sweep=(1e-3, 1e-1, 1.0, 10.0))
    print(f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {VOCAB}; batch {args.rows} x "
          f"{args.completion} completion tokens; sweep {list(opts.lr_sweep)}; one thread")  # fmt: skip
    for label, stage_masks in (("one update stage", None), ("Lopti's two stages", masks)):

        def run(reuse: bool, stage_masks=stage_masks):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t0 = time.perf_counter()
                frames = analyze_batch(
                    model, batch, step=0, options=opts, stage_masks=stage_masks, _reuse=reuse
                )
                return time.perf_counter() - t0, frames

        run(True), run(False)  # warm-up
        reused, apart = [], []
        for _ in range(args.repeats):
            t, a = run(True)
            reused.append(t)
            t, b = run(False)
            apart.append(t)
        same = all(a[n].equals(b[n]) for n in ("prob_change", "influence"))
        r, s = statistics.median(reused), statistics.median(apart)
        print(f"{label}: reused {r:.3f} s, separate {s:.3f} s (medians of {args.repeats}); "
              f"ratio {r / s:.3f} (saving {100 * (1 - r / s):.1f} %); records equal: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
