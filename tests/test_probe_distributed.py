"""Two CPU processes (torchrun, gloo) against one process on the same global batch (docs/gpus.md, "Several
processes").

Three ways to split one GRPO micro-batch of 8 sequences over 2 ranks, each rank probing its 4 and writing its own
shard; the merged records must equal the one-process run over all 8 (the independent reference):
  * manual: no wrapper, each rank's loss normalised by the global token count (nothing averages the gradients);
  * ddp: DistributedDataParallel, each rank's loss scaled as TRL does (DAPO: sum over its tokens / (N / world)),
    the gradients averaged by DDP;
  * fsdp: the same loss on a model sharded with FSDP2 `fully_shard` (every decoder layer, then the root);
  * fsdp_keep: the same with reshard_after_forward=False (the weights stay gathered between forward and backward);
  * fsdp_bf16: the same with FSDP2 mixed precision (bfloat16 compute): equal to bfloat16's resolution only.
Under DDP and FSDP2 the training gradients must also be bitwise those of the same step without the probe.

Run by pytest, this file launches itself under `torchrun --nproc_per_node 2`; as a script it is the worker."""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import polars as pl
import pytest
import torch

pytestmark = pytest.mark.slow_tier  # the slow tier: `make test-slow` (docs/development.md)

HERE = Path(__file__).resolve().parent
BINS = {"intervals": None, "quantiles": "quantiles:3"}
T = 0.7
# every direct token on every micro-batch (a budget would cut a rank's replay by its own micro-batch's flops)
PROBE = {
    "check_tokens": None,
    "sample_tokens": 128,
    "direct_tokens": 64,
    "direct_budget": None,
    "temperature": T,
}
# FSDP2 analyses vs one process, max |difference| / max |value| of each column. The float32 forwards agree bitwise
# (one CPU thread; the model called whole instead of backbone + chunked head) and FSDP2 averages identical
# gradients exactly, so only the order of the float64 sums over shards differs (measured <= 5e-16)
FSDP_RTOL = 1e-9
FSDP_WRAPS = (
    "fsdp",
    "fsdp_keep",
)  # layers resharded after their forward, or kept gathered until the backward


def _model_and_batch():
    from _models import make_batch, tiny_qwen2

    model = tiny_qwen2(sharpen=30.0)
    return model, make_batch(model, n=8)


def dp_step(model, batch, rows: slice, world: int, run_dir=None) -> None:
    """One GRPO micro-step on `rows` of `batch` as one of `world` data-parallel ranks under TRL: the DAPO loss of
    these rows is sum_t l_t / (N / world) (N = the global token count), the wrapper averages the gradients; probed
    (records to run_dir) when run_dir is given."""
    from contextlib import nullcontext

    from _models import Batch, completion_logps, grpo_loss

    from tokendyn.hooks import instrument

    n_global = batch.completion_mask.sum()
    sub = Batch(*(getattr(batch, f)[rows] for f in Batch.__dataclass_fields__))
    ctx = nullcontext() if run_dir is None else instrument(model, run_dir, **PROBE)
    with ctx as probe:
        out = model(input_ids=sub.input_ids, attention_mask=sub.attention_mask, use_cache=False)
        logps = completion_logps(out.logits, sub, T)
        old = (logps.detach() - 0.05 * (sub.completion_ids % 3)).clamp(max=0)
        if probe is not None:
            probe.begin_step(
                step=0,
                completion_mask=sub.completion_mask,
                advantages=sub.advantages,
                old_logp=old,
                completion_ids=sub.completion_ids,
                logps=logps,
                temperature=T,
            )
        loss = grpo_loss(logps, old, sub.advantages, sub.completion_mask) * sub.completion_mask.sum()
        (loss / (n_global / world)).backward()


def _grads(model) -> list[torch.Tensor]:
    return [
        (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone() for p in model.parameters()
    ]


def _wrapped(kind: str):
    """A fresh copy of the policy (same seed on every rank), wrapped for data parallelism."""
    from _models import tiny_qwen2

    model = tiny_qwen2(sharpen=30.0)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model), model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if kind == "fsdp_bf16" else None)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=kind != "fsdp_keep")
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model, model


def worker(out_dir: str) -> None:
    import torch.distributed as dist
    from _models import probed_rows

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2
    model, batch = _model_and_batch()
    half = batch.input_ids.shape[0] // world
    rows = slice(rank * half, (rank + 1) * half)
    for name, bins in BINS.items():
        probed_rows(model, batch, rows, Path(out_dir) / name, rank=None, bins=bins, data_parallel_size=1)
    for kind in ("ddp", "fsdp", "fsdp_keep", "fsdp_bf16"):
        plain, inner = _wrapped(kind)
        dp_step(plain, batch, rows, world)
        probed, inner_probed = _wrapped(kind)
        dp_step(probed, batch, rows, world, Path(out_dir) / kind)
        same = [torch.equal(a, b) for a, b in zip(_grads(inner), _grads(inner_probed), strict=True)]
        assert all(same), f"{kind}: {same.count(False)} parameter gradients changed by the probe"
    dist.barrier()
    dist.destroy_process_group()


