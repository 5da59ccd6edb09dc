"""Truncated sampling: the kept mass log S per token and the precision part of log rho (`tokendyn.hooks.kept_mass`,
the `sampler` records' ``log_kept`` and ``log_rho_precision``).

`kept_mass` against a plain float64 loop over hand-made logits (top_p 0.9, top_k, min_p, a repetition penalty) and
against vLLM's own top-k / top-p and repetition-penalty code; then TRL's real trainer with a ``rollout_func`` that
samples at top_p 0.9 the way vLLM does (a plain torch loop) and returns the processed log-probs, as TRL asks vLLM
for them: the records' log S against a plain float64 recomputation from the starting model's full logits, the
precision part at the trainer-vs-same-model level, the total shifted by log S; at top_p 1 both columns are null."""

from __future__ import annotations

import math

import polars as pl
import pytest
import torch
from _sampler import rollout_sampler
from test_trainer import TEMPERATURE, _config, vowel_reward
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from tokendyn.analysis.mismatch import mismatch_table
from tokendyn.hooks.kept_mass import Processing, history, kept_mass, processing_from_args
from tokendyn.trainers.grpo import TokendynGRPOTrainer

torch.set_num_threads(1)

PROMPTS = ["Zoey says that", "Knights always", "the quick brown", "count: one two"]
MAX_COMPLETION = 8


def reference(
    z: list[float], token: int, proc: Processing, seen: set[int] = frozenset()
) -> tuple[float, float]:
    """(log S, delta) of one position by a plain float64 loop: the penalty, q = softmax(z / T), min_p against the
    largest q, top_k by rank among the survivors, then top_p walking the survivors from the most probable down and
    keeping each one while the renormalised mass above it is < top_p."""
    r = proc.repetition_penalty
    pen = [(x / r if x > 0 else x * r) if v in seen else x for v, x in enumerate(z)]
    scaled = [x / proc.temperature for x in pen]
    m = max(scaled)
    total = sum(math.exp(x - m) for x in scaled)
    q = [math.exp(x - m) / total for x in scaled]
    kept = [v for v in range(len(z)) if q[v] >= proc.min_p * max(q)]
    kept.sort(key=lambda v: -scaled[v])
    if proc.top_k > 0:
        kth = scaled[kept[min(proc.top_k, len(kept)) - 1]]
        kept = [v for v in kept if scaled[v] >= kth]
    if proc.top_p < 1.0:
        mass = sum(q[v] for v in kept)
        above, walked = 0.0, []
        for v in kept:
            if above / mass >= proc.top_p:
                break
            walked.append(v)
            above += q[v]
        kept = walked
    s = sum(q[v] for v in kept)
    m0 = max(x / proc.temperature for x in z)
    log_pi = z[token] / proc.temperature - m0 - math.log(sum(math.exp(x / proc.temperature - m0) for x in z))
    return math.log(s), math.log(q[token]) - math.log(s) - log_pi


