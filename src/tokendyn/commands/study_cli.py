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

    if args.policy != "default":
        return _run_llm(args)
    if args.sampler != "generate" or args.reference is not None:
        from tokendyn.common import UsageError

        if args.reference is not None:
            raise UsageError("--reference: an option of --policy smollm2-135m --sampler vllm only")
        raise UsageError(
            f"--sampler: {args.sampler} is a mode of --policy smollm2-135m only; allowed here: generate"
        )

    from .study import FULL, QUICK, study, with_size

    size = QUICK if args.quick else FULL
    changes = {
        "methods": args.methods,
        "seeds": args.seeds,
        "rollouts": args.rollouts,
        "people": args.people,
        "eval_people": args.eval_people,
        "eval_n": args.eval_n,
        "both_camps": args.both_camps or None,
    }
    size = with_size(size, **{k: v for k, v in changes.items() if v is not None})
    report = study(Path(args.out), size, model=args.model)
    print(f"study: {report}")
    return 0


def _run_llm(args: argparse.Namespace) -> int:
    """`tokendyn study --policy smollm2-135m`: the seeded study on the real LLM (`tokendyn.commands.llm_study`)."""
    from pathlib import Path

    from tokendyn.common import UsageError

    from .llm_study import FULL, QUICK, SAMPLER_FULL, SAMPLER_QUICK, llm_study, with_size
    from .llm_study_report import write_llm_study

    for flag, value in (
        ("--people", args.people),
        ("--eval-people", args.eval_people),
        ("--model", args.model),
    ):
        if value is not None:
            raise UsageError(f"{flag}: not an option of --policy {args.policy} (sums on the packaged model)")
    if args.sampler == "vllm":
        size = SAMPLER_QUICK if args.quick else SAMPLER_FULL
    else:
        size = QUICK if args.quick else FULL
    changes = {"methods": args.methods, "seeds": args.seeds, "rollouts": args.rollouts, "eval_n": args.eval_n}
    size = with_size(size, **{k: v for k, v in changes.items() if v is not None})
    if args.both_camps:
        size = with_size(size, both_camps=True)
    default_out = "runs/study-llm-vllm" if args.sampler == "vllm" else "runs/study-llm"
    out = Path(args.out if args.out != "runs/study" else default_out)
    if args.reference is not None and args.sampler != "vllm":
        raise UsageError(f"--reference: an option of --sampler vllm only, got --sampler {args.sampler}")
    if args.sampler == "vllm":
        from .sampler_study_report import write_sampler_study

        def report() -> Path:
            return write_sampler_study(out, size, args.reference)
    else:

        def report() -> Path:
            return write_llm_study(out, size)

    if args.report_only:
        print(f"study: {report()}")
        return 0
    llm_study(out, size, model=args.policy, work_dir=args.work)
    if not args.no_report:
        print(f"study: {report()}")
    return 0
