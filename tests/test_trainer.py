"""TokendynGRPOTrainer on a real tiny Qwen2 with the real TRL loop: equivalence with TRL, Lopti against a plain
two-stage loop written here, Reweight and KL masking checked on gradients, REINFORCE++, config validation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, HfArgumentParser, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from tokendyn.trainers.config import TokendynGRPOConfig
from tokendyn.trainers.grpo import TokendynGRPOTrainer

torch.set_num_threads(1)

PROMPTS = [
    "Zoey says that",
    "Knights always",
    "You meet 3 inhabitants:",
    "the quick brown",
    "<think> Assume",
    "count: one two",
    "<answer> (1)",
    "Oliver is a",
]
TEMPERATURE = 0.7


def vowel_reward(completions, **kwargs):
    """A graded reward that differs within a group: the fraction of vowels in the completion text."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


def _config(tmp_path, cls=TokendynGRPOConfig, **overrides):
    base = dict(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=8,
        num_generations=4,
        gradient_accumulation_steps=2,  # steps_per_generation defaults to it: 16 completions per rollout batch
        max_completion_length=10,
        temperature=TEMPERATURE,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        bf16=False,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    base.update(overrides)
    return cls(**base)


def _trainer(model_dir, args, cls=TokendynGRPOTrainer, sgd_lr=None):
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizers = (torch.optim.SGD(model.parameters(), lr=sgd_lr), None) if sgd_lr else (None, None)
    return cls(
        model=model,
        reward_funcs=vowel_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tok,
        optimizers=optimizers,
    )


def _completion_logps(model, batch):
    """log pi(o_t) at the sampling temperature, from full logits (not TRL's fused head)."""
    prompt_len = batch["prompt_ids"].size(1)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, prompt_len - 1 : -1].float() / TEMPERATURE
    return torch.log_softmax(logits, dim=-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


def _final_hidden_grads(trainer, inputs):
    """dL/dh at the final-norm output, at the positions that predict each completion token (B, C, H)."""
    model, captured = trainer.model, {}

    def hook(module, args, out):
        out.register_hook(lambda g: captured.__setitem__("g", g.detach().clone()))

    handle = model.model.norm.register_forward_hook(hook)
    try:
        model.zero_grad()
        trainer._compute_loss(model, inputs).backward()
    finally:
        handle.remove()
    prompt_len, comp_len = inputs["prompt_ids"].size(1), inputs["completion_ids"].size(1)
    return captured["g"][:, prompt_len - 1 : prompt_len - 1 + comp_len]


# ------------------------------------------------------------------------------------ equivalence with TRL
@pytest.mark.parametrize(
    "overrides",
    [
        dict(loss_type="dapo", beta=0.05, epsilon_high=0.28, num_iterations=2),
        dict(loss_type="grpo", beta=0.0, num_iterations=1),
    ],
)
def test_defaults_reproduce_trl_exactly(tiny_model_dir, tmp_path, overrides):
    ours = _trainer(tiny_model_dir, _config(tmp_path, max_steps=3, **overrides))
    ours.train()
    trl = _trainer(
        tiny_model_dir, _config(tmp_path, cls=GRPOConfig, max_steps=3, **overrides), cls=GRPOTrainer
    )
    trl.train()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    moved = False
    for (name, a), (_, b) in zip(ours.model.named_parameters(), trl.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
        moved |= not torch.equal(a, initial[name])
    assert moved
    assert "raw_advantages" not in ours._buffered_inputs[0]
    assert ours.current_stage() == 0


# --------------------------------------------------------------------------- Lopti against a plain loop
def _plain_two_stage_loop(model_dir, rollout, args, *, eta, quantile, alpha, order, lr, stages=None):
    """The official semantics, written out: pi_old and pi_ref from sampling time; stage masks from pi_old; each stage
    is a full update (num_iterations passes over the rollout batch, GA micro-batches per SGD step) with advantages and
    KL masked to the stage's tokens and the loss denominator over all completion tokens. ``stages``: the two stages'
    masks per micro-batch given instead of the split by pi_old (the random-halves control)."""
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        old = [_completion_logps(policy, b) for b in rollout]
        ref_logps = [_completion_logps(ref, b) for b in rollout]
    masks = [b["completion_mask"].float() for b in rollout]
    for b, o, m in zip(rollout, old, masks, strict=True):  # TRL's pi_old is the same quantity
        torch.testing.assert_close(b["old_per_token_logps"] * m, o * m, atol=2e-5, rtol=0)
    advantages = [
        b["raw_advantages"].unsqueeze(1) * (alpha * o.exp() + 1 - alpha)
        for b, o in zip(rollout, old, strict=True)
    ]
    if quantile is not None:
        pis = torch.cat([o.exp()[m.bool()] for o, m in zip(old, masks, strict=True)])
        eta = torch.quantile(pis.double(), quantile).item()
    if stages is None:
        low = [(o.exp() < eta) & m.bool() for o, m in zip(old, masks, strict=True)]
        high = [(o.exp() >= eta) & m.bool() for o, m in zip(old, masks, strict=True)]
        stages = [low, high] if order == "low_first" else [high, low]
    total_tokens = sum(m.sum() for m in masks)
    eps_low, eps_high = args.epsilon, args.epsilon_high or args.epsilon
    ga = args.gradient_accumulation_steps
    opt = torch.optim.SGD(policy.parameters(), lr=lr)
    for stage in stages:
        for _ in range(args.num_iterations):
            for start in range(0, len(rollout), ga):
                opt.zero_grad()
                for i in range(start, start + ga):
                    keep, m = stage[i].float(), masks[i]
                    logp = _completion_logps(policy, rollout[i])
                    adv = advantages[i] * keep
                    ratio = torch.exp(torch.where(m.bool(), logp - old[i], 0.0))  # padding may overflow
                    pg = -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)
                    # the KL term of the stage's tokens only
                    d = torch.where(keep.bool(), ref_logps[i] - logp, 0.0)
                    per_token = pg + args.beta * (torch.exp(d) - d - 1)
                    if args.loss_type == "dapo":
                        loss = (per_token * m).sum() / total_tokens
                    elif args.loss_type == "bnpo":
                        loss = (per_token * m).sum() / m.sum() / ga
                    else:  # grpo
                        loss = ((per_token * m).sum(1) / m.sum(1)).mean() / ga
                    loss.backward()
                opt.step()
    return policy


LOPTI_CASES = {
    "dapo-low-2iter-kl": dict(
        loss_type="dapo", num_iterations=2, beta=0.1, eta=0.5, quantile=None, alpha=0.0
    ),
    "bnpo-high_first-kl": dict(
        loss_type="bnpo", num_iterations=1, beta=0.1, eta=0.5, quantile=None, alpha=0.0, order="high_first"
    ),
    "grpo-quantile-reweight": dict(
        loss_type="grpo", num_iterations=1, beta=0.0, eta=None, quantile=0.3, alpha=0.3
    ),
    "dapo-reweight-kl": dict(loss_type="dapo", num_iterations=1, beta=0.1, eta=0.4, quantile=None, alpha=0.3),
}


@pytest.mark.parametrize("case", list(LOPTI_CASES))
def test_lopti_matches_plain_two_stage_loop(tiny_model_dir, tmp_path, case):
    c = dict(LOPTI_CASES[case])
    order = c.pop("order", "low_first")
    lr = 1e-3  # large enough to clip in later passes, small enough to stay out of the chaotic regime
    args = _config(
        tmp_path,
        loss_type=c["loss_type"],
        num_iterations=c["num_iterations"],
        beta=c["beta"],
        epsilon=0.2,
        epsilon_high=0.28,
        max_grad_norm=0.0,  # no clipping: plain SGD steps
        use_bias_correction_kl=False,  # the paper's plain k3 KL (TRL 1.16 defaults to the ratio-corrected one)
        lopti_eta=c["eta"],
        lopti_quantile=c["quantile"],
        lopti_order=order,
        advantage_reweight_alpha=c["alpha"],
        max_steps=2 * c["num_iterations"],  # one rollout batch: num_iterations optimizer steps per stage
    )
    trainer = _trainer(tiny_model_dir, args, sgd_lr=lr)
    trainer.train()
    rollout = trainer._buffered_inputs
    fractions = [
        h["lopti/stage1_fraction"] for h in trainer.state.log_history if "lopti/stage1_fraction" in h
    ]
    assert len(fractions) == 1  # exactly one rollout batch was generated
    assert 0.1 < fractions[0] < 0.9  # both stages have work to do
    reference = _plain_two_stage_loop(
        tiny_model_dir,
        rollout,
        args,
        eta=c["eta"],
        quantile=c["quantile"],
        alpha=c["alpha"],
        order=order,
        lr=lr,
    )
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    max_move = 0.0
    for (name, a), (_, b) in zip(trainer.model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)
        max_move = max(max_move, (a - initial[name]).abs().max().item())
    assert max_move > 1e-3  # the updates were real


def test_random_halves_is_two_stages_on_random_halves(tiny_model_dir, tmp_path):
    """Lopti's step-count control: the same two full stages (two SGD steps on one rollout batch, KL masked per stage,
    every token in the denominator) equal the plain loop run on the batch's own halves; the halves are a random
    partition of each rank's valid tokens into ceil / floor halves, not a split by pi_old, and not Lopti's stages."""
    lr = 1e-3
    args = _config(
        tmp_path, beta=0.1, max_grad_norm=0.0, use_bias_correction_kl=False, random_halves=True, max_steps=2
    )
    trainer = _trainer(tiny_model_dir, args, sgd_lr=lr)
    trainer.train()
    rollout = trainer._buffered_inputs
    assert trainer.current_stage() == 0 and not any("lopti_stage1_mask" in b for b in rollout)
    first = torch.cat([b["halves_stage1_mask"].flatten() for b in rollout])
    second = torch.cat([b["halves_stage2_mask"].flatten() for b in rollout])
    valid = torch.cat([b["completion_mask"].flatten() for b in rollout]).bool()
    assert not (first & second).any() and torch.equal(first | second, valid)
    # TRL shuffles the batch into micro-batches after the split: the whole batch's halves are ceil / floor of n
    assert int(first.sum()) - int(second.sum()) in (0, 1)
    pi_old = torch.cat([b["old_per_token_logps"].flatten() for b in rollout]).exp()[valid]
    low = pi_old < float(pi_old.median())
    assert not torch.equal(first[valid], low) and not torch.equal(first[valid], ~low)  # not a split by pi_old
    stages = [[b["halves_stage1_mask"] for b in rollout], [b["halves_stage2_mask"] for b in rollout]]
    reference = _plain_two_stage_loop(
        tiny_model_dir,
        rollout,
        args,
        eta=None,
        quantile=None,
        alpha=0.0,
        order="low_first",
        lr=lr,
        stages=stages,
    )
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    max_move = 0.0
    for (name, a), (_, b) in zip(trainer.model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)
        max_move = max(max_move, (a - initial[name]).abs().max().item())
    assert max_move > 1e-3
    # a second run with the same seed draws the same halves; another seed other ones
    again = _trainer(tiny_model_dir, _config(tmp_path, random_halves=True, max_steps=2, seed=0))
    again.train()
    assert all(
        torch.equal(a["halves_stage1_mask"], b["halves_stage1_mask"])
        for a, b in zip(rollout, again._buffered_inputs, strict=True)
    )


def test_lopti_schedule_masks_and_stage_order(tiny_model_dir, tmp_path):
    """Every pass of stage 1 first, then every pass of stage 2, with advantages masked to the stage's tokens."""

    class Recording(TokendynGRPOTrainer):
        def _compute_loss(self, model, inputs):
            out = super()._compute_loss(model, inputs)
            self.record.append((self._last_loss_stage, self._last_loss_inputs, inputs))
            return out

    runs = {}
    for order in ("low_first", "high_first"):
        args = _config(tmp_path, num_iterations=2, lopti_eta=0.5, lopti_order=order, max_steps=4)
        trainer = _trainer(tiny_model_dir, args, cls=Recording)
        trainer.record = []
        trainer.train()
        runs[order] = trainer
        assert [r[0] for r in trainer.record] == [1, 1, 1, 1, 2, 2, 2, 2]
        for stage, loss_inputs, buffered in trainer.record:
            pi_old = buffered["old_per_token_logps"].exp()
            valid = buffered["completion_mask"].bool()
            low = (pi_old < 0.5) & valid
            first = low if order == "low_first" else (~low & valid)
            expected = first if stage == 1 else (valid & ~first)
            assert torch.equal(buffered[f"lopti_stage{stage}_mask"], expected)
            adv = loss_inputs["advantages"]
            assert torch.equal(adv, buffered["advantages"].unsqueeze(1) * expected)
            # the loss mask, hence the denominator, is unchanged
            assert torch.equal(loss_inputs["completion_mask"], buffered["completion_mask"])
    # same seed, same rollouts: high_first's first stage is low_first's second stage
    lf, hf = runs["low_first"].record[0][2], runs["high_first"].record[0][2]
    assert torch.equal(lf["completion_ids"], hf["completion_ids"])
    assert torch.equal(hf["lopti_stage1_mask"], lf["lopti_stage2_mask"])
    assert torch.equal(hf["lopti_stage2_mask"], lf["lopti_stage1_mask"])


def test_kl_term_is_masked_per_stage(tiny_model_dir, tmp_path):
    # TRL's default KL variant (use_bias_correction_kl=True); the loop test above covers the plain k3
    args = _config(tmp_path, beta=0.5, lopti_eta=0.5, max_steps=2, max_grad_norm=0.0)
    trainer = _trainer(tiny_model_dir, args, sgd_lr=1e-3)
    trainer.train()  # the policy has moved away from the reference: the KL gradient is non-zero
    batch = dict(trainer._buffered_inputs[0])
    batch["advantages"] = torch.zeros_like(batch["completion_ids"], dtype=torch.float32)  # KL term only
    valid = batch["completion_mask"].bool()
    trainer.lopti_enabled = False
    full = _final_hidden_grads(trainer, batch).norm(dim=-1)
    trainer.lopti_enabled = True
    per_stage = {}
    for stage, step in ((1, 0), (2, args.steps_per_generation)):
        trainer._step = step
        assert trainer.current_stage() == stage
        per_stage[stage] = _final_hidden_grads(trainer, batch).norm(dim=-1)
        keep = batch[f"lopti_stage{stage}_mask"]
        assert torch.all(per_stage[stage][~keep] == 0)
        torch.testing.assert_close(per_stage[stage][keep], full[keep], rtol=1e-5, atol=1e-9)
    assert (full[valid] > 0).float().mean() > 0.9
    assert (per_stage[1][valid] > 0).any() and (per_stage[2][valid] > 0).any()


# ------------------------------------------------------------------------------------------- Reweight
def test_reweight_scales_each_token_gradient_in_trl_loss(tiny_model_dir, tmp_path):
    alpha = 0.3
    args = _config(tmp_path, advantage_reweight_alpha=alpha, beta=0.0, num_iterations=2, max_steps=1)
    trainer = _trainer(tiny_model_dir, args)
    trainer.train()  # one optimizer step: ratios != 1, the clipped loss is in play
    batch = trainer._buffered_inputs[0]
    pi_old = batch["old_per_token_logps"].exp()
    weight = alpha * pi_old + 1 - alpha
    torch.testing.assert_close(batch["advantages"], batch["raw_advantages"].unsqueeze(1) * weight)
    g_rw = _final_hidden_grads(trainer, batch)
    g_raw = _final_hidden_grads(trainer, dict(batch, advantages=batch["raw_advantages"]))
    valid = batch["completion_mask"].bool()
    expected = (weight.unsqueeze(-1) * g_raw)[valid]
    torch.testing.assert_close(g_rw[valid], expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))
    assert weight[valid].std() > 0.05  # the weights really differ between tokens
    assert g_raw[valid].norm(dim=-1).gt(0).float().mean() > 0.25  # the others are clipped: zero in both


