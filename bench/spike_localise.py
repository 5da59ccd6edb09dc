"""The tokens behind a spike: the exact update shares against a GradLoc-style binary search, on the same planted spike.

The planted spike (tests/_spike.py): the model's own samples to K&K prompts (or, for SmolLM2, to short chat
questions); in one completion a token at pi ~ 1e-4 is put in and given the advantage 3, every other completion +-0.1.

* update shares (`tokendyn.effects.spike.spike_tokens`): g by one forward + backward of the whole batch, then every
  token's s_t = <grad l_t, g> / ||g||^2 by one forward-mode JVP along g; every token ranked.
* binary search (GradLoc's approach, written here): the gradient norm of each half of the sequences (a forward and a
  backward of each half), recursing into the half with the larger norm down to one sequence; then, on that sequence
  (one forward), the gradient norm of each half of its tokens (a backward of each half's terms), down to one token.
  Every half's loss keeps the whole batch's normaliser (token mean over the batch), so the halves' gradients add up
  to the batch's. It names one token.

Both run on the same batch in the same process; each timed as the median of ``--repeats`` runs after one warm-up.

    python bench/spike_localise.py [--model default|smollm2-135m] [--prompts 4] [--per-prompt 2] [--tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _spike import plant_spike  # noqa: E402

from tokendyn.effects.shares_sums import dot64  # noqa: E402
from tokendyn.effects.spike import spike_tokens  # noqa: E402
from tokendyn.policy import load_policy  # noqa: E402
from tokendyn.probe.tokenloss import ProbeBatch, eval_mode, token_loss, trainable_parameters  # noqa: E402


class Counter:
    def __init__(self) -> None:
        self.forward = self.backward = 0


def rows_of(batch: ProbeBatch, rows: list[int]) -> ProbeBatch:
    """The sub-batch of ``rows``, with the whole batch's normaliser (its loss is the sum of those rows' terms)."""
    idx = torch.tensor(rows)
    return ProbeBatch(batch.input_ids[idx], batch.attention_mask[idx], batch.completion_mask[idx],
                      batch.advantages[idx], temperature=batch.temperature, normalizer=batch.norm)  # fmt: skip


def grad_norm(model, terms: torch.Tensor, select: torch.Tensor | None, n: Counter, retain: bool) -> float:
    """||grad sum_{t in select} l_t|| by one backward."""
    params = list(trainable_parameters(model).values())
    out = terms.sum() if select is None else (terms * select).sum()
    grads = torch.autograd.grad(out, params, retain_graph=retain, allow_unused=True)
    n.backward += 1
    return sum(dot64(g, g) for g in grads if g is not None) ** 0.5


def binary_search(model, batch: ProbeBatch, n: Counter) -> tuple[int, int]:
    """(row, pos) of the one token the search ends on (module docstring)."""
    rows = list(range(batch.input_ids.size(0)))
    with eval_mode(model):
        while len(rows) > 1:
            halves = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
            norms = []
            for half in halves:
                terms = token_loss(model, rows_of(batch, half)).terms
                n.forward += 1
                norms.append(grad_norm(model, terms, None, n, retain=False))
            rows = halves[int(norms[1] > norms[0])]
        one = rows_of(batch, rows)
        terms = token_loss(model, one).terms
        n.forward += 1
        pos = one.completion_mask[0].nonzero().flatten().tolist()
        while len(pos) > 1:
            halves = [pos[: len(pos) // 2], pos[len(pos) // 2 :]]
            norms = []
            for half in halves:
                sel = torch.zeros_like(terms)
                sel[0, half] = 1.0
                norms.append(grad_norm(model, terms, sel, n, retain=True))
            pos = halves[int(norms[1] > norms[0])]
    return rows[0], pos[0]


def timed(fn, repeats: int):
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default", help="default (the embedded policy) or smollm2-135m")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--per-prompt", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="max new tokens per completion")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    if a.model not in ("default", "smollm2-135m"):
        raise SystemExit(f"--model must be one of default, smollm2-135m, got {a.model!r}")
    for name in ("prompts", "per_prompt", "tokens", "repeats", "threads"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    torch.set_num_threads(a.threads)
    model, tok = load_policy(None if a.model == "default" else a.model, dtype=torch.float32)
    model.eval()
    if a.model == "default":
        from tokendyn.tasks.kk.datasets import puzzles, trl_rows

        prompts = [r["prompt"] for r in trl_rows(puzzles(3, a.prompts, 0, a.prompts))]
    else:
        qs = [
            "What is 7 + 5?",
            "Name a colour.",
            "Say hello.",
            "Count to three.",
            "Spell cat.",
            "Name a fruit.",
        ]
        prompts = [tok.apply_chat_template([{"role": "user", "content": qs[i % len(qs)]}], tokenize=False,
                                           add_generation_prompt=True) for i in range(a.prompts)]  # fmt: skip
    p = plant_spike(model, tok, prompts, n_return=a.per_prompt, max_new_tokens=a.tokens)
    b = p.batch
    truth = (p.row, p.pos)
    print(f"model: {a.model}, {sum(x.numel() for x in model.parameters()) / 1e6:.1f} M parameters, float32, "
          f"{a.threads} thread(s) on 2 CPU cores")  # fmt: skip
    print(
        f"batch: {b.input_ids.size(0)} sequences x {b.input_ids.size(1)} columns, {b.n_tokens} scored tokens"
    )
    print(f"planted token: sequence {p.row}, position {p.pos}, {p.text!r}, pi {p.pi:.2e}, advantage 3.0 "
          f"(others +-0.1)")  # fmt: skip

    t_shares, found = timed(lambda: spike_tokens(model, b), a.repeats)
    counts = Counter()
    t_search, named = timed(lambda: binary_search(model, b, Counter()), a.repeats)
    binary_search(model, b, counts)
    rank_shares = found.rank_of(*truth)
    rank_search = 1 if tuple(named) == truth else None
    rows = [
        ("update shares (1 JVP)", rank_shares, b.n_tokens, 1, 1, 1, t_shares),
        ("binary search (GradLoc)", rank_search, 1, counts.forward, counts.backward, 0, t_search),
    ]
    print(f"\n{'method':26} {'planted rank':>12} {'tokens named':>12} {'forwards':>8} {'backwards':>9} "
          f"{'JVPs':>4} {'wall s':>7}")  # fmt: skip
    for name, rank, n_named, fw, bw, jvp, t in rows:
        r = "-" if rank is None else str(rank)
        print(f"{name:26} {r:>12} {n_named:>12} {fw:>8} {bw:>9} {jvp:>4} {t:>7.2f}")
    if tuple(named) != truth:
        print(f"binary search ended on sequence {named[0]}, position {named[1]} "
              f"(its rank by share: {found.rank_of(*named)})")  # fmt: skip
    print(f"\nbinary search / update shares: {counts.backward} backwards vs 1 backward + 1 JVP "
          f"({counts.backward / 2:.1f}x the passes), wall {t_search / t_shares:.2f}x")  # fmt: skip
    top = ", ".join(f"{found.shares[r, j]:.3f}" for r, j in found.top(3).tolist())
    print(f"top 3 shares: {top} (planted first); sum of all shares {float(found.shares.sum()):.6f}")


if __name__ == "__main__":
    main()