def trl_worker(model_dir: str, out_dir: str) -> None:
    """One probed optimizer step of the TRL trainer on 2 ranks (DDP, 2 micro-batches of 8 completions each).
    On the first pass the ratio is 1, so the DAPO loss gives every token w = dL/dlog pi = -A / N, N = the
    completion tokens of the whole (all-rank) rollout batch: the records must hold exactly that on every rank."""
    from test_trainer import _config, _trainer

    from tokendyn.trainers.grpo import TokendynGRPOTrainer

    class Recording(TokendynGRPOTrainer):
        def _compute_loss(self, model, inputs):
            self.n_items = float(inputs["num_items_in_batch"])
            return super()._compute_loss(model, inputs)

    torch.set_num_threads(1)
    args = _config(
        Path(out_dir), max_steps=1, probe_every=1, probe_analyses="none", ddp_find_unused_parameters=False
    )
    trainer = _trainer(model_dir, args, cls=Recording)
    trainer.train()
    rank = trainer.accelerator.process_index
    tokens = pl.read_parquet(shard_files(Path(args.output_dir), "tokens")).filter(
        (pl.col("rank") == rank) & (pl.col("point") == "final_norm.out") & (pl.col("advantage") != 0)
    )
    expected = -tokens["advantage"] / trainer.n_items
    err = float(((tokens["w"] - expected).abs() / expected.abs()).max())
    assert tokens.height > 0 and err < 1e-5, f"rank {rank}: w vs -A/N max rel err {err}"
    torch.distributed.barrier()


ANALYSED = ("shares", "token_shares", "prob_change", "influence")


def analysis_sample(model, batch):
    """The analysed sample as a `ProbeBatch` (pi_old a fixed perturbation of the unsharded model's pi, so that both
    runs bin the same tokens) and its two Lopti stage masks (eta 0.5)."""
    from tokendyn.effects.influence import lopti_stage_masks
    from tokendyn.probe.tokenloss import ProbeBatch, completion_logp

    pb = ProbeBatch(
        batch.input_ids, batch.attention_mask, batch.completion_mask, batch.advantages, temperature=T
    )
    with torch.no_grad():
        logp = completion_logp(model, pb, float64=True)
    pb = pb.with_old_logp((logp - 0.05 * (pb.completion_ids % 3)).clamp(max=0.0))
    return pb, lopti_stage_masks(pb, eta=0.5)


def rebalancing_frames(model, pb, masks) -> dict[str, pl.DataFrame]:
    """Every rebalancing analysis of `pb`: with the Lopti stages (shares, prob_change with an lr sweep, influence,
    and the stage-2 shares) and without (update_stage "all"), on an SGD lr large enough to move pi visibly."""
    from tokendyn.effects.rebalance import RebalanceOptions, analyze_batch, stage_shares_frame

    # step_precision "model": FSDP2's shards are stepped in their own dtype (no float64 copy of a sharded model),
    # so the one-process reference is too
    opts = RebalanceOptions(token_shares=8, lr=0.05, lr_sweep=(0.05, 1.0), step_precision="model")
    lopti = analyze_batch(model, pb, step=0, options=opts, stage_masks=masks)
    plain = analyze_batch(model, pb, step=1, options=opts)
    frames = {k: pl.concat([v, plain[k]]) for k, v in lopti.items() if k in plain}
    frames["shares"] = pl.concat(
        [frames["shares"], stage_shares_frame(model, pb, masks[1], step=0, stage="high")]
    )
    return frames


def fsdp_analyses_worker(out_dir: str) -> None:
    """Every rank runs the rebalancing analyses on the same global sample of an FSDP2-sharded model and writes what
    it got; the model is bitwise unchanged by them, and the training step after them (probed) has bitwise the
    gradients of the same step without probe or analyses."""
    import torch.distributed as dist

    from tokendyn.probe.parallel import local

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, batch = _model_and_batch()
    pb, masks = analysis_sample(reference, batch)
    rows = slice(rank * 4, (rank + 1) * 4)
    for wrap in FSDP_WRAPS:
        model, _ = _wrapped(wrap)
        before = [local(p).clone() for p in model.parameters()]
        with pytest.warns(UserWarning, match="per-token shares"):
            frames = rebalancing_frames(model, pb, masks)
        assert all(torch.equal(a, local(b)) for a, b in zip(before, model.parameters(), strict=True)), wrap
        for kind, frame in frames.items():
            frame.write_parquet(Path(out_dir) / f"{wrap}-{kind}-rank{rank}.parquet")
        dp_step(model, batch, rows, world, Path(out_dir) / f"probed-{wrap}")
        plain, _ = _wrapped(wrap)
        dp_step(plain, batch, rows, world)
        same = [torch.equal(a, b) for a, b in zip(_grads(plain), _grads(model), strict=True)]
        assert all(same), f"{wrap}: {same.count(False)} parameter gradients changed by the analyses"
    dist.barrier()
    dist.destroy_process_group()


FLOAT64_STEPS = ("float64_step", "measured")  # sharded float64 steps: asked for, and chosen by the check


def float64_frames(model, pb, masks, precision: str) -> dict[str, pl.DataFrame]:
    """The counterfactual update, the lr sweep and the influence matrix of `pb` with Lopti's stages, their steps in
    float64 (``precision``); per-token and per-bin shares off (they do not step)."""
    from tokendyn.effects.rebalance import RebalanceOptions, analyze_batch

    opts = RebalanceOptions(
        shares=False, token_shares=0, lr=0.05, lr_sweep=(0.05, 1.0), step_precision=precision
    )
    return analyze_batch(model, pb, step=0, options=opts, stage_masks=masks)