# ------------------------------------------------------------------------------------------- REINFORCE++
def test_reinforce_pp_advantages_are_batch_whitened_returns(tiny_model_dir, tmp_path):
    args = _config(tmp_path, advantage_estimator="reinforce_pp", max_steps=1)
    trainer = _trainer(tiny_model_dir, args)
    trainer.train()
    batch = {
        k: torch.cat([b[k] for b in trainer._buffered_inputs]) for k in ("completion_ids", "completion_mask")
    }
    adv = torch.cat([b["advantages"] for b in trainer._buffered_inputs])
    mask = batch["completion_mask"].bool()
    texts = trainer.processing_class.batch_decode(batch["completion_ids"] * mask, skip_special_tokens=True)
    rewards = torch.tensor(vowel_reward(texts), dtype=torch.float64)
    lengths = mask.sum(1).double()
    mean = (rewards * lengths).sum() / lengths.sum()
    var = ((rewards - mean) ** 2 * lengths).sum() / (lengths.sum() - 1)
    expected = ((rewards - mean) / torch.sqrt(var + 1e-8)).float()
    torch.testing.assert_close(adv, expected.unsqueeze(1) * mask, atol=1e-5, rtol=1e-5)
    # no group baseline: group advantages would sum to zero within each prompt group, these do not
    assert adv.shape == mask.shape and adv[~mask].abs().max() == 0


