"""Float64 steps against the model's own dtype, measured: the check `step_precision`
"measured" makes in a run (`tokendyn.effects.precision`), here on a batch of the policy's own samples, for

  * float32 weights, one process (what the check of a float32 run compares);
  * bf16 weights, one process (a bf16 run: float64 steps from the bf16 weights against bf16 steps);
  * FSDP2 on 2 CPU ranks (``--fsdp``; torchrun, gloo): the model sharded with `fully_shard` (every decoder layer,
    then the root), its shards stepping in their own dtype, and with float64 steps whose float64 point is sharded
    too (`float64_step`: 8 bytes a parameter / world size; the gradient in the shards' dtype), against one process
    with float64 steps, and against one process in float32 (what sharding itself changes); float32 shards, float32
    shards computing in bf16 (FSDP2's mixed precision, ``mixed``: against one process's float64 steps of the
    float32 model) and bf16 shards (a pure-bf16 sharded run: against one process's all-float64 path).

The batch is bench/limit_vs_step.py's (``--prompts`` x 2 samples at T = 1, advantages +1 / -1; K&K for the embedded
default, sums for SmolLM2), pi_old fixed in float64; the analyses: the counterfactual update and the influence
matrix's sources at ``--lr`` (plain SGD, the trainer's clipped token-mean loss). One thread per process.

    python bench/precision_check.py                               # the embedded default, ~1 min
    python bench/precision_check.py --model smollm2-135m --fsdp   # the real LLM: ~30 min on CPU
    python bench/precision_check.py --model smollm2-135m --fsdp --no-bf16 --fsdp-layouts mixed

Prints one markdown row per comparison: the worst update's rel_diff (largest |difference| of a Δπ statistic / its
largest |Δπ|), the largest correct-ratio difference in tokens, signs equal, the verdict at the check's 0.5 %, and
the wall time of each way.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import polars as pl
import torch

HERE = Path(__file__).resolve().parent
# FSDP2's layouts: float32 shards; float32 shards computing in bf16 (mixed precision); bf16 shards
LAYOUTS = ("float32", "mixed", "bfloat16")


def _options(lr: float, precision: str):
    from tokendyn.effects.rebalance import RebalanceOptions

    return RebalanceOptions(shares=False, token_shares=0, view_sequences=0, lr=lr, step_precision=precision)


def _analyse(model, batch, lr: float, precision: str) -> tuple[dict[str, pl.DataFrame], float]:
    from tokendyn.effects.rebalance import analyze_batch
    from tokendyn.probe.tokenloss import Objective

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the model-dtype steps' rounding bound: what this script measures)
        frames = analyze_batch(model, batch, step=0, options=_options(lr, precision),
                               objective=Objective(eps_low=0.2, eps_high=0.2))  # fmt: skip
    return frames, time.perf_counter() - t0


def _row(label: str, ref, got, dtype: str, seconds: tuple[float, float]) -> str:
    from tokendyn.effects.precision import precision_check

    check = precision_check(ref, got, step=0, model_dtype=dtype, seconds=seconds)
    worst = check.sort("rel_diff", descending=True).row(0, named=True)
    verdict = "agree" if check["agreed"].all() else "disagree"
    return (f"| {label} | {check.height} | {worst['rel_diff']:.2g} ({worst['update']}) | "
            f"{check['ratio_tokens'].max():.0f} | {'yes' if check['signs_equal'].all() else 'no'} | {verdict} | "
            f"{seconds[0]:.1f} s / {seconds[1]:.1f} s |")  # fmt: skip


def _batch(args):
    from limit_vs_step import T, own_samples

    from tokendyn.effects.change import fix_pi_old
    from tokendyn.policy import load_policy
    from tokendyn.probe.tokenloss import ProbeBatch

    model, tok = load_policy(args.model, dtype=torch.float32)
    model.eval()
    task = "arith" if args.model and "smollm2" in str(args.model) else "kk"
    ids, attn, cmask, adv = own_samples(model, tok, task, args.prompts, args.tokens, args.seed)
    batch, _ = fix_pi_old(model, ProbeBatch(ids, attn, cmask, adv, temperature=T), precision="float64")
    return model, batch


def fsdp_worker(args) -> None:
    """One rank: the same model and batch, sharded, analysed in its own dtype and with sharded float64 steps, for
    each of ``--fsdp-layouts`` (`LAYOUTS`); rank 0 writes the frames, the wall times and the float64 shards' bytes
    on a rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from tokendyn.policy import load_policy
    from tokendyn.probe.parallel import local
    from tokendyn.probe.tokenloss import ProbeBatch

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = Path(args.fsdp_worker)
    saved = torch.load(out / "batch.pt", weights_only=True)
    batch = ProbeBatch(saved["ids"], saved["attn"], saved["cmask"], saved["adv"], temperature=saved["T"])
    batch = batch.with_old_logp(saved["old_logp"])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    seconds, shard_bytes = {}, {}
    for name in args.fsdp_layouts.split(","):
        model, _ = load_policy(args.model, dtype=torch.float32)
        model = model.to(torch.bfloat16 if name == "bfloat16" else torch.float32).eval()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if name == "mixed" else None)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        shard_bytes[name] = 8 * sum(local(p).numel() for p in model.parameters())
        for precision in ("model", "float64_step"):
            frames, seconds[f"{name}-{precision}"] = _analyse(model, batch, args.lr, precision)
            if dist.get_rank() == 0:
                for kind, frame in frames.items():
                    frame.write_parquet(out / f"{name}-{precision}-{kind}.parquet")
        del model
    if dist.get_rank() == 0:
        (out / "shard_bytes.json").write_text(json.dumps(shard_bytes))
        (out / "seconds.json").write_text(json.dumps(seconds))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default=None, help="a policy (default: the embedded default; e.g. smollm2-135m)"
    )
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fsdp", action="store_true", help="also FSDP2 on 2 CPU ranks (torchrun)")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 weights")
    ap.add_argument("--fsdp-layouts", default=",".join(LAYOUTS),
                    help=f"FSDP2 layouts, comma-separated, of {', '.join(LAYOUTS)}")  # fmt: skip
    ap.add_argument("--fsdp-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fsdp_worker:
        return fsdp_worker(args)
    torch.set_num_threads(1)
    model, batch = _batch(args)
    name = args.model or "embedded default"
    print(f"{name}: {batch.input_ids.size(0)} sequences, {batch.n_tokens} completion tokens, SGD lr {args.lr:g}; "
          "the counterfactual update and every influence source")  # fmt: skip
    print(
        "\n| weights, steps | updates | worst rel_diff | ratio tokens | signs equal | at 0.5 % | float64 / other |"
    )
    print("|---|---|---|---|---|---|---|")
    ref, t64 = _analyse(model, batch, args.lr, "float64")
    low, t32 = _analyse(model, batch, args.lr, "model")
    print(_row("float32, one process", ref, low, "float32", (t64, t32)), flush=True)
    ref16, t64b = None, 0.0
    if not args.no_bf16:
        half = copy.deepcopy(model).to(torch.bfloat16)
        ref16, t64b = _analyse(half, batch, args.lr, "float64")  # float64 steps from the same bf16 weights
        got16, t16 = _analyse(half, batch, args.lr, "model")
        print(_row("bf16, one process", ref16, got16, "bfloat16", (t64b, t16)), flush=True)
        del half
    if args.fsdp:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            torch.save({"ids": batch.input_ids, "attn": batch.attention_mask, "cmask": batch.completion_mask,
                        "adv": batch.advantages, "old_logp": batch.old_logp, "T": float(batch.temperature)},
                       out / "batch.pt")  # fmt: skip
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
                   "--fsdp-worker", str(out), "--lr", str(args.lr)]  # fmt: skip
            if args.model:
                cmd += ["--model", args.model]
            layouts = [x for x in args.fsdp_layouts.split(",") if not (args.no_bf16 and x == "bfloat16")]
            cmd += ["--fsdp-layouts", ",".join(layouts)]
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            }
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if not (out / "seconds.json").is_file():
                sys.exit(f"FSDP2 workers failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            fsdp: dict[str, dict[str, pl.DataFrame]] = {}
            for path in out.glob("*.parquet"):
                way, kind = path.stem.rsplit("-", 1)
                fsdp.setdefault(way, {})[kind] = pl.read_parquet(path)
            tf = json.loads((out / "seconds.json").read_text())
            shard = json.loads((out / "shard_bytes.json").read_text())
        full = 8 * sum(p.numel() for p in model.parameters())
        print(f"\nFSDP2, 2 ranks: the float64 point's shards {max(shard.values()) / 1e6:.1f} MB on a rank "
              f"(a whole float64 copy: {full / 1e6:.1f} MB)\n")  # fmt: skip
        print("| weights, steps | updates | worst rel_diff | ratio tokens | signs equal | at 0.5 % | times |")
        print("|---|---|---|---|---|---|---|")
        # per layout: its name in the rows, the one-process reference (frames, seconds), the weights' dtype
        references = {
            "float32": ("float32", (ref, t64), "float32"),
            "mixed": ("float32 shards, bf16 compute (FSDP2 mixed precision)", (ref, t64), "float32"),
            "bfloat16": ("bf16", (ref16, t64b), "bfloat16"),
        }
        for layout in layouts:
            name, (one, t_one), dtype = references[layout]
            if one is None:
                continue
            own, f64 = fsdp[f"{layout}-model"], fsdp[f"{layout}-float64_step"]
            t_own, t_f64 = tf[f"{layout}-model"], tf[f"{layout}-float64_step"]
            rows = [
                (f"{name}, FSDP2 2 ranks, own dtype vs one process float64", one, own, (t_one, t_own)),
                (
                    f"{name}, FSDP2 2 ranks, sharded float64 steps vs one process float64",
                    one,
                    f64,
                    (t_one, t_f64),
                ),
                (
                    f"{name}, FSDP2: own dtype vs its sharded float64 steps (its own check)",
                    f64,
                    own,
                    (t_f64, t_own),
                ),
            ]
            if layout == "float32":  # (what sharding itself changes)
                rows.insert(
                    1, (f"{name}, FSDP2 2 ranks, own dtype vs one process float32", low, own, (t32, t_own))
                )
            for label, a, b, seconds in rows:
                print(_row(label, a, b, dtype, seconds))


if __name__ == "__main__":
    main()