# the FSDP2 layouts of the float64 tests (pi from the sharded float64 forward on each): whether the records with
# float64 steps are compared with one process's too
FLOAT64_LAYOUTS = {
    "fsdp": True,  # every decoder layer, then the root
    "fsdp_keep": True,  # the same, weights kept gathered between forward and backward
    "fsdp_bf16": False,  # FSDP2 mixed precision, bf16 compute (no one-process reference of its gradients)
    "bf16": True,  # pure bf16 weights, sharded
    "partial": False,  # the layers sharded, not the root: embeddings and head plain (the analyses refuse it)
    "lora_embed": False,  # a PEFT LoRA on the embeddings, whose parameters their parent module reads
}


def float64_layout(kind: str, shard: bool):
    """The policy of one `FLOAT64_LAYOUTS` layout, sharded with `fully_shard` on this process group (``shard``), or
    the same weights unsharded (the one-process reference)."""
    from _models import tiny_qwen2

    if kind in ("fsdp", "fsdp_keep", "fsdp_bf16"):
        return _wrapped(kind)[0] if shard else tiny_qwen2(sharpen=30.0)
    model = tiny_qwen2(sharpen=30.0)
    if kind == "bf16":
        model = model.to(torch.bfloat16)
    if kind == "lora_embed":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        cfg = LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"], init_lora_weights=False)
        model = get_peft_model(model, cfg).base_model.model  # (the causal LM, its modules adapted)
    if shard:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        if kind != "partial":
            fully_shard(model, mesh=mesh)
    return model


def fsdp_float64_worker(out_dir: str) -> None:
    """Every rank analyses the same sample of an FSDP2-sharded model with float64 steps (`float64_step`, and the
    measured check, which makes them): the float64 point sharded, pi from a float64 forward that gathers each unit's
    float64 parameters while it runs. Also that forward alone on every `FLOAT64_LAYOUTS` layout, and that it
    refuses a forward with grad. The model is bitwise unchanged by all of it, FSDP2's own forward after it too."""
    import importlib.util

    import torch.distributed as dist

    from tokendyn.effects.change import completion_probs
    from tokendyn.probe.float64 import as_float64
    from tokendyn.probe.parallel import local

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    reference, batch = _model_and_batch()
    pb, masks = analysis_sample(reference, batch)
    for kind, records in FLOAT64_LAYOUTS.items():
        if kind == "lora_embed" and importlib.util.find_spec("peft") is None:
            continue
        model = float64_layout(kind, shard=True)
        before = [local(p).clone() for p in model.parameters()]
        own = completion_probs(model, pb)
        with as_float64(model):
            pi64 = completion_probs(model, pb)
            with pytest.raises(RuntimeError, match="only without grad"):
                model(input_ids=pb.input_ids, attention_mask=pb.attention_mask)
        torch.save(pi64, Path(out_dir) / f"{kind}-pi64-rank{rank}.pt")
        assert torch.equal(completion_probs(model, pb), own), f"{kind}: FSDP2's own forward changed"
        if kind == "partial":  # (norms summed over the ranks would count a plain parameter once per rank)
            with pytest.raises(ValueError, match="apply fully_shard to the root module too"):
                float64_frames(model, pb, masks, "float64_step")
        for precision in FLOAT64_STEPS if records else ():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the limit and the shares' JVPs skipped under FSDP2)
                frames = float64_frames(model, pb, masks, precision)
            for name, frame in frames.items():
                frame.write_parquet(Path(out_dir) / f"{kind}-{precision}-{name}-rank{rank}.parquet")
        same = all(torch.equal(a, local(b)) for a, b in zip(before, model.parameters(), strict=True))
        assert same, f"{kind}: the float64 analyses changed the model"
    dist.barrier()
    dist.destroy_process_group()


# the configuration matrix under FSDP2 (`tests/_matrix.py`'s architectures x adapters): float32 shards, float32
# shards computing in bf16 (mixed precision) and bf16 shards; the analyses' records compared where one process has
# the same gradients (not under mixed precision)
MATRIX_LAYOUTS = {"float32": True, "mixed": False, "bf16": True}


def matrix_cells(archs, adapters) -> list[tuple[str, str, str]]:
    """(arch, adapter, layout): every architecture in every layout, full; LoRA in float32 (every value of every axis
    and every architecture x dtype pair, as `tests/_matrix.py` crosses them)."""
    return [
        (a, d, lay)
        for a in archs
        for d in adapters
        for lay in MATRIX_LAYOUTS
        if d == "full" or lay == "float32"
    ]


def matrix_model(arch: str, adapter: str, layout: str, shard: bool):
    """`tests/_matrix.py`'s policy of ``arch`` with ``adapter``, in the layout's dtype, sharded with `fully_shard`
    (every block of its decoder's layer list, then the causal LM) when ``shard``."""
    from _matrix import build, with_adapter

    model = with_adapter(build(arch), adapter).eval()
    if layout == "bf16":
        model = model.to(torch.bfloat16)
    if shard:
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if layout == "mixed" else None)
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        layers = next(m for m in lm.modules() if isinstance(m, nn.ModuleList) and len(m) > 1)
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(lm, mesh=mesh, mp_policy=mp)
    return model


@functools.cache
def matrix_batch(arch: str):
    """The matrix's sampled batch of the float32 full model of ``arch`` (ragged completions, ratio != 1)."""
    from _matrix import build, sample_batch

    from tokendyn.probe.tokenloss import ProbeBatch

    b = sample_batch(build(arch).eval())
    mask = b.completion_mask.bool()
    pb = ProbeBatch(b.input_ids, torch.ones_like(b.input_ids), mask, b.advantages, temperature=T)
    return pb.with_old_logp(b.old_logp)