CASES = {
    "top_p": Processing(temperature=0.7, top_p=0.9),
    "top_k": Processing(temperature=1.0, top_k=5),
    "top_k+top_p": Processing(temperature=0.8, top_k=12, top_p=0.9),
    "min_p": Processing(temperature=1.0, min_p=0.05),
    "all+penalty": Processing(temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, repetition_penalty=1.3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kept_mass_matches_a_float64_loop_on_hand_made_logits(case):
    proc = CASES[case]
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=gen, dtype=torch.float64) * 2.5
    logits[0, :3] = torch.tensor([6.0, 5.5, 5.0], dtype=torch.float64)  # a peaked row: S near its top tokens
    tokens = torch.tensor([0, 7, 12, 19, 33, 2])
    prompt, completion = torch.tensor([1, 7, 9]), torch.tensor([2, 19, 33, 5, 7, 0])
    seen, counts = history(prompt, completion, 40)
    got = kept_mass(logits, tokens, proc, seen, counts)
    for n in range(6):
        ref = reference(logits[n].tolist(), int(tokens[n]), proc, set(seen[n].nonzero().flatten().tolist()))
        assert float(got.log_kept[n]) == pytest.approx(ref[0], abs=1e-12), (case, n)
        assert float(got.shift[n]) == pytest.approx(ref[1], abs=1e-12), (case, n)
    assert (got.log_kept <= 0).all() and (got.log_kept < -1e-3).any()
    if not proc.penalises:  # without a penalty the shift is -log S exactly
        assert torch.equal(got.shift, -got.log_kept)


def test_kept_mass_gives_vllms_processed_logprob():
    """vLLM's own repetition-penalty and top-k / top-p functions (float64 input) keep the set whose mass under the
    penalised q is S, and log pi(o) + delta(o) is the log-softmax of their masked logits at a kept token."""
    from vllm._custom_ops import apply_repetition_penalties_torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    proc = Processing(temperature=0.8, top_k=15, top_p=0.9, repetition_penalty=1.2)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 50, generator=gen, dtype=torch.float64) * 3.0
    seen, counts = history(torch.tensor([3, 8]), torch.tensor([0, 41, 17, 9]), 50)
    z = logits.clone()
    apply_repetition_penalties_torch(
        z, seen, torch.zeros_like(seen), torch.full((4,), 1.2, dtype=torch.float64)
    )
    log_q = torch.log_softmax(z / 0.8, -1)
    z = apply_top_k_top_p_pytorch(z / 0.8, torch.full((4,), 15), torch.full((4,), 0.9, dtype=torch.float64))
    kept = torch.isfinite(z)
    assert (kept.sum(-1) > 1).all() and (kept.sum(-1) < 15).any()  # top_p cut inside the top 15
    tokens = z.topk(2, -1).indices[:, 1]  # a kept token that is not the argmax
    vllm_logp = torch.log_softmax(z, -1).gather(-1, tokens[:, None]).squeeze(-1)
    got = kept_mass(logits, tokens, proc, seen, counts)
    assert torch.allclose(got.log_kept, torch.logsumexp(log_q.masked_fill(~kept, -math.inf), -1), atol=1e-12)
    log_pi = torch.log_softmax(logits / 0.8, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(log_pi + got.shift, vllm_logp, atol=1e-12, rtol=0)


def test_processing_reads_the_trainers_args_and_generation_kwargs(tmp_path):
    args = _config(tmp_path, top_p=0.9, top_k=0, generation_kwargs={"top_k": 7, "presence_penalty": 0.5})
    proc, unknown = processing_from_args(args)
    assert (proc.top_p, proc.top_k, proc.min_p, proc.presence_penalty, proc.temperature) == (
        0.9, 7, 0.0, 0.5, TEMPERATURE)  # fmt: skip
    assert proc.truncates and unknown is None
    plain, _ = processing_from_args(_config(tmp_path))
    assert not plain.active
    _, unknown = processing_from_args(_config(tmp_path, generation_kwargs={"logit_bias": {3: 1.0}}))
    assert unknown == "logit_bias"


class FirstInputs(TokendynGRPOTrainer):
    """Keeps the first training micro-batch's loss inputs (``first_inputs``), as the loss received them."""

    def _compute_loss(self, model, inputs):
        if model.training and "first_inputs" not in self.__dict__:
            self.first_inputs = {
                k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()
            }
        return super()._compute_loss(model, inputs)


# the two ways a sampler row gets its log pi_old: TRL keeps none (one optimizer step per rollout: the loss's forward)
# or computes old_per_token_logps at the rollout (two optimizer steps per rollout)
PATHS = {"loss_forward": {}, "trl_old_logps": {"gradient_accumulation_steps": 1, "steps_per_generation": 2}}


def _train(model_dir, out, top_p: float, steps: int, **overrides) -> FirstInputs:
    from datasets import Dataset

    options = {"probe_every": 1, **overrides}
    args = _config(out, max_steps=steps, probe_analyses="none", probe_floor=False,
                   max_completion_length=MAX_COMPLETION, top_p=top_p, **options)  # fmt: skip
    trainer = FirstInputs(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=vowel_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir),
        rollout_func=rollout_sampler(TEMPERATURE, MAX_COMPLETION, top_p),
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize("path", list(PATHS))
def test_top_p_records_log_kept_and_the_precision_part(path, tiny_model_dir, tmp_path):
    trainer = _train(
        tiny_model_dir, tmp_path, top_p=0.9, steps=2 if path == "loss_forward" else 1, **PATHS[path]
    )
    assert (trainer.first_inputs.get("old_per_token_logps") is None) == (path == "loss_forward")
    records = pl.read_parquet(sorted((tmp_path / "run" / "records").glob("sampler-*.parquet")))
    assert records.height and records["log_kept"].null_count() == 0
    assert records["log_rho_precision"].null_count() == 0
    assert (records["log_kept"] <= 0).all() and (records["log_kept"] < -1e-3).mean() > 0.3
    assert records["log_kept"].min() >= math.log(0.9) - 1e-9  # top_p keeps >= 0.9 of the mass

    # the first micro-batch against a plain float64 recomputation from the starting model's full logits
    inputs = trainer.first_inputs
    first = records.filter((pl.col("step") == 0) & (pl.col("micro") == 0)).sort("row", "pos")
    mask = inputs["completion_mask"].bool()
    assert first.height == int(mask.sum())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    log_s, log_raw = [], []
    with torch.no_grad():
        for b in range(mask.size(0)):
            prompt = inputs["prompt_ids"][b][inputs["prompt_mask"][b].bool()]
            completion = inputs["completion_ids"][b][mask[b]]
            ids = torch.cat([prompt, completion]).unsqueeze(0)
            logits = model(input_ids=ids).logits[0, prompt.numel() - 1 : -1].double() / TEMPERATURE
            for j, token in enumerate(completion.tolist()):
                q = torch.softmax(logits[j], -1).tolist()
                desc = sorted(range(len(q)), key=lambda v: -q[v])
                above, s = 0.0, 0.0
                for v in desc:
                    if above >= 0.9:
                        break
                    s += q[v]
                    above += q[v]
                log_s.append(math.log(s))
                log_raw.append(math.log(q[token]))
    log_s, log_raw = torch.tensor(log_s), torch.tensor(log_raw)
    assert (torch.tensor(first["log_kept"].to_list()) - log_s).abs().max() < 1e-5
    # the precision part: the trainer against the raw (untruncated) log-prob of the same model, float32 noise
    precision = torch.tensor(first["log_rho_precision"].to_list())
    assert (precision - (torch.tensor(first["logp_old"].to_list()) - log_raw)).abs().max() < 1e-5
    assert precision.abs().max() < 1e-4
    # the total log rho is the kept mass's log, not precision: log rho = precision + log S
    total = torch.tensor(first["log_rho"].to_list())
    assert (total - log_s).abs().max() < 1e-4 and total.mean() < -1e-2

    table = mismatch_table(records).filter(pl.col("side") == "pi_old").sort("bin")
    assert table["kept_count"].to_list() == table["count"].to_list()
    for r in table.iter_rows(named=True):
        assert r["mean_log_rho"] == pytest.approx(r["mean_log_kept"] + r["mean_log_rho_prec"], abs=1e-9)
        assert abs(r["mean_log_rho_prec"]) < 1e-4 < abs(r["mean_log_rho"])
    print("\n" + str(table.select("bin", "count", "mean_log_rho", "mean_log_kept", "mean_log_rho_prec")))


def test_top_p_one_leaves_both_columns_null(tiny_model_dir, tmp_path):
    _train(tiny_model_dir, tmp_path, top_p=1.0, steps=1)
    records = pl.read_parquet(sorted((tmp_path / "run" / "records").glob("sampler-*.parquet")))
    assert records.height
    assert records["log_kept"].null_count() == records["log_rho_precision"].null_count() == records.height
    table = mismatch_table(records)
    assert set(table["kept_count"].to_list()) == {0} and table["mean_log_kept"].null_count() == table.height


def test_the_kept_mass_pass_leaves_training_bit_for_bit(gpt2_dir, tmp_path):
    """The extra forward of a truncated run (`kept_logps`, a side pass) changes nothing: a GPT-2 at transformers'
    default dropout 0.1 (any extra RNG draw would change every later dropout mask) trained at top_p 0.9 with the
    probe on ends with the parameters of the probe-off run, bit for bit."""
    off = _train(gpt2_dir, tmp_path / "off", top_p=0.9, steps=2, probe_every=0)
    on = _train(gpt2_dir, tmp_path / "on", top_p=0.9, steps=2)
    records = pl.read_parquet(sorted((tmp_path / "on" / "run" / "records").glob("sampler-*.parquet")))
    assert records.height and records["log_kept"].null_count() == 0  # the pass ran
    pairs = zip(off.model.parameters(), on.model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
