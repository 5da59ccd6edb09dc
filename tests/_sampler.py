"""A sampler outside the trainer, for the tests that need a sampler's own log-probs: TRL's ``rollout_func`` (its hook
for an external sampler, which hands back completions and their log-probs as a vLLM server does), sampling with a
plain torch loop from the trainer's current model in eval mode, on a generator of its own (torch's global RNG
untouched), so that the trainer keeps them as ``sampling_per_token_logps`` and the probe's `sampler` records read
them."""

from __future__ import annotations

import torch


def rollout_sampler(temperature: float, max_completion: int, top_p: float = 1.0):
    """TRL's ``rollout_func``: one completion per prompt row (TRL has repeated each prompt ``num_generations``
    times), up to ``max_completion`` tokens, ending at eos, sampled token by token at the temperature on a generator
    seeded by the step. With ``top_p`` < 1 it samples from the nucleus the vLLM way (the most probable tokens while
    the mass above them is < top_p, in float64) and returns vLLM's processed log-probs, log q - log S; at 1 every
    token is kept and the log-prob is log q. Returns the prompt ids, the completion ids and each sampled token's
    log-prob."""

    def sample(prompts: list[str], trainer) -> dict:
        tok, model = trainer.processing_class, trainer.model
        generator = torch.Generator().manual_seed(1000 + trainer.state.global_step)
        was_training = model.training
        model.eval()
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        try:
            with torch.no_grad():
                for prompt in prompts:
                    ids = tok(prompt)["input_ids"]
                    sampled, logps = [], []
                    for _ in range(max_completion):
                        logits = model(input_ids=torch.tensor([ids + sampled])).logits[0, -1].double()
                        q = torch.softmax(logits / temperature, -1)
                        if top_p < 1.0:
                            order = q.argsort(descending=True)
                            above = torch.cumsum(q[order], 0) - q[order]
                            kept = order[above < top_p]
                        else:
                            kept = torch.arange(q.numel())
                        s = q[kept].sum()
                        pick = int(torch.multinomial((q[kept] / s).float(), 1, generator=generator))
                        token = int(kept[pick])
                        sampled.append(token)
                        logps.append(float(torch.log(q[token]) - torch.log(s)))
                        if token == tok.eos_token_id:
                            break
                    out["prompt_ids"].append(ids)
                    out["completion_ids"].append(sampled)
                    out["logprobs"].append(logps)
        finally:
            model.train(was_training)
        return out

    return sample