def fsdp_matrix_worker(out_dir: str) -> None:
    """Every cell of the matrix under FSDP2 on 2 ranks: pi from the sharded float64 forward, and (`MATRIX_LAYOUTS`)
    the counterfactual update, lr sweep and influence matrix with sharded float64 steps; the model bitwise unchanged."""
    import torch.distributed as dist
    from _matrix import ADAPTERS, ARCHS

    from tokendyn.effects.change import completion_probs
    from tokendyn.probe.float64 import as_float64
    from tokendyn.probe.parallel import local

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for arch, adapter, layout in matrix_cells(ARCHS, ADAPTERS):
        pb = matrix_batch(arch)
        records = MATRIX_LAYOUTS[layout]
        model = matrix_model(arch, adapter, layout, shard=True)
        before = [local(p).clone() for p in model.parameters()]
        with as_float64(model):
            pi64 = completion_probs(model, pb)
        cell = f"{arch}-{adapter}-{layout}"
        torch.save(pi64, Path(out_dir) / f"{cell}-pi64-rank{rank}.pt")
        if records:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the limit skipped under FSDP2; float32 steps' rounding)
                frames = float64_frames(model, pb, None, "float64_step")
            for name in ("prob_change", "influence"):
                frames[name].write_parquet(Path(out_dir) / f"{cell}-{name}-rank{rank}.parquet")
        same = all(torch.equal(a, local(b)) for a, b in zip(before, model.parameters(), strict=True))
        assert same, f"{cell}: the float64 analyses changed the model"
    dist.barrier()
    dist.destroy_process_group()


def sampled_rollouts(prompts: list[str], trainer) -> dict:
    """A TRL ``rollout_func``: completions sampled from the policy at the training temperature, each with a generator
    seeded by its index in the global generation batch (process r holds the prompts r * n .. (r + 1) * n - 1 of it),
    so one process and two draw the same global batch."""
    tok, model = trainer.processing_class, trainer.accelerator.unwrap_model(trainer.model)
    start = trainer.accelerator.process_index * len(prompts)
    prompt_ids, completion_ids = [], []
    for i, prompt in enumerate(prompts):
        ids = tok(prompt)["input_ids"]
        gen = torch.Generator().manual_seed(1000 * trainer.state.global_step + start + i)
        out: list[int] = []
        with torch.no_grad():
            while len(out) < trainer.max_completion_length and (not out or out[-1] != tok.eos_token_id):
                logits = (
                    model(input_ids=torch.tensor([ids + out])).logits[0, -1].float() / trainer.temperature
                )
                out.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
        prompt_ids.append(ids)
        completion_ids.append(out)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def analysed_run(model_dir: str, out_dir: Path, per_device: int, probe_every: int = 1) -> list[torch.Tensor]:
    """One Lopti rollout batch of 16 completions (2 micro-batches per stage, one SGD step per stage) of the TRL
    trainer with every rebalancing analysis on 12 of its sequences; per_device 4 on 2 ranks or 8 on one process.
    Returns the trained parameters."""
    from datasets import Dataset
    from test_trainer import PROMPTS, _config, vowel_reward
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from tokendyn.trainers.grpo import TokendynGRPOTrainer

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    args = _config(
        out_dir, max_steps=2, per_device_train_batch_size=per_device, probe_every=probe_every,
        probe_sample_sequences=12, lopti_eta=0.5, probe_lr_sweep=[1e-3, 1.0], ddp_find_unused_parameters=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = TokendynGRPOTrainer(
        model=model,
        reward_funcs=vowel_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir),
        optimizers=(torch.optim.SGD(model.parameters(), lr=0.05), None),
        rollout_func=sampled_rollouts,
    )
    trainer.train()
    return [p.detach().clone() for p in model.parameters()]


def _launch(out: Path, *extra: str) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__]
    proc = subprocess.run([*cmd, *extra, str(out)], env=env, capture_output=True, text=True, timeout=300)
    # gloo can abort a process at exit under CPU load ("terminate called without an active exception", seen a few
    # times in ~30 runs on 2 CPU cores) after its work is done: accept only that, and only when every rank marked
    # its work done
    teardown_abort = "terminate called without an active exception" in proc.stderr
    done = all((out / f".done-rank{r}").is_file() for r in range(2))
    assert proc.returncode == 0 or (teardown_abort and done), proc.stdout[-3000:] + proc.stderr[-3000:]


def _max_rel(a: pl.Series, b: pl.Series) -> float:
    a, b = a.cast(pl.Float64), b.cast(pl.Float64)
    ok = a.is_not_null() & b.is_not_null()
    assert (a.is_null() == b.is_null()).all()
    den = b.filter(ok).abs().max() or 1.0
    return float(((a.filter(ok) - b.filter(ok)).abs() / den).max() or 0.0)


