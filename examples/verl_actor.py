"""verl's own actor update with tokendyn inside: Reweight, Lopti's two stages and the probe, from the loss config.

    python examples/verl_actor.py --out runs/verl_actor      # ~40 s on 2 CPU cores
    tokendyn analyze runs/verl_actor && tokendyn figures runs/verl_actor

This runs verl 0.9's `TrainingWorker` (the actor's FSDP2 engine, `train_mini_batch`: what `update_actor` runs in
every worker of a `main_ppo` run) on the CPU without Ray (`tokendyn.integrations.verl.cpu`), on one rollout batch
sampled from tokendyn's embedded default policy. The only tokendyn-specific part is the policy-loss config, the same
fields a real run sets with `actor_rollout_ref.actor.policy_loss.*` overrides (docs/verl.md); the plugin that
`import verl` loads wraps the worker's update, so nothing else changes. Each update is Lopti's two full passes over
the batch (low-probability tokens first), every micro-batch probed into RUN_DIR/records, and the rebalancing
analyses run on the first 4 sequences before each stage, with verl's own loss as their objective.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

import tokendyn
from tokendyn import grpo_advantages
from tokendyn.cli import main as tokendyn_cli
from tokendyn.integrations import verl as tokendyn_verl
from tokendyn.integrations.verl import cpu
from tokendyn.policy import default_policy_dir, load_policy

TEMPERATURE = 0.7


def sample_rollouts(prompts: list[str], group: int, length: int, seed: int = 0):
    """``group`` sampled completions per prompt from the embedded policy at T: token lists, pi_old at T, and GRPO
    advantages of a toy reward (the share of vowels in the completion: graded, so the samples of a prompt differ and the
    analyses, which take the sequences with a non-zero advantage, have some)."""
    model, tok = load_policy()
    torch.manual_seed(seed)
    prompt_ids, response_ids, old = [], [], []
    for text in prompts:
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            seq = model.generate(
                ids.expand(group, -1), do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                max_new_tokens=length, min_new_tokens=length, pad_token_id=tok.pad_token_id,
            )  # fmt: skip
            logits = model(seq).logits[:, ids.shape[1] - 1 : -1].float() / TEMPERATURE
        responses = seq[:, ids.shape[1] :]
        old.append(torch.log_softmax(logits, -1).gather(-1, responses[..., None])[..., 0])
        prompt_ids += [ids[0].tolist()] * group
        response_ids += responses.tolist()
    texts = tok.batch_decode(torch.tensor(response_ids), skip_special_tokens=True)
    reward = torch.tensor([sum(c in "aeiou" for c in t) / max(len(t), 1) for t in texts], dtype=torch.float64)
    adv = grpo_advantages(reward, group).float()[:, None].expand(-1, length)  # consecutive groups of `group`
    return prompt_ids, response_ids, torch.cat(old), adv, tok.pad_token_id


def main(out: str, prompts: int, group: int, length: int, updates: int) -> None:
    prompt_ids, response_ids, old, adv, pad = sample_rollouts(
        [f"Count from {i} to {i + 5}:" for i in range(prompts)], group, length
    )
    # what a verl run sets with actor_rollout_ref.actor.policy_loss.* overrides
    policy_loss = tokendyn_verl.TokendynPolicyLossConfig(
        base_loss_mode="vanilla",  # any registered verl loss mode
        reweight_alpha=0.3,  # Advantage Reweighting
        lopti_eta=0.5,  # Lopti: two updates per batch, pi_old < 0.5 first
        probe_dir=out,  # the probe: records of every micro-batch
        probe_options={"bins": "intervals:4", "direct_every": 4, "sample_sequences": 4},
        probe_analyses_every=1,  # update shares, the counterfactual change: verl's own loss as the objective
    )
    actor = cpu.actor_config(micro_batch_size=4, policy_loss=policy_loss)
    tokendyn_verl.register()  # what the plugin does when verl is imported (idempotent)
    worker = cpu.build_worker(
        default_policy_dir(), partial(_ppo_loss(), config=actor), use_remove_padding=True, micro_batch_size=4,
        lr=1e-5, optimizer="AdamW",
    )  # fmt: skip
    for update in range(updates):
        batch = cpu.make_batch(
            prompt_ids, response_ids, old_log_probs=old, advantages=adv, temperature=TEMPERATURE,
            pad_token_id=pad,
        )  # fmt: skip
        metrics = cpu.update_actor(worker, batch)
        for stage in ("low", "high"):
            key = f"actor/tokendyn/{stage}/grad_sq_share/bin"
            shares = " ".join(f"{float(metrics[key + str(b)][0]):.3f}" for b in range(4))
            loss = float(metrics["actor/pg_loss"][0 if stage == "low" else 1])
            print(
                f"update {update}, Lopti stage {stage}: pg_loss {loss:+.4f}, grad^2 share per pi_old bin {shares}"
            )
    worker._tokendyn_probe.detach()  # flush the records (a verl worker does it at exit)
    run = tokendyn.load_run(out)
    print(f"{run.method}: {', '.join(run.kinds)}")
    code = tokendyn_cli(["analyze", out])
    if code:
        raise SystemExit(code)


def _ppo_loss():
    from verl.workers.utils.losses import ppo_loss

    return ppo_loss


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/verl_actor")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--updates", type=int, default=2)
    args = parser.parse_args()
    main(args.out, args.prompts, args.group, args.length, args.updates)
