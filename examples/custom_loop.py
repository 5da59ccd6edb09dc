"""A custom GRPO-style loop on a GPT-2 built locally, instrumented with tokendyn, then every figure.

    python examples/custom_loop.py --out runs/custom_loop            # ~20 s on 2 CPU cores
    tokendyn analyze runs/custom_loop                                 # the per-bin table and the bound report

The task is a toy with a verifiable reward: a completion earns the share of its tokens whose id is below VOCAB / 2. Each step
samples GROUP completions per prompt, takes group-normalised advantages (tokendyn.remedies.grpo_advantages), runs
tokendyn's rebalancing analyses on the batch, then one policy-gradient update under the probe.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import polars as pl
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import tokendyn
from tokendyn import ProbeBatch, ProbeConfig, grpo_advantages, instrument

VOCAB = 48  # token ids 0..47; the ids below VOCAB // 2 are the 'good' ones


def sample(
    model, prompts: torch.Tensor, length: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Completions of ``length`` tokens sampled at ``temperature`` and their log-probabilities there (log pi_old)."""
    seq, logps = prompts, []
    with torch.no_grad():
        for _ in range(length):
            logp = torch.log_softmax(model(seq).logits[:, -1] / temperature, -1)
            nxt = torch.multinomial(logp.exp(), 1)
            logps.append(logp.gather(1, nxt))
            seq = torch.cat([seq, nxt], 1)
    return seq, torch.cat(logps, 1)


def token_logps(model, seq: torch.Tensor, length: int, temperature: float) -> torch.Tensor:
    """log pi(o_t) of the last ``length`` tokens of ``seq`` at ``temperature``: the logits at position p(t), one
    before o_t, predict o_t."""
    logits = model(seq).logits[:, -length - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, seq[:, -length:, None])[..., 0]


def main(out: str, steps: int, prompts: int, group: int, length: int, figures: bool, seed: int = 0) -> None:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config).train()
    with torch.no_grad():  # a sharper head: sampled tokens' pi spread over (0, 1) as a trained policy's do
        model.lm_head.weight.mul_(8.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    temperature = 1.0
    t0 = time.time()
    config = ProbeConfig(lr_sweep=(1e-3, 1e-1, 1.0))  # every analysis, and the step-size sweep
    with instrument(
        model, out, config, recorder=True, method="GRPO (custom loop)", temperature=temperature
    ) as rec:
        for step in range(steps):
            prompt = torch.randint(0, VOCAB, (prompts, 4)).repeat_interleave(group, 0)
            seq, old_logp = sample(model, prompt, length, temperature)
            completion = seq[:, -length:]
            reward = (completion < VOCAB // 2).double().mean(1)
            advantages = grpo_advantages(reward, group)  # (B,): one per completion
            mask = torch.ones_like(completion, dtype=torch.bool)
            batch = ProbeBatch(
                input_ids=seq,
                attention_mask=torch.ones_like(seq),
                completion_mask=mask,
                advantages=advantages,
                old_logp=old_logp,
                temperature=temperature,
            )
            rec.analyze(batch, step=step)  # before the update: shares, probability change, influence
            logp = token_logps(model, seq, length, temperature)  # the forward the probe records
            rec.begin_step(step=step, completion_mask=mask, advantages=advantages, old_logp=old_logp,
                       completion_ids=completion, logps=logp, temperature=temperature)  # fmt: skip
            ratio = torch.exp(logp - old_logp)
            loss = -(ratio * advantages[:, None].to(ratio.dtype)).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            rec.end_step()
            rec.log(step + 1, reward=reward.mean(), accuracy=(reward >= 0.75).double().mean())
    print(f"trained {steps} steps in {time.time() - t0:.1f} s")

    run = tokendyn.load_run(out)
    print(f"{run.method}: record kinds {', '.join(run.kinds)}")
    shares = (  # the update share s_b = <g_b, g> / ||g||^2 of each probability bin, mean over the steps
        run["shares"]
        .filter((pl.col("group") == "all") & (pl.col("bin") >= 0))
        .group_by("bin", "bin_lo", "bin_hi")
        .agg(pl.col("share").mean())
        .sort("bin")
        .collect()
    )
    print(shares)
    if figures:
        from tokendyn.figures.report import build_report

        result = build_report([out], Path(out) / "figures")
        print(f"{len(result.figures)} figures; report: {result.path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/custom_loop")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--length", type=int, default=12)
    parser.add_argument("--no-figures", action="store_true")
    args = parser.parse_args()
    main(args.out, args.steps, args.prompts, args.group, args.length, not args.no_figures)