def test_ddp_and_fsdp2_records_equal_one_process_on_the_global_batch(tmp_path):
    from _models import probed_rows
    from test_records import BIN_COLS, BOUND_COLS, CHECK_COLS, assert_frames_close

    from tokendyn.analysis import analyze_run
    from tokendyn.records import records_dir, shard_files

    _launch(tmp_path / "two")
    torch.set_num_threads(1)
    model, batch = _model_and_batch()
    for name, bins in BINS.items():
        probed_rows(model, batch, slice(0, 8), tmp_path / "one" / name, rank=0, bins=bins)
        two = tmp_path / "two" / name
        assert [f.name for f in shard_files(two, "binstats")] == [
            "binstats-rank000-000000.parquet",
            "binstats-rank001-000000.parquet",
        ]
        a, b = analyze_run(tmp_path / "one" / name), analyze_run(two)
        n_tokens = int(batch.completion_mask.sum())
        assert a["bins"].filter(pl.col("point") == "final_norm.out")["tokens"].sum() == n_tokens
        assert_frames_close(a["bins"], b["bins"], ["stage", "point", "bin"], [*BIN_COLS, "bin_lo", "bin_hi"])
        assert_frames_close(a["bound"], b["bound"], ["stage", "point"], BOUND_COLS)
        assert_frames_close(a["checks"], b["checks"], ["stage"], CHECK_COLS)
        assert b["checks"]["micro_batches"].to_list() == [2]
        assert b["checks"]["logits_violations"].to_list() == [0] and b["checks"][
            "head_violations"
        ].to_list() == [0]
    # quantile edges are shared by the ranks (all-reduced histogram) and are not the fixed intervals
    edges = (
        analyze_run(tmp_path / "two" / "quantiles", write=False)["bins"]["bin_hi"].unique().sort().to_list()
    )
    assert len(edges) == 3 and edges[-1] == 1.0 and edges[0] not in (0.25, 0.5)

    # DDP and FSDP2 against one process on the same 8 sequences (same model, same TRL-style loss, world = 1)
    dp_step(model, batch, slice(0, 8), 1, tmp_path / "one" / "dp")
    one = analyze_run(tmp_path / "one" / "dp", write=False)
    one_tokens = pl.read_parquet(records_dir(tmp_path / "one" / "dp") / "tokens-rank000-000000.parquet")
    assert one_tokens["direct_norm"].null_count() == 0 and one_tokens.height == 3 * n_tokens
    key = ["row", "pos", "point"]
    ratios = {}
    for kind in ("ddp", "fsdp", "fsdp_keep"):
        two = analyze_run(tmp_path / "two" / kind, write=False)
        assert two["bins"]["tokens"].to_list() == one["bins"]["tokens"].to_list()
        assert_frames_close(one["bins"], two["bins"], ["stage", "point", "bin"], BIN_COLS)
        direct = ["direct_n", "C_direct", "D_direct", "unreached"]
        assert_frames_close(one["bound"], two["bound"], ["stage", "point"], [*BOUND_COLS, *direct])
        assert_frames_close(one["checks"], two["checks"], ["stage"], CHECK_COLS)
        assert two["checks"]["identity_max_scaled_err"].item() < 1e-5  # delta and w scaled alike
        tok = pl.read_parquet(shard_files(tmp_path / "two" / kind, "tokens")).with_columns(
            row=pl.col("row") + 4 * pl.col("rank")
        )
        joined = one_tokens.join(tok, on=key, how="full", suffix="_dp")
        assert joined.height == one_tokens.height == tok.height
        cols = ["w", "norm", "ratio", "direct_norm", "direct_ratio", "pi", "identity_rel_err"]
        ratios[kind] = {c: _max_rel(joined[f"{c}_dp"], joined[c]) for c in cols}
        merged = two["bins"].join(one["bins"], on=["stage", "point", "bin"], suffix="_one")
        ratios[kind]["norm_mean_over_one"] = (
            merged.select(pl.col("norm_mean") / pl.col("norm_mean_one")).to_series().to_list()
        )
        assert all(v < 1e-5 for k, v in ratios[kind].items() if k in cols[:-1]), ratios[kind]
    # bfloat16 compute: every token recorded, direct gradients replayed in bfloat16, the same numbers to ~1e-2
    two = analyze_run(tmp_path / "two" / "fsdp_bf16", write=False)
    assert two["bins"]["tokens"].to_list() == one["bins"]["tokens"].to_list()
    assert (
        two["bound"]["unreached"].sum() == 0
        and two["bound"]["direct_n"].to_list() == one["bound"]["direct_n"].to_list()
    )
    tok = pl.read_parquet(shard_files(tmp_path / "two" / "fsdp_bf16", "tokens")).with_columns(
        row=pl.col("row") + 4 * pl.col("rank")
    )
    joined = one_tokens.join(tok, on=key, suffix="_dp")
    ratios["fsdp_bf16"] = {c: _max_rel(joined[f"{c}_dp"], joined[c]) for c in ("w", "norm", "direct_norm")}
    assert all(v < 0.05 for v in ratios["fsdp_bf16"].values()), ratios["fsdp_bf16"]
    print(json.dumps(ratios))


