"""``tokendyn study [--quick] [--out DIR] [--methods grpo,reweight,lopti] [--seeds 0,1,2] [--rollouts R]
[--both-camps]``."""

from __future__ import annotations

import argparse


def _ints(field: str):
    def parse(text: str) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{field}: comma-separated integers, got {text!r}") from None

    return parse


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def register(sub) -> None:
    from .study import FULL, METHODS

    p = sub.add_parser(
        "study",
        help="methods x seeds x R rollouts from one policy: accuracy with 95 %% intervals, per-bin tables, the "
        "paper's Fig. 3 analogue and what reproduces (resumable)",
    )
    p.add_argument(
        "--out", default="runs/study", help="output directory (runs/, start-s*/, tables/, figures/, study.md)"
    )
    p.add_argument(
        "--quick", action="store_true", help="a smoke-test size (seconds to minutes), as the test suite runs"
    )
    p.add_argument("--model", default=None, help="policy directory or hub id (default: the embedded default)")
    p.add_argument(
        "--policy",
        choices=["default", "smollm2-135m"],
        default="default",
        help="default: the K&K study on the embedded default (or --model); smollm2-135m: the seeded study on the "
        "real LLM on sums (GRPO, Reweight, Lopti, Lopti's two controls, the protecting camp; >= 4 training seeds; "
        "docs/study/llm)",
    )
    p.add_argument(
        "--sampler",
        choices=["generate", "vllm"],
        default="generate",
        help="--policy smollm2-135m: what samples the rollouts. generate: the trainer's own float32 model; vllm: "
        "TRL's colocated vLLM engine (GRPO in bf16 with TRL's correction, without it, in float32; Reweight and "
        "Lopti in bf16; default --out runs/study-llm-vllm)",
    )
    p.add_argument(
        "--reference",
        default=None,
        help="--sampler vllm: the study whose generate-sampled GRPO / Reweight / Lopti runs the report compares with "
        "at the same seeds (the committed one: docs/study/llm)",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: write the tables, figures and study.md from the runs finished in --out",
    )
    p.add_argument(
        "--no-report",
        action="store_true",
        help="train the missing runs, write no report (a worker of a study)",
    )
    p.add_argument("--work", default=None, help="--policy smollm2-135m: where runs train (weights; default "
                   "runs/llm-study-work), removed as each run ends")  # fmt: skip
    p.add_argument("--methods", type=_names, default=None,
                   help=f"comma-separated from {', '.join(METHODS)} (default {','.join(FULL.methods)})")  # fmt: skip
    p.add_argument("--seeds", type=_ints("seeds"), default=None, help="comma-separated seeds (default 0,1,2)")
    p.add_argument(
        "--rollouts", type=int, default=None, help=f"rollout batches per run (default {FULL.rollouts})"
    )
    p.add_argument("--people", type=_ints("people"), default=None, help="training sizes (default 3,4,5)")
    p.add_argument(
        "--eval-people", type=_ints("eval-people"), default=None, help="held-out sizes (default 3..7)"
    )
    p.add_argument(
        "--eval-n", type=int, default=None, help=f"held-out puzzles per size, 1..100 (default {FULL.eval_n})"
    )
    p.add_argument(
        "--both-camps",
        action="store_true",
        help="the GRPO runs also compare, from their own states, the rules that protect low-probability tokens "
        "(Delta-log-p reweight, DPPO-TV/KL, ASPO, CE-GPPO) beside those that tame them, over 2 inner updates, and "
        "sweep the c axis and Lopti's eta: the report's both-camps table, figure and guidance",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .study_engine import check_size, run_study, with_size

    spec, model, report = _kind(args)
    size = spec.quick if args.quick else spec.full
    changes = {
        "methods": args.methods,
        "seeds": args.seeds,
        "rollouts": args.rollouts,
        "people": args.people,
        "eval_people": args.eval_people,
        "eval_n": args.eval_n,
        "both_camps": args.both_camps or None,
    }
    size = check_size(spec, with_size(size, **{k: v for k, v in changes.items() if v is not None}))
    out = Path(args.out if args.out != "runs/study" else spec.default_out)
    if not args.report_only:
        run_study(spec, out, size, model=model, work_dir=args.work)
    if args.report_only or not args.no_report:
        print(f"study: {report(out, size)}")
    return 0


def _kind(args: argparse.Namespace):
    """(spec, model, report writer) of the study the flags name; a one-line UsageError for a flag it does not
    take. --policy default: the K&K study (`tokendyn.commands.study`); smollm2-135m: the seeded study on the real LLM
    (`tokendyn.commands.llm_study`), its rollouts sampled by the trainer's ``generate`` or by vLLM (--sampler)."""
    from tokendyn.common import UsageError

    if args.policy == "default":
        if args.reference is not None:
            raise UsageError("--reference: an option of --policy smollm2-135m --sampler vllm only")
        if args.sampler != "generate":
            raise UsageError(
                f"--sampler: {args.sampler} is a mode of --policy smollm2-135m only; allowed here: generate"
            )
        from .study import KK, write_study

        return KK, args.model, write_study
    for flag, value in (
        ("--people", args.people),
        ("--eval-people", args.eval_people),
        ("--model", args.model),
    ):
        if value is not None:
            raise UsageError(f"{flag}: not an option of --policy {args.policy} (sums on the packaged model)")
    if args.sampler == "vllm":
        from .llm_study import SAMPLER
        from .sampler_study_report import write_sampler_study

        return SAMPLER, args.policy, lambda out, size: write_sampler_study(out, size, args.reference)
    if args.reference is not None:
        raise UsageError(f"--reference: an option of --sampler vllm only, got --sampler {args.sampler}")
    from .llm_study import LLM
    from .llm_study_report import write_llm_study

    return LLM, args.policy, write_llm_study