# ------------------------------------------------------------------------------------------- two processes
DIST_SCRIPT = r"""
import json, sys
import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from tokendyn.trainers.config import TokendynGRPOConfig
from tokendyn.trainers.grpo import TokendynGRPOTrainer

model_dir, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)


def reward(completions, **kw):
    return [sum(c in "aeiou" for c in t) / max(len(t), 1) for t in completions]


args = TokendynGRPOConfig(
    output_dir=out, per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=1,
    max_completion_length=8, temperature=0.7, learning_rate=1e-3, bf16=False, use_cpu=True, report_to="none",
    logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, max_steps=4, ddp_find_unused_parameters=False,
    lopti_quantile=0.3, advantage_reweight_alpha=0.3, advantage_estimator="reinforce_pp", beta=0.05,
)
trainer = TokendynGRPOTrainer(
    model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reward, args=args,
    train_dataset=Dataset.from_dict({"prompt": ["Zoey says", "Knights always", "You meet", "the quick"]}),
    processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir),
)
trainer.train()
acc, batch = trainer.accelerator, trainer._buffered_inputs[0]


def rows(t):
    return acc.gather(acc.pad_across_processes(t, dim=1))


mask, raw = rows(batch["completion_mask"]).bool(), rows(batch["raw_advantages"])
stage1, pi_old = rows(batch["lopti_stage1_mask"].long()).bool(), rows(batch["old_per_token_logps"].exp())
params = acc.gather(torch.cat([p.detach().flatten() for p in trainer.model.parameters()]).unsqueeze(0))
if acc.is_main_process:
    threshold = torch.quantile(pi_old[mask].double(), 0.3)
    result = dict(
        world=acc.num_processes,
        adv_mean=raw[mask].double().mean().item(),
        adv_var=raw[mask].double().var().item(),
        params_equal=bool(torch.equal(params[0], params[1])),
        stage1_is_global_low=bool(torch.equal(stage1 & mask, (pi_old.double() < threshold) & mask)),
        stage1_fraction=stage1[mask].float().mean().item(),
    )
    with open(out + "/result.json", "w") as f:
        json.dump(result, f)
acc.wait_for_everyone()
dist.destroy_process_group()
"""