def test_rebalancing_analyses_under_fsdp2_equal_one_process_on_the_same_sample(tmp_path):
    """FSDP2 `fully_shard` (every decoder layer, then the root) on 2 ranks, every rank analysing the same 8 sequences,
    against one process on the unsharded model: per-bin shares and norms, the counterfactual delta pi (its correct
    ratios and ties exactly), the lr sweep and the influence matrix, with and without Lopti stages. The per-token
    shares and the lr -> 0 limit (forward-mode JVPs) are not computed under FSDP2 (a warning; the shares' jvp_share
    null, no limit rows). Both ranks record the same."""
    _launch(tmp_path, "fsdp_analyses")
    torch.set_num_threads(1)
    model, batch = _model_and_batch()
    pb, masks = analysis_sample(model, batch)
    one = rebalancing_frames(model, pb, masks)
    diffs = {}
    for wrap, kind in itertools.product(FSDP_WRAPS, ("shares", "prob_change", "influence")):
        a, b = (pl.read_parquet(tmp_path / f"{wrap}-{kind}-rank{r}.parquet") for r in (0, 1))
        assert a.equals(b), f"{wrap} {kind}: the ranks differ"
        ref = one[kind]
        if kind == "shares":
            assert b["jvp_share"].null_count() == b.height and ref["jvp_share"].null_count() < ref.height
            b, ref = b.drop("jvp_share"), ref.drop("jvp_share")
        # the lr -> 0 limit (a forward-mode JVP) is skipped under FSDP2, as the token shares are
        if kind == "prob_change":
            assert not b["limit"].fill_null(False).any() and ref["limit"].fill_null(False).any()
            ref = ref.filter(~pl.col("limit").fill_null(False))
        floats = [c for c, t in ref.schema.items() if t == pl.Float64 and c not in ("lr", "bin_lo", "bin_hi")]
        # ratios of counts: exact when the signs of delta pi agree
        exact = [c for c in floats if c.startswith("correct_")]
        keys = [c for c in ref.columns if c not in floats or c in exact]
        ref, b = ref.sort(keys, nulls_last=True), b.sort(keys, nulls_last=True)
        assert ref.height > 0 and ref.select(keys).equals(b.select(keys)), kind
        diffs[f"{wrap}:{kind}"] = max(_max_rel(b[c], ref[c]) for c in floats if c not in exact)
    print(json.dumps(diffs))
    assert all(v < FSDP_RTOL for v in diffs.values()), diffs
    assert "token_shares" in one and not list(tmp_path.glob("*token_shares*"))


def test_sharded_float64_steps_under_fsdp2_equal_one_process(tmp_path):
    """FSDP2 on 2 ranks with float64 steps (the float64 point sharded, 8 bytes a parameter / world size): pi from
    the sharded float64 forward equals one process's float64 model bitwise on every layout (FSDP2 mixed precision
    bf16: its casts paused; pure bf16 weights; a root left unsharded; a LoRA on the embeddings), and the
    counterfactual update, the lr sweep and the influence matrix with `float64_step` and with the measured check
    (its `precision_check` records too) equal one process's on the same sample. Pure bf16 shards check against
    their own float64 steps (`float64_step`), where one bf16 process checks against the all-float64 path: their
    `float64_step` records are compared, not the check's."""
    import importlib.util

    from tokendyn.effects.change import completion_probs
    from tokendyn.probe.float64 import as_float64

    _launch(tmp_path, "fsdp_float64")
    torch.set_num_threads(1)
    pb, masks = analysis_sample(*_model_and_batch())
    diffs = {}
    for kind, records in FLOAT64_LAYOUTS.items():
        if kind == "lora_embed" and importlib.util.find_spec("peft") is None:
            continue
        model = float64_layout(kind, shard=False)
        with as_float64(model):
            want = completion_probs(model, pb)
        for r in (0, 1):
            assert torch.equal(torch.load(tmp_path / f"{kind}-pi64-rank{r}.pt"), want), (kind, r)
        for precision in FLOAT64_STEPS if records else ():
            if kind == "bf16" and precision == "measured":
                continue
            one = float64_frames(model, pb, masks, precision)
            assert ("precision_check" in one) == (precision == "measured"), (kind, precision)
            for name in one:
                a, b = (
                    pl.read_parquet(tmp_path / f"{kind}-{precision}-{name}-rank{r}.parquet") for r in (0, 1)
                )
                ref, a, b = (
                    f.drop("seconds_float64", "seconds_model", strict=False) for f in (one[name], a, b)
                )
                assert a.equals(b), f"{kind} {precision} {name}: the ranks differ (wall times apart)"
                if name == "prob_change":  # (the lr -> 0 limit, a forward-mode JVP, is skipped under FSDP2)
                    ref = ref.filter(~pl.col("limit").fill_null(False))
                    assert set(b["step_dtype"].drop_nulls()) == {"float64"}, b["step_dtype"].unique()
                diffs[f"{kind}:{precision}:{name}"] = _frames_close(ref, b, name)
    print(json.dumps(diffs))
    assert len(diffs) == 2 * 5 + 2 and all(v < FSDP_RTOL for v in diffs.values()), diffs


def test_sharded_float64_steps_through_the_configuration_matrix(tmp_path):
    """Every architecture of the configuration matrix sharded with FSDP2 on 2 ranks, in float32, mixed precision
    (bf16 compute) and bf16 weights, and with a LoRA in float32 (`matrix_cells`): pi from the sharded float64 forward equals one process's float64 model
    bitwise, and the records with sharded float64 steps (float32 and bf16 weights) equal one process's."""
    from _matrix import ADAPTERS, ARCHS

    from tokendyn.effects.change import completion_probs
    from tokendyn.probe.float64 import as_float64

    pytest.importorskip("peft")
    _launch(tmp_path, "fsdp_matrix")
    torch.set_num_threads(1)
    diffs = {}
    for arch, adapter, layout in matrix_cells(ARCHS, ADAPTERS):
        pb = matrix_batch(arch)
        records = MATRIX_LAYOUTS[layout]
        cell = f"{arch}-{adapter}-{layout}"
        model = matrix_model(arch, adapter, layout, shard=False)
        with as_float64(model):
            want = completion_probs(model, pb)
        for r in (0, 1):
            assert torch.equal(torch.load(tmp_path / f"{cell}-pi64-rank{r}.pt"), want), (cell, r)
        if not records:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            one = float64_frames(model, pb, None, "float64_step")
        for name in ("prob_change", "influence"):
            a, b = (pl.read_parquet(tmp_path / f"{cell}-{name}-rank{r}.parquet") for r in (0, 1))
            assert a.equals(b), f"{cell} {name}: the ranks differ"
            ref = one[name]
            if name == "prob_change":  # (the lr -> 0 limit, a forward-mode JVP, is skipped under FSDP2)
                ref = ref.filter(~pl.col("limit").fill_null(False))
                assert set(b["step_dtype"].drop_nulls()) == {"float64"}, (cell, b["step_dtype"].unique())
            diffs[f"{cell}:{name}"] = _frames_close(ref, b, name)
    print(json.dumps(diffs))
    # <= 7e-16 on every cell but phi's full model: 3e-11 (float32) and 1.1e-9 (bf16, its step norm), a gradient whose
    # float32 / bf16 rounding differs by an ulp here and there (the gathered weights are views of FSDP2's flat buffer)
    recorded = sum(MATRIX_LAYOUTS[c[2]] for c in matrix_cells(ARCHS, ADAPTERS))
    assert len(diffs) == 2 * recorded == 2 * 36 and all(v < 1e-8 for v in diffs.values()), diffs


