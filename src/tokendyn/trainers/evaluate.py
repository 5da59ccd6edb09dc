"""Held-out K&K evaluation of a policy: per-difficulty accuracy, format rate, mean reward,
greedy and sampled, and the probability histogram of sampled completion tokens."""

from __future__ import annotations

from dataclasses import dataclass

PAPER_BINS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class EvalResult:
    people: int
    mode: str  # "greedy" or "T=0.7"
    n: int
    accuracy: float
    format_valid: float
    mean_reward: float
    token_probs: list[float]  # pi of every sampled completion token (sampled mode only)

    def row(self) -> dict:
        return {
            "people": self.people,
            "mode": self.mode,
            "n": self.n,
            "accuracy": self.accuracy,
            "format_valid": self.format_valid,
            "mean_reward": self.mean_reward,
        }


def max_new_tokens_for(people: int) -> int:
    """Room for the reasoning and the answer: about 40 tokens per person plus slack."""
    return 64 + 40 * people


def bin_shares(probs, edges=PAPER_BINS) -> list[float]:
    """Share of tokens with pi in [e_k, e_{k+1}) (the last bin closed: pi = 1 included)."""
    import numpy as np

    p = np.asarray(probs, dtype=np.float64)
    if p.size == 0:
        return [0.0] * (len(edges) - 1)
    idx = np.clip(np.searchsorted(np.asarray(edges[1:-1]), p, side="right"), 0, len(edges) - 2)
    return [float((idx == k).mean()) for k in range(len(edges) - 1)]


def generate(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float | None,
    batch_size: int = 64,
    seed: int = 0,
):
    """Completions (text) and, when sampling, the probability at ``temperature`` of each
    sampled completion token (up to and including the first EOS)."""
    import torch

    texts, probs = [], []
    eos = tokenizer.eos_token_id
    torch.manual_seed(seed)
    model.eval()
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        enc = tokenizer(chunk, return_tensors="pt", padding=True, padding_side="left").to(model.device)
        kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
        if temperature:
            kwargs.update(
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        else:
            kwargs.update(do_sample=False, top_k=None, top_p=None, temperature=None)
        with torch.no_grad():
            out = model.generate(**enc, **kwargs)
        seqs = out.sequences if temperature else out
        comp = seqs[:, enc["input_ids"].shape[1] :]
        # completion mask: up to and including the first EOS
        is_eos = comp == eos
        first = torch.where(
            is_eos.any(1),
            is_eos.int().argmax(1),
            torch.full_like(is_eos[:, 0], comp.shape[1], dtype=torch.long),
        )
        at = torch.arange(comp.shape[1], device=comp.device)[None, :]
        mask = (at <= first[:, None]) & (at < comp.shape[1])
        if temperature:
            logits = torch.stack(out.logits, 1).float() / temperature
            lp = torch.log_softmax(logits, -1).gather(-1, comp[..., None])[..., 0]
            probs.extend(lp.exp()[mask].tolist())
        texts.extend(tokenizer.batch_decode(comp, skip_special_tokens=True))
    return texts, probs


def evaluate(
    model,
    tokenizer,
    people: list[int],
    n: int = 100,
    temperature: float = 0.7,
    modes=("greedy", "sampled"),
    seed: int = 0,
    template: str = "qwen-instruct",
    batch_size: int = 64,
    on_result=None,
) -> list[EvalResult]:
    """Accuracy (reward == 3), format-valid rate and mean reward on the first ``n`` held-out
    puzzles of each size, greedy and/or sampled at ``temperature``. ``on_result(result)`` is called after each
    (size, mode) (a progress bar)."""
    from ..tasks.kk.datasets import heldout
    from ..tasks.kk.prompts import render_prompt
    from ..tasks.kk.reward import compute_score

    results = []
    for k in people:
        items = list(heldout(k))[:n]
        prompts = [render_prompt(p.quiz, template) for p in items]
        for mode in modes:
            temp = None if mode == "greedy" else temperature
            texts, probs = generate(model, tokenizer, prompts, max_new_tokens_for(k), temp, batch_size, seed)
            scores = [
                compute_score(pr + t, p.solution_text_format)
                for pr, t, p in zip(prompts, texts, items, strict=True)
            ]
            results.append(
                EvalResult(
                    people=k,
                    mode="greedy" if temp is None else f"T={temperature:g}",
                    n=len(items),
                    accuracy=sum(s.correct for s in scores) / len(scores),
                    format_valid=sum(s.format_ok for s in scores) / len(scores),
                    mean_reward=sum(s.total for s in scores) / len(scores),
                    token_probs=probs,
                )
            )
            if on_result is not None:
                on_result(results[-1])
    return results


def puzzle_outcomes(
    model,
    tokenizer,
    people: list[int],
    n: int,
    temperature: float = 0.7,
    seed: int = 0,
    modes=("greedy", "sampled"),
) -> list[dict]:
    """One row per (size, mode, held-out puzzle): the first ``n`` official test puzzles of each size, greedy and/or
    sampled at ``temperature``: {"people", "mode", "puzzle", "correct", "format_ok", "reward"} (for intervals over
    puzzles; `evaluate` gives the aggregates)."""
    from ..tasks.kk.datasets import heldout
    from ..tasks.kk.prompts import render_prompt
    from ..tasks.kk.reward import compute_score

    rows = []
    for k in people:
        items = list(heldout(k))[:n]
        prompts = [render_prompt(p.quiz) for p in items]
        for mode in modes:
            temp = None if mode == "greedy" else temperature
            texts, _ = generate(model, tokenizer, prompts, max_new_tokens_for(k), temp, seed=seed)
            for j, (pr, t, p) in enumerate(zip(prompts, texts, items, strict=True)):
                s = compute_score(pr + t, p.solution_text_format)
                rows.append(
                    {
                        "people": k,
                        "mode": "greedy" if temp is None else f"T={temperature:g}",
                        "puzzle": j,
                        "correct": int(s.correct),
                        "format_ok": int(s.format_ok),
                        "reward": float(s.total),
                    }
                )
    return rows


def token_histogram(probs, edges=(0.0, 0.25, 0.5, 0.75, 1.0)) -> list[float]:
    """Share of sampled tokens per probability bin, the paper's Fig. 1a: bins [e_i, e_i+1), the last one closed;
    ``probs`` the probability of each sampled token at the sampling temperature (`generate`)."""
    import numpy as np

    p = np.asarray(probs, dtype=np.float64)
    if p.size == 0:
        raise ValueError("token_histogram: no sampled tokens")
    counts, _ = np.histogram(p, bins=np.asarray(edges, dtype=np.float64))  # numpy's last bin is closed
    return (counts / p.size).tolist()
