"""verl's rollout correction (``algorithm.rollout_correction``, decoupled mode) against a bf16 sampler, in process:
tokendyn's Hugging Face rollout server holding the embedded default policy in bfloat16 (verl's ``rollout.dtype``)
samples the batch, verl's float32 actor engine recomputes pi_old, verl's own `compute_rollout_correction_and_rejection_mask`
turns the two into ``rollout_is_weights``, and verl's `TrainingWorker.train_mini_batch` takes one SGD step with the
tokendyn loss and the probe on. Checked: the server's log-probs are the bf16 model's own (its cached decoding, written
out here) and differ from the float32 model's as a bf16 engine's do; the gradient the analyses decompose (verl's loss
through `VerlObjective`, on `probe_batch` of the trained batch, the weights in) equals the actor's parameter change
/ -lr, and without the weights it does not; the probe's `sampler` records carry the batch's log-probs and weights."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from functools import partial

import polars as pl
import pytest
import torch
from omegaconf import OmegaConf

from tokendyn.integrations import verl as glue
from tokendyn.integrations.verl import cpu
from tokendyn.integrations.verl.hf_rollout import HFRolloutServer
from tokendyn.policy import default_policy_dir

glue.register()
T = 0.7
LENGTH = 16
GROUP = 4
PROMPTS = [[5, 17, 33, 8, 91], [12, 40, 7, 66], [23, 9, 81, 30, 44, 3]]
LR = 0.5
# the relative error of the analyses' gradient against the actor's step, and the least error without the weights
SAME_UPDATE = 1e-4
WITHOUT_WEIGHTS = 1e-3


def server(dtype: str | None, length: int = LENGTH) -> HFRolloutServer:
    fields = {"response_length": length, "seed": 3, **({"dtype": dtype} if dtype else {})}
    threads = torch.get_num_threads()
    try:
        return HFRolloutServer(OmegaConf.create(fields), str(default_policy_dir()))
    finally:
        torch.set_num_threads(threads)


def sample(srv: HFRolloutServer, prompt: list[int], temperature: float = T):
    params = {"temperature": temperature, "top_p": 1.0, "top_k": -1, "logprobs": True}
    threads = torch.get_num_threads()
    try:
        return asyncio.run(srv.generate(prompt_ids=prompt, sampling_params=params, request_id="r"))
    finally:
        torch.set_num_threads(threads)


def cached_decoding_log_probs(
    model, prompt: list[int], tokens: list[int], temperature: float
) -> torch.Tensor:
    """log softmax(z_t / T)[o_t] from the model's forward over the prompt, then one token at a time on its KV cache
    (how a sampler scores what it samples), the logits cast to float32 first."""
    from transformers import DynamicCache

    out, logp = None, []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), past_key_values=DynamicCache(), use_cache=True)
        for token in tokens:
            logp.append(torch.log_softmax(out.logits[0, -1].float() / temperature, -1)[token])
            out = model(
                input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True
            )
    return torch.stack(logp)


def test_the_hf_rollout_in_bf16_samples_and_scores_with_the_bf16_model():
    """``rollout.dtype=bfloat16``: the server holds the model in bf16 (also after a weight sync of float32
    tensors), and its log-probs are the bf16 model's own at T (its cached decoding: exactly), not the float32
    model's: a mean |difference| from a float32 forward like a bf16 engine's (docs/results.md, the
    sampler's mismatch per probability bin: about 4e-2 on SmolLM2-135M), where float32 on both sides gives ~1e-7."""
    from transformers import AutoModelForCausalLM

    path = str(default_policy_dir())
    srv = server("bfloat16", length=24)
    assert srv.model.dtype == torch.bfloat16
    bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    diffs = []
    for prompt in PROMPTS:
        out = sample(srv, prompt)
        got = torch.tensor(out.log_probs)
        torch.testing.assert_close(
            got, cached_decoding_log_probs(bf16, prompt, out.token_ids, T), rtol=0, atol=1e-6
        )
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            z = fp32(input_ids=ids).logits[0, len(prompt) - 1 : -1] / T
        diffs.append(got - torch.log_softmax(z, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0])
    mismatch = torch.cat(diffs).abs()
    print(f"bf16 server vs float32 model: mean |dlogp| {mismatch.mean():.2e}, max {mismatch.max():.2e}")
    assert 1e-3 < float(mismatch.mean()) < 0.1
    state = {n: p.detach() * 0.5 for n, p in fp32.named_parameters()}
    srv.update_weights(state)
    norm = srv.model.get_parameter("model.norm.weight")
    assert norm.dtype == torch.bfloat16 and torch.equal(norm, state["model.norm.weight"].to(torch.bfloat16))


def test_a_rollout_dtype_outside_the_list_fails_in_one_line():
    from tokendyn.integrations.verl.hf_rollout import rollout_dtype

    assert rollout_dtype(OmegaConf.create({"dtype": "bf16"})) is torch.bfloat16
    assert rollout_dtype(OmegaConf.create({})) is torch.float32
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.dtype: .* got 'int8'") as err:
        rollout_dtype(OmegaConf.create({"dtype": "int8"}))
    assert "\n" not in str(err.value)


# ---- the actor's update with verl's correction weights ------------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_rollouts():
    """GROUP responses of LENGTH tokens (or fewer, at EOS) per prompt from the bf16 server: prompts, responses, log mu,
    and one non-zero advantage per response (a fixed pattern: every sequence carries a signal)."""
    srv = server("bfloat16")
    prompts, responses, mu = [], [], []
    for prompt in PROMPTS:
        for _ in range(GROUP):
            out = sample(srv, prompt)
            prompts.append(prompt)
            responses.append(out.token_ids)
            mu.append(out.log_probs)
    adv = [[(1.0 if i % 2 else -1.0) * (1 + 0.25 * (i % 3))] * len(r) for i, r in enumerate(responses)]
    return prompts, responses, mu, adv


def padded(values: list[list[float]]) -> torch.Tensor:
    out = torch.zeros(len(values), max(map(len, values)))
    for i, v in enumerate(values):
        out[i, : len(v)] = torch.tensor(v)
    return out


def probed_actor(run_dir, reweight_alpha: float = 0.3):
    """verl's actor (`TrainingWorker`, FSDP2, remove-padding, micro-batches of 6, SGD at LR) training the tokendyn
    loss with the probe writing to ``run_dir``, and the actor config."""
    from verl.workers.utils.losses import ppo_loss

    options = {"bins": "intervals:4", "check_tokens": None, "direct_tokens": 0, "sample_tokens": 4096}
    loss = glue.TokendynPolicyLossConfig(
        reweight_alpha=reweight_alpha, probe_dir=str(run_dir), probe_options=options
    )
    cfg = cpu.actor_config(micro_batch_size=6, policy_loss=loss)
    worker = cpu.build_worker(
        default_policy_dir(),
        partial(ppo_loss, config=cfg),
        use_remove_padding=True,
        micro_batch_size=6,
        lr=LR,
    )
    return worker, cfg


def corrected_batch(worker, rollouts, **correction):
    """The rollouts as verl's trainer hands them to the actor: pi_old from verl's old-log-prob pass (the float32
    actor), log mu the sampler's, and verl's own `compute_rollout_correction_and_rejection_mask` (``correction``: its
    ``rollout_is`` / ``rollout_rs`` options) applied as `compute_rollout_correction_and_add_to_batch` applies it:
    ``rollout_is_weights`` added, ``response_mask`` (and the engine's ``loss_mask``, which verl's
    `left_right_2_no_padding` copies from it) replaced by the rejection's. Returns the batch, the response mask
    before the rejection and verl's metrics."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    prompts, responses, mu, adv = rollouts

    def batch():
        return cpu.make_batch(prompts, responses, advantages=adv, temperature=T)

    old = cpu.infer_log_probs(worker.engine, batch())  # verl's old-log-prob pass: the float32 actor's pi_old
    data = batch()
    mask = data["response_mask"].clone()
    data["old_log_probs"] = old
    data["rollout_log_probs"] = padded(mu) * mask
    weights, kept, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old, rollout_log_prob=data["rollout_log_probs"], response_mask=mask, **correction
    )
    if weights is not None:
        data["rollout_is_weights"] = weights.batch["rollout_is_weights"]
    data["response_mask"], data["loss_mask"] = kept, kept.clone()
    return data, mask, metrics


def sampler_records(run_dir) -> pl.DataFrame:
    """The probe's `sampler` records in batch order: ``seq`` = the sequence's row in the batch (6 per micro)."""
    records = pl.read_parquet(sorted((run_dir / "records").glob("sampler-*.parquet")))
    return records.with_columns(seq=pl.col("micro") * 6 + pl.col("row")).sort("seq", "pos")


@pytest.mark.parametrize(("mode", "threshold"), [("token", "1.02"), ("sequence", "0.9_1.1")])
def test_the_analyses_gradient_is_the_actors_update_under_verls_rollout_correction(
    bf16_rollouts, mode, threshold, tmp_path
):
    """verl's actor (`TrainingWorker.train_mini_batch`, FSDP2, remove-padding, two micro-batches, SGD, no clipping)
    trains the tokendyn loss (Reweight on) on the bf16-sampled batch with verl's ``rollout_is_weights`` (token TIS
    capped at 1.02; sequence IcePop keeping [0.9, 1.1]: narrow, so that they bind); the gradient of the analyses'
    objective at the starting model (`VerlObjective` of the actor config on `probe_batch` of that batch, as
    `EngineProbe.analyze` builds both) equals the parameter change / -lr; without the weights it does not."""
    from tokendyn.integrations.verl.objective import VerlObjective
    from tokendyn.integrations.verl.probe import probe_batch
    from tokendyn.probe.tokenloss import token_loss

    worker, cfg = probed_actor(tmp_path / "run")
    data, mask, _ = corrected_batch(worker, bf16_rollouts, rollout_is=mode, rollout_is_threshold=threshold)
    assert torch.equal(data["response_mask"], mask)  # no rejection sampling asked
    old, weights = data["old_log_probs"], data["rollout_is_weights"]
    valid = mask.bool()
    assert ((weights[valid] - 1).abs() > 1e-3).float().mean() > 0.2  # the correction binds on many tokens
    analysed = probe_batch(data, len(bf16_rollouts[1]), T)  # what the probe's analyses take, before the step

    start = cpu.full_parameters(worker.engine)
    cpu.update_actor(worker, data)
    moved = cpu.full_parameters(worker.engine)
    worker._tokendyn_probe.detach()  # flush the records
    names = list(start)
    change = torch.cat([((start[n] - moved[n]) / LR).flatten() for n in names])

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_policy_dir(), dtype=torch.float32)
    params = dict(model.named_parameters())
    assert set(params) == set(names)

    def gradient(batch):
        model.zero_grad()
        token_loss(model, batch, VerlObjective(cfg)).loss.backward()
        return torch.cat([params[n].grad.flatten() for n in names])

    assert analysed.is_ratio is not None and analysed.completion_mask.sum() == valid.sum()
    rel = lambda g: float((g - change).norm() / change.norm())  # noqa: E731
    same, without = rel(gradient(analysed)), rel(gradient(replace(analysed, is_ratio=None)))
    print(
        f"{mode}: analyses' gradient vs the actor's step: rel err {same:.1e}; without the weights {without:.1e}"
    )
    assert same < SAME_UPDATE
    assert without > WITHOUT_WEIGHTS

    # the probe's sampler records: the batch's log mu, pi_old and weights, token by token
    rows = sampler_records(tmp_path / "run")
    assert rows.height == int(valid.sum())
    seq, pos = torch.tensor(rows["seq"].to_list()), torch.tensor(rows["pos"].to_list())
    for column, want in (
        ("logp_old", old),
        ("logp_sampler", data["rollout_log_probs"]),
        ("is_weight", weights),
    ):
        got = torch.tensor(rows[column].to_list(), dtype=torch.float64)
        assert torch.equal(got, want[seq, pos].double()), column
    assert rows["log_rho"].to_numpy() == pytest.approx((rows["logp_old"] - rows["logp_sampler"]).to_numpy())
    from tokendyn.analysis import analyze_run

    assert (
        analyze_run(tmp_path / "run", write=False)["mismatch"].height > 0
    )  # tabulated per bin, as for TRL + vLLM


# ---- verl's rejection sampling: the tokens it drops -----------------------------------------------------------
@pytest.mark.parametrize(("rs", "threshold"), [("token_k1", "0.97_1.03"), ("seq_max_k2", "0.003")])
def test_the_sampler_records_show_the_tokens_verls_rejection_sampling_removed(
    bf16_rollouts, rs, threshold, tmp_path
):
    """verl's rejection sampling (``algorithm.rollout_correction.rollout_rs``: per token, ``token_k1`` keeping
    rho in [0.97, 1.03]; per sequence, ``seq_max_k2`` rejecting a sequence whose largest (log rho)^2 / 2 exceeds
    0.003) beside token TIS (cap 1.02) removes tokens from the batch's ``response_mask``, which the loss trains on.
    The probe's `sampler` records still hold every response token; those verl rejected (its returned mask against
    the one it was given) have ``is_weight`` 0, ``seq_masked`` marks the sequences it rejected whole, the kept
    tokens carry verl's ``rollout_is_weights``; the probe's `tokens` records follow the loss's mask, on the same
    (micro, row, pos) keys; and `tokendyn analyze`'s mismatch table counts the rejected in ``frac_masked`` /
    ``frac_seq_masked``."""
    from tokendyn.analysis import analyze_run

    run = tmp_path / "run"
    worker, _ = probed_actor(run, reweight_alpha=0.0)
    data, mask, metrics = corrected_batch(
        worker, bf16_rollouts, rollout_is="token", rollout_is_threshold="1.02",
        rollout_rs=rs, rollout_rs_threshold=threshold,
    )  # fmt: skip
    valid, kept = mask.bool(), data["response_mask"].bool()
    rejected = valid & ~kept
    whole = rejected.sum(1) == valid.sum(1)  # the sequences verl rejected at every token
    n, n_rejected = int(valid.sum()), int(rejected.sum())
    print(
        f"{rs} {threshold}: {n_rejected} of {n} tokens rejected, {int(whole.sum())} of {len(whole)} sequences "
        f"whole (verl: rollout_rs_masked_fraction {metrics['rollout_corr/rollout_rs_masked_fraction']:.3f})"
    )
    assert 0 < n_rejected < n  # the rejection binds, and keeps some
    if rs.startswith("seq"):
        assert torch.equal(rejected, whole[:, None] & valid)  # a sequence mode rejects whole sequences
        assert 0 < int(whole.sum()) < len(whole)
    cpu.update_actor(worker, data)
    worker._tokendyn_probe.detach()  # flush the records

    rows = sampler_records(run)
    assert rows.height == n  # every response token, the rejected included
    seq, pos = torch.tensor(rows["seq"].to_list()), torch.tensor(rows["pos"].to_list())
    assert torch.equal(valid[seq, pos], torch.ones(n, dtype=torch.bool))
    weight = torch.tensor(rows["is_weight"].to_list(), dtype=torch.float64)
    is_rejected = rejected[seq, pos]
    assert torch.equal(weight[is_rejected], torch.zeros(n_rejected, dtype=torch.float64))
    assert torch.equal(weight[~is_rejected], data["rollout_is_weights"][seq, pos][~is_rejected].double())
    assert bool((weight[~is_rejected] > 0).all())  # TIS truncates, never zeroes: 0 means rejected
    assert torch.equal(torch.tensor(rows["seq_masked"].to_list()), whole[seq])

    # the probe's other records follow the loss's mask: its token rows are the kept tokens, on the same keys
    tokens = pl.read_parquet(sorted((run / "records").glob("tokens-*.parquet")))
    keys = tokens.select("micro", "row", "pos").unique()
    assert keys.height == int(kept.sum())
    assert keys.join(rows.select("micro", "row", "pos"), on=["micro", "row", "pos"], how="anti").height == 0
    assert torch.equal(kept[keys["micro"].to_torch() * 6 + keys["row"].to_torch(), keys["pos"].to_torch()],
                       torch.ones(keys.height, dtype=torch.bool))  # fmt: skip

    table = analyze_run(run, write=False)["mismatch"]
    every = table.filter((pl.col("side") == "pi_old") & (pl.col("bin") == -1)).row(0, named=True)
    assert every["count"] == n
    assert every["frac_masked"] == pytest.approx(n_rejected / n, abs=1e-12)
    assert every["frac_seq_masked"] == pytest.approx(int((whole[:, None] & valid).sum()) / n, abs=1e-12)


@pytest.mark.parametrize("multi_turn", [False, True])
def test_under_verls_multi_turn_rollout_the_sampler_rows_are_the_loss_mask(multi_turn):
    """A batch as verl's trainer hands it to the actor (`DataProto.to_tensordict` with the trainer's ``meta_info``
    ``multi_turn``, then `left_right_2_no_padding`): single-turn, the rows are every response token of the attention
    mask, a rejected one weighted 0; multi-turn, where the response also holds tool outputs outside the agent loop's
    ``response_mask`` that nothing in the batch tells from a rejected token, the rows are the loss's mask."""
    from verl import DataProto
    from verl.workers.utils.padding import left_right_2_no_padding

    from tokendyn.integrations.verl.layout import response_layout
    from tokendyn.integrations.verl.sampler import sampler_frame

    prompts = torch.tensor([[0, 5, 6], [7, 8, 9]])
    responses = torch.tensor([[11, 12, 13, 14, 15], [16, 17, 18, 0, 0]])
    attention = torch.cat([torch.tensor([[0, 1, 1], [1, 1, 1]]), (responses > 0).long()], dim=1)
    # tool output at row 0, pos 2-3 (multi-turn) or two rejected tokens (single-turn); row 1 pos 1 rejected
    mask = torch.tensor([[1, 1, 0, 0, 1], [1, 0, 1, 0, 0]])
    fields = {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
              "attention_mask": attention, "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
              "response_mask": mask, "old_log_probs": -torch.rand(2, 5), "rollout_log_probs": -torch.rand(2, 5)}  # fmt: skip
    proto = DataProto.from_single_dict(fields, meta_info={"multi_turn": multi_turn, "temperature": 1.0})
    data = left_right_2_no_padding(proto.to_tensordict())
    valid = response_layout(data["input_ids"], data, 5, packed=True).valid
    frame = sampler_frame(data, valid, data["response_mask"], 0, "train", 0, 0)
    tokens = mask.bool() if multi_turn else attention[:, 3:].bool()
    assert frame.select("row", "pos").rows() == [tuple(p) for p in tokens.nonzero().tolist()]
    assert frame["is_weight"].to_list() == mask[tokens].double().tolist()
    assert not frame["seq_masked"].any()