def _frames_close(ref: pl.DataFrame, got: pl.DataFrame, kind: str) -> float:
    """Every key column and correct ratio equal, and the largest relative difference of the other float columns."""
    floats = [c for c, t in ref.schema.items() if t == pl.Float64 and c not in ("lr", "bin_lo", "bin_hi")]
    exact = [c for c in floats if c.startswith("correct_")]
    keys = [c for c in ref.columns if c not in floats or c in exact]
    ref, got = ref.sort(keys, nulls_last=True), got.sort(keys, nulls_last=True)
    assert ref.height > 0 and ref.select(keys).equals(got.select(keys)), kind
    return max((_max_rel(got[c], ref[c]) for c in floats if c not in exact), default=0.0)


class _Accelerator:
    """The parts of accelerate's `Accelerator` that `TrainerProbe` uses, over torch.distributed (or one process)."""

    def __init__(self) -> None:
        dist = torch.distributed
        on = dist.is_initialized()
        self.process_index, self.num_processes = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
        self.is_main_process = self.process_index == 0

    def unwrap_model(self, model):
        return model

    def pad_across_processes(self, t, **kwargs):
        return t  # every rank's rows have the same length here

    def gather(self, t):
        out = [torch.empty_like(t) for _ in range(self.num_processes)]
        torch.distributed.all_gather(out, t.contiguous())
        return torch.cat(out)


def trainer_probe_analyses(model, batch, rows: slice, run_dir: Path) -> None:
    """`TrainerProbe`'s dispatch on one probed rollout batch: this rank's rows handed to `rollout` (the analysed
    sample: the first 6 rows of the global batch, across both ranks' rows), `analyze`, then `on_step_end` (the real
    change, with no update between: zero) in the trainer's order, on a stand-in for TRL's trainer."""
    from dataclasses import MISSING, fields
    from types import SimpleNamespace

    from tokendyn import ProbeConfig
    from tokendyn.hooks.trainer import TrainerProbe
    from tokendyn.trainers.config import TokendynGRPOConfig

    defaults = {
        f.name: f.default
        for f in fields(TokendynGRPOConfig)
        if f.name.startswith("probe_") and f.default is not MISSING
    }
    # every analysis, the default step precision: a measured check (float64 steps sharded under FSDP2)
    config = ProbeConfig(sample_sequences=6, lr=0.05)
    args = SimpleNamespace(
        **{**defaults, "probe_every": 1, "probe_sample_sequences": 6, "probe_lr": 0.05},
        probe_config=lambda: config, temperature=T, seed=0, epsilon=0.2, epsilon_high=0.28,
        steps_per_generation=1, gradient_accumulation_steps=1, lopti_order="low_first",
    )  # fmt: skip
    trainer = SimpleNamespace(
        args=args, accelerator=_Accelerator(), model=model, _tokenizer=SimpleNamespace(pad_token_id=0),
        state=SimpleNamespace(global_step=0), _step=0, temperature=T, num_iterations=1, passes_per_stage=1,
    )  # fmt: skip
    probe = TrainerProbe(trainer, run_dir)
    pb, _ = analysis_sample(_model_and_batch()[0], batch)
    p = pb.input_ids.size(1) - pb.n_completion
    output = {
        "prompt_ids": pb.input_ids[:, :p], "prompt_mask": pb.attention_mask[:, :p],
        "completion_ids": pb.completion_ids, "completion_mask": pb.completion_mask.long(),
        "advantages": pb.advantages[:, 0].float(), "old_per_token_logps": pb.old_logp.float(),
    }  # fmt: skip
    probe.rollout({k: v[rows] for k, v in output.items()})
    probe.analyze({})
    probe.on_step_end(args, trainer.state, None)
    probe.close()


