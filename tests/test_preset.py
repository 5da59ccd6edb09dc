"""`--preset ar_lopti` is the paper's training: one rollout's update by the trainer equals a plain-torch loop written
here from docs/paper.md (the official settings of §1.2, Reweight of §3, Lopti of §4), not from the trainer's code.

The loop takes only what TRL generated (prompts, completions, rewards) and how TRL split the rollout batch into
micro-batches; it computes pi_old and pi_ref from the starting parameters itself, the advantages (group mean,
unbiased std + 1e-6), Reweight's weights (0.3 pi_old + 0.7), Lopti's groups (pi_old < 0.5, low first), and per stage
the official loss of each micro-batch: dual-clip PPO (clip 0.2 / 0.24, c = 10), 0.001 x the clamped k3 KL, both on
the stage's tokens, token-mean over the micro-batch's tokens, divided by the accumulation steps; then clip the
gradient norm to 1.0 and take an AdamW step (weight decay 0.01), the state kept between the stages.

Far off policy: the trainer's parameters are moved after generation (a flatter LM head, noise) (pi_old and pi_ref stay the generating
policy's), so ratios reach beyond 10 and the KL clamp binds; the test asserts both bind.
"""

from __future__ import annotations

import pytest
import torch
from test_trainer import PROMPTS, _trainer, vowel_reward  # noqa: F401

from tokendyn.trainers.config import TokendynGRPOConfig
from tokendyn.trainers.grpo import TokendynGRPOTrainer
from tokendyn.trainers.presets import PRESETS

torch.set_num_threads(1)


class Recording(TokendynGRPOTrainer):
    """Keeps the rollout batch as generated (rows in group order) with its rewards, the rows of every micro-batch
    the loss sees, and the parameters the update starts from (after the optional noise)."""

    noise = 0.0
    flatten = 1.0
    rec: dict = {}

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if "rollout" not in self.rec:
            keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
            self.rec["rollout"] = {k: output[k].clone() for k in keys}
            weights = self.reward_weights.unsqueeze(0)
            self.rec["rewards"] = (self._last_rewards_per_func * weights).nansum(dim=1).clone()
        return output

    def _compute_loss(self, model, inputs):
        if "start" not in self.rec:
            if (
                self.noise
            ):  # far from pi_old: a flatter head (rare tokens gain > 10x) and noise on every weight
                g = torch.Generator().manual_seed(1)
                with torch.no_grad():
                    model.lm_head.weight.mul_(self.flatten)
                    for p in model.parameters():
                        p.add_(self.noise * torch.randn(p.shape, generator=g))
            self.rec["start"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.rec.setdefault("micro", []).append(
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        )
        return super()._compute_loss(model, inputs)


def rows_of(micro: torch.Tensor, full: torch.Tensor) -> list[int]:
    """Row indices into the generated batch of each row of a micro-batch (identical rows are interchangeable)."""
    used, out = set(), []
    for row in micro:
        i = next(j for j in range(full.size(0)) if j not in used and torch.equal(full[j], row))
        used.add(i)
        out.append(i)
    return out


def completion_logp(model, ids, attn, c: int, temperature: float) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=attn).logits[:, -c - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[:, -c:].unsqueeze(-1)).squeeze(-1)


def official_update(model, rec, start0, args, accumulation: int) -> dict:
    """The official loop (docs/paper.md §1.2, §3, §4) on the recorded rollout; returns the parameters after both
    Lopti stages."""
    roll = rec["rollout"]
    ids = torch.cat([roll["prompt_ids"], roll["completion_ids"]], 1)
    attn = torch.cat([roll["prompt_mask"], roll["completion_mask"]], 1)
    mask = roll["completion_mask"].bool()
    c = mask.size(1)
    t = 0.7
    with torch.no_grad():  # pi_old = pi_ref = the generating policy (the parameters before the noise)
        model.load_state_dict(start0, strict=False)
        old = completion_logp(model, ids, attn, c, t)
        ref = old.clone()
    g = 4  # num_generations
    r = rec["rewards"].double().view(-1, g)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=True, keepdim=True) + 1e-6)).view(-1, 1).float()
    adv = (0.3 * torch.exp(old) + 0.7) * adv  # Advantage Reweighting, detached
    low = mask & (torch.exp(old) < 0.5)
    stages = (low, mask & ~low)  # low first
    with torch.no_grad():
        model.load_state_dict(rec["start"], strict=False)
    opt = torch.optim.AdamW(
        model.parameters(), lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01
    )
    split = [rows_of(m, ids) for m in rec["micro"][:accumulation]]
    bound = {"dual": 0, "kl": 0}
    for stage in stages:
        opt.zero_grad(set_to_none=True)
        for rows in split:
            logp = completion_logp(model, ids[rows], attn[rows], c, t)
            m, keep = mask[rows].float(), stage[rows].float()
            a = adv[rows] * keep
            ratio = torch.exp(logp - old[rows])
            pg1, pg2 = -a * ratio, -a * torch.clamp(ratio, 1 - 0.2, 1 + 0.24)
            clip_pg = torch.maximum(pg1, pg2)
            pg = torch.where(a < 0, torch.minimum(clip_pg, -a * 10.0), clip_pg)
            kl = torch.clamp(ref[rows] - logp, -5.0, 5.0)
            kld = torch.clamp(torch.exp(kl) - kl - 1.0, -10.0, 10.0)
            bound["dual"] += int(((a < 0) & (clip_pg > -a * 10.0) & (m > 0)).sum())
            bound["kl"] += int(((kld >= 10.0) & (keep > 0)).sum())
            loss = ((pg + 0.001 * kld * keep) * m).sum() / m.sum() / accumulation
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, bound


@pytest.mark.parametrize("case", ["default", "far off policy"])
def test_preset_ar_lopti_equals_the_official_loop(tiny_model_dir, tmp_path, case):
    Recording.rec = {}
    Recording.noise, Recording.flatten = (0.0, 1.0) if case == "default" else (0.05, 0.2)
    args = TokendynGRPOConfig.from_preset(
        "ar_lopti",
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=8,
        num_generations=4,
        gradient_accumulation_steps=2,
        steps_per_generation=2,  # 16 completions, two micro-batches per optimizer step
        max_completion_length=10,
        learning_rate=1e-3,
        max_steps=2,  # one rollout: the low stage's step, then the high stage's
        use_cpu=True,
        bf16=False,  # float32: the loop is float32 (a bf16 autocast would be the difference measured)
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    assert all(getattr(args, k) == v for k, v in PRESETS["ar_lopti"].items())
    trainer = _trainer(tiny_model_dir, args, cls=Recording)
    start0 = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    rec = Recording.rec
    assert len(rec["micro"]) == 4  # two micro-batches per stage
    got = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.train()
    want, bound = official_update(model, rec, start0, args, accumulation=2)
    num = sum(float((got[n] - want[n]).double().pow(2).sum()) for n in want)
    den = sum(float((want[n] - rec["start"][n]).double().pow(2).sum()) for n in want)
    err = (num / den) ** 0.5
    print(
        f"{case}: relative L2 of the update {err:.2e}; dual clip bound on {bound['dual']}, KL clamp on {bound['kl']}"
    )
    assert den > 0 and err <= 1e-4, err
    if case == "far off policy":
        assert bound["dual"] > 0 and bound["kl"] > 0, bound