@pytest.mark.slow_tier  # the slow tier: `make test-slow` (several processes)
def test_two_processes_share_the_batch_statistics(tiny_model_dir, tmp_path):
    """REINFORCE++ whitening and the Lopti quantile are taken over the whole batch of all processes (gloo, CPU)."""
    script = tmp_path / "dist_run.py"
    script.write_text(DIST_SCRIPT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(script),
    ]
    proc = subprocess.run(
        [*cmd, str(tiny_model_dir), str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    # gloo can abort a process at exit under heavy CPU load ("terminate called without an active exception", seen
    # 2 times in ~20 runs on 2 CPU cores) after the results are written: accept only that, and only with the results
    # on disk
    teardown_abort = "terminate called without an active exception" in proc.stderr
    ok = proc.returncode == 0 or (teardown_abort and (tmp_path / "result.json").is_file())
    assert ok, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world"] == 2 and result["params_equal"]
    assert abs(result["adv_mean"]) < 1e-6 and result["adv_var"] == pytest.approx(1.0, abs=1e-4)
    assert result["stage1_is_global_low"] and 0.2 < result["stage1_fraction"] < 0.4


# -------------------------------------------------------------------------------------- config validation
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(advantage_reweight_alpha=1.5), r"advantage_reweight_alpha must be a number in \[0, 1\]"),
        (dict(advantage_reweight_alpha=-0.1), r"advantage_reweight_alpha must be a number in \[0, 1\]"),
        (dict(lopti_eta=1.0), r"lopti_eta must be None \(off\) or a number in the open interval \(0, 1\)"),
        (dict(lopti_eta=0.0), r"lopti_eta must be None"),
        (dict(lopti_quantile=1.2), r"lopti_quantile must be None \(off\) or a number in the open interval"),
        (dict(lopti_eta=0.5, lopti_quantile=0.5), "lopti_eta and lopti_quantile are mutually exclusive"),
        (dict(lopti_order="middle_first"), "lopti_order must be one of low_first, high_first"),
        (dict(random_halves=True, lopti_eta=0.5), "random_halves is Lopti's control"),
        (dict(random_halves="yes"), "random_halves must be true or false"),
        (dict(advantage_estimator="ppo"), "advantage_estimator must be one of grpo, reinforce_pp"),
        (
            dict(lopti_eta=0.5, steps_per_generation=1, gradient_accumulation_steps=2),
            r"steps_per_generation \* num_iterations .* multiple of gradient_accumulation_steps",
        ),
        (dict(lopti_eta=0.5, entropy_coef=0.01), "Lopti does not support the entropy bonus"),
    ],
)
def test_config_rejects_invalid_values(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        _config(tmp_path, **overrides)


def test_config_parses_from_cli_flags(tmp_path):
    parser = HfArgumentParser(TokendynGRPOConfig)
    (cfg,) = parser.parse_args_into_dataclasses(
        args=f"--output_dir {tmp_path} --use_cpu True --lopti_eta 0.5 --lopti_order high_first "
        "--advantage_reweight_alpha 0.3 --advantage_estimator reinforce_pp".split()
    )
    assert (cfg.lopti_eta, cfg.lopti_quantile, cfg.lopti_order) == (0.5, None, "high_first")
    assert (
        cfg.advantage_reweight_alpha == 0.3
        and cfg.advantage_estimator == "reinforce_pp"
        and cfg.lopti_enabled
    )
    assert not _config(tmp_path).lopti_enabled