def fsdp_trainer_worker(out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, _ = _wrapped("fsdp")
    _, batch = _model_and_batch()
    with pytest.warns(UserWarning, match="per-token shares"):
        trainer_probe_analyses(model, batch, slice(4 * rank, 4 * rank + 4), Path(out_dir) / "run")
    dist.barrier()
    dist.destroy_process_group()


def test_trainer_probe_runs_the_analyses_on_every_fsdp2_rank_and_rank0_writes(tmp_path):
    """The trainer's dispatch under FSDP2: every rank analyses the gathered sample (a collective), rank 0 alone
    writes, the records equal one process's over the same global rows (the measured step precision's check, made
    with sharded float64 steps, included), and the skipped per-token shares are noted once as a `notes` record."""
    from tokendyn.records import shard_files

    _launch(tmp_path / "two", "fsdp_trainer")
    torch.set_num_threads(1)
    model, batch = _model_and_batch()
    trainer_probe_analyses(model, batch, slice(0, 8), tmp_path / "one" / "run")
    diffs = {}
    for kind in ("shares", "prob_change", "influence", "precision_check"):
        files = shard_files(tmp_path / "two" / "run", kind)
        assert files and all("-rank000-" in f.name for f in files), [f.name for f in files]
        one, two = (pl.read_parquet(shard_files(tmp_path / d / "run", kind)) for d in ("one", "two"))
        skipped = ("jvp_share", "seconds_float64", "seconds_model")  # (not under FSDP2; wall times)
        one, two = one.drop(*skipped, strict=False), two.drop(*skipped, strict=False)
        if kind == "prob_change":  # (the lr -> 0 limit, a forward-mode JVP, is skipped under FSDP2)
            one = one.filter(~pl.col("limit").fill_null(False))
        floats = [c for c, t in one.schema.items() if t == pl.Float64 and not c.startswith("correct_")]
        keys = [c for c in one.columns if c not in floats]
        one, two = one.sort(keys, nulls_last=True), two.sort(keys, nulls_last=True)
        assert one.height > 0 and one.select(keys).equals(two.select(keys)), kind
        if kind == "precision_check":  # (differences of the two ways, already relative to the largest |dpi|:
            # the float64 sums' order moves them in absolute terms, their own size aside)
            diffs[kind] = max(float((two[c] - one[c]).abs().max()) for c in floats)
        else:
            diffs[kind] = max(_max_rel(two[c], one[c]) for c in floats)
    print(json.dumps(diffs))
    assert all(v < FSDP_RTOL for v in diffs.values()), diffs
    assert shard_files(tmp_path / "one" / "run", "token_shares")
    assert not shard_files(tmp_path / "two" / "run", "token_shares")
    notes = pl.read_parquet(shard_files(tmp_path / "two" / "run", "notes"))
    assert set(notes["code"]) == {"fsdp_no_token_shares"}, notes
    assert all("per-token shares" in m for m in notes["message"])


def test_trl_trainer_under_ddp_records_the_global_loss_gradient(tiny_model_dir, tmp_path):
    _launch(tmp_path, "trl", str(tiny_model_dir))


def test_trl_rebalancing_analyses_under_ddp_equal_one_process_on_the_global_batch(tiny_model_dir, tmp_path):
    """Two DDP ranks of 8 rollouts each against one process generating the same 16: the analysed sample is the first
    12 rows of the global rollout batch (8 of rank 0's, 4 of rank 1's), analysed and written by rank 0 alone. The
    analyses at the rollout start see the same rows and parameters (equal to rounding); the stage-2 shares and the
    real change follow the real DDP vs one-process SGD steps (equal to float32 rounding of the averaged gradient).
    On the ranks, training with the analyses is bitwise training without them."""
    from tokendyn.records import shard_files

    torch.set_num_threads(1)
    _launch(tmp_path / "two", "trl_analyses", str(tiny_model_dir))
    analysed_run(str(tiny_model_dir), tmp_path / "one", per_device=8)
    diffs = {}
    for kind in ANALYSED:
        files = shard_files(tmp_path / "two" / "run", kind)
        assert files and all("-rank000-" in f.name for f in files), [f.name for f in files]
        one, two = (pl.read_parquet(shard_files(tmp_path / d / "run", kind)) for d in ("one", "two"))
        floats = [c for c, t in one.schema.items() if t == pl.Float64 and c not in ("lr", "bin_lo", "bin_hi")]
        keys = [c for c in one.columns if c not in floats]
        one, two = one.sort(keys, nulls_last=True), two.sort(keys, nulls_last=True)
        assert one.height > 0 and one.select(keys).equals(two.select(keys)), kind
        by = [c for c in ("update", "stage") if c in one.columns]  # real / stage-2 rows come after SGD steps
        for part in one.select(by).unique().sort(by).iter_rows():
            rows = pl.all_horizontal(pl.col(c) == v for c, v in zip(by, part, strict=True))
            a, b = one.filter(rows), two.filter(rows)
            diffs[":".join([kind, *part])] = max(_max_rel(b[c], a[c]) for c in floats)
    print(json.dumps(diffs))
    assert all(v < 1e-5 for v in diffs.values()), diffs


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    if sys.argv[1] == "trl_analyses":
        torch.set_num_threads(1)
        probed = analysed_run(sys.argv[2], Path(sys.argv[3]), per_device=4)
        plain = analysed_run(sys.argv[2], Path(sys.argv[3]) / "plain", per_device=4, probe_every=0)
        assert all(torch.equal(a, b) for a, b in zip(probed, plain, strict=True)), (
            "the analyses changed training"
        )
    elif sys.argv[1] == "fsdp_trainer":
        fsdp_trainer_worker(sys.argv[2])
    elif sys.argv[1] == "fsdp_analyses":
        fsdp_analyses_worker(sys.argv[2])
    elif sys.argv[1] == "fsdp_float64":
        fsdp_float64_worker(sys.argv[2])
    elif sys.argv[1] == "fsdp_matrix":
        fsdp_matrix_worker(sys.argv[2])
    elif sys.argv[1] == "trl":
        from tokendyn.records import shard_files

        trl_worker(sys.argv[2], sys.argv[3])
    else:
        worker(sys.argv[1])
    out = Path(sys.argv[-1])  # every check of this rank passed: mark it (see _launch)
    out.mkdir(parents=True, exist_ok=True)
    (out / f".done-rank{os.environ.get('RANK', '0')}").write_text("ok")
