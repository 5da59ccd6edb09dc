"""``tokendyn demo [--quick] [--policy NAME] [--out DIR] [--use_vllm [--vllm_dtype D]]``: what ``make demo`` runs
(the embedded default), or the same three runs on the real LLM (``--policy smollm2-135m``); with ``--use_vllm`` TRL's
colocated vLLM engine samples their rollouts."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    from .demo import POLICIES
    from .vllm_flag import add_use_vllm

    p = sub.add_parser(
        "demo",
        help="start here: GRPO vs +Reweight vs +Lopti with the probes on (the embedded default on K&K, or a real "
        "LLM on sums), then every figure and report.html (--quick: a smoke size)",
        description="Start here. GRPO, +Reweight and +Lopti from one policy with the probes on, then every figure "
        "and the report: OUT/figures/report.html (default runs/demo/figures/report.html), whose path it prints.",
    )
    p.add_argument(
        "--policy",
        default="default",
        choices=list(POLICIES),
        help="default: the embedded policy on K&K (what `make demo` runs); smollm2-135m: SmolLM2-135M-Instruct from its "
        "package on sums of one- and two-digit numbers (docs/results.md gives its time)",
    )
    p.add_argument(
        "--out", default="runs/demo", help="output directory (three run directories and figures/report.html)"
    )
    p.add_argument(
        "--quick", action="store_true", help="a few minutes: fewer rollouts, sizes and evaluations"
    )
    p.add_argument(
        "--model",
        default=None,
        help="another policy directory or hub id, on K&K (default: the embedded default)",
    )
    add_use_vllm(
        p,
        "sample the rollouts with TRL's colocated vLLM engine (vLLM's CPU build on a CPU; eager, no torch.compile) "
        "instead of the trainer's generate; each run.json's `sampler` says which engine, which dtype",
    )
    p.add_argument(
        "--vllm_dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="with --use_vllm: the dtype vLLM samples in (auto: vLLM's choice, bfloat16 for a float32 checkpoint)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .demo import demo

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {str(out)!r} exists and is not a directory")
    sampler = sampler_overrides(args.use_vllm, args.vllm_dtype)
    report = demo(out, quick=args.quick, policy=args.policy, model=args.model, overrides=sampler)
    print(f"report: {report}")
    return 0


def sampler_overrides(use_vllm: bool, vllm_dtype: str = "auto") -> dict:
    """The trainer fields of ``--use_vllm`` / ``--vllm_dtype``: TRL's colocated engine, eager (it starts in seconds
    on a CPU), in that dtype."""
    if vllm_dtype != "auto" and not use_vllm:
        raise ValueError(f"vllm_dtype: {vllm_dtype!r} needs --use_vllm")
    if not use_vllm:
        return {}
    return dict(use_vllm=True, vllm_mode="colocate", vllm_enforce_eager=True, vllm_dtype=vllm_dtype)
