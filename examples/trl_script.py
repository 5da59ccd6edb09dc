"""A plain TRL GRPO script with tokendyn's trainer swapped in: two lines change (the config class and the trainer
class), and the run gains Advantage Reweighting, Lopti and the gradient probe.

    python examples/trl_script.py --out runs/trl_script     # ~25 s on 2 CPU cores
    python examples/trl_script.py --out runs/trl_vllm --use_vllm   # vLLM samples (TRL's colocate mode), ~35 s
    tokendyn analyze runs/trl_script && tokendyn figures runs/trl_script

With ``--use_vllm`` the config gains ``use_vllm=True, vllm_mode="colocate"``: TRL's vLLM engine samples the rollouts
(on a CPU, vLLM's CPU build: `tokendyn.integrations.vllm_cpu`), in bf16 by vLLM's "auto" dtype for this float32
model, and TRL corrects the loss by pi_old / mu (its default ``sequence_mask``). run.json's ``sampler`` says what
sampled.

The policy is tokendyn's embedded default (a 1.1 M-parameter Qwen2 shipped with the package: no download); any
Hugging Face causal LM and tokenizer work the same. The reward is a toy: how many of the completion's characters are
digits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from datasets import Dataset

import tokendyn
from tokendyn import TokendynGRPOConfig, TokendynGRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer
from tokendyn.policy import load_policy
from tokendyn.trainers.callbacks import ParquetLogCallback, use_reward_bar


def digits(completions, **kwargs) -> list[float]:
    """Share of digit characters in each completion: a reward that differs within a group."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def main(out: str, steps: int, use_vllm: bool = False) -> None:
    model, tokenizer = load_policy()  # the embedded default; or AutoModelForCausalLM / AutoTokenizer
    prompts = [f"Count from {i} to {i + 5}:" for i in range(32)]
    config = TokendynGRPOConfig(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,  # TRL's default bf16=True autocasts on CPU; the probe wants the training dtype
        use_cpu=True,
        gradient_checkpointing=False,
        # the paper's remedies
        advantage_reweight_alpha=0.3,
        lopti_eta=0.5,
        # the probe: every step, with the rebalancing analyses on 4 sequences of each rollout batch
        probe_every=1,
        probe_sample_sequences=4,
        # the sampler: TRL's own generate, or its colocated vLLM engine (eager: it starts in seconds on a CPU)
        **(dict(use_vllm=True, vllm_mode="colocate", vllm_enforce_eager=True) if use_vllm else {}),
    )
    trainer = TokendynGRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[digits],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
    )
    # the training log (metrics.parquet) and run.json are what `tokendyn train` adds around the trainer; a script
    # adds them itself, so that `tokendyn figures` draws the training curves and names the run
    use_reward_bar(trainer)  # one bar with the reward on it, instead of a printed dict per step
    trainer.add_callback(
        ParquetLogCallback(Path(out) / "metrics.parquet", method="GRPO + Reweight + Lopti (TRL)")
    )
    Path(out).mkdir(parents=True, exist_ok=True)
    meta = {
        "method": "GRPO + Reweight + Lopti (TRL)",
        "config": config.to_dict(),
        "sampler": trainer.sampler_info,
    }
    (Path(out) / "run.json").write_text(json.dumps(meta, indent=2, default=str))
    trainer.train()

    run = tokendyn.load_run(out)
    print(f"{run.method}: {', '.join(run.kinds)}")
    print(run["metrics"].select("step", "reward", "lopti/stage1_fraction").collect())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/trl_script")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--use_vllm", action="store_true", help="sample with TRL's colocated vLLM engine")
    args = parser.parse_args()
    main(args.out, args.steps, args.use_vllm)
