"""A rollouts file from a verl-style batch, then `tokendyn probe` on it: the diagnosis for another RL stack.

    python examples/verl_rollouts.py --out runs/verl_probe       # ~15 s on 2 CPU cores
    tokendyn analyze runs/verl_probe && tokendyn figures runs/verl_probe

verl keeps a rollout batch as a `DataProto` whose ``.batch`` maps names to tensors: ``prompts`` (left-padded),
``responses`` (right-padded), ``attention_mask`` over both, ``response_mask``, ``advantages`` and ``old_log_probs``
(per response token, at the rollout temperature). Here that batch is built by sampling from tokendyn's embedded
default policy (no download); with verl, take ``batch.batch`` after the advantages are computed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl
import torch

import tokendyn
from tokendyn import grpo_advantages
from tokendyn.cli import main as tokendyn_cli
from tokendyn.policy import load_policy

TEMPERATURE = 0.7


def verl_style_batch(prompts: list[str], group: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Sample ``group`` completions per prompt and return the tensors verl's ``DataProto.batch`` holds."""
    model, tok = load_policy()
    tok.padding_side = "left"
    torch.manual_seed(seed)
    enc = tok([p for p in prompts for _ in range(group)], return_tensors="pt", padding=True)
    with torch.no_grad():
        seq = model.generate(
            **enc, do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0, max_new_tokens=length,
            min_new_tokens=length, pad_token_id=tok.pad_token_id,
        )  # fmt: skip
        p = enc["input_ids"].shape[1]
        responses = seq[:, p:]
        attention = torch.cat([enc["attention_mask"], torch.ones_like(responses)], 1)
        logits = model(seq, attention_mask=attention).logits[:, p - 1 : -1].float() / TEMPERATURE
        old = torch.log_softmax(logits, -1).gather(-1, responses[..., None])[..., 0]
    text = tok.batch_decode(responses, skip_special_tokens=True)
    reward = torch.tensor([sum(c.isdigit() for c in t) / max(len(t), 1) for t in text], dtype=torch.float64)
    response_mask = torch.ones_like(responses)
    return {
        "prompts": enc["input_ids"],
        "responses": responses,
        "attention_mask": attention,
        "response_mask": response_mask,
        "advantages": grpo_advantages(reward, group)[:, None]
        * response_mask,  # per token, as verl stores them
        "old_log_probs": old,
    }


def write_rollouts(b: dict[str, torch.Tensor], path: str | Path, temperature: float) -> None:
    """The rollouts file `tokendyn probe` reads (docs/records.md, "Rollouts file"), from verl's tensors."""
    p = b["prompts"].shape[1]  # input_ids = cat(prompts, responses)
    attn = b["attention_mask"]
    pl.DataFrame({
        "prompt_ids": b["prompts"].tolist(),          "prompt_mask": attn[:, :p].tolist(),
        "completion_ids": b["responses"].tolist(),    "completion_mask": attn[:, p:].tolist(),
        "loss_mask": b["response_mask"].tolist(),
        "advantage": b["advantages"].tolist(),        # per token
        "old_logp": b["old_log_probs"].tolist(),      # at the rollout temperature
        "temperature": [temperature] * len(b["responses"]),
    }).write_parquet(path)  # fmt: skip


def main(out: str, prompts: int, group: int, length: int) -> None:
    batch = verl_style_batch([f"Count from {i} to {i + 5}:" for i in range(prompts)], group, length)
    rollouts = Path(out).with_suffix(".rollouts.parquet")
    rollouts.parent.mkdir(parents=True, exist_ok=True)
    write_rollouts(batch, rollouts, TEMPERATURE)
    print(f"wrote {rollouts} ({len(batch['responses'])} completions)")
    code = tokendyn_cli(["probe", "--rollouts", str(rollouts), "--out", out, "--sample_sequences", "4"])
    if code:
        raise SystemExit(code)
    run = tokendyn.load_run(out)
    print(f"{run.method}: {', '.join(run.kinds)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/verl_probe")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--length", type=int, default=16)
    args = parser.parse_args()
    main(args.out, args.prompts, args.group, args.length)
