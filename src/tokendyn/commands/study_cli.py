"""``tokendyn study [--quick] [--out DIR] [--policy NAME [--use_vllm]] [--methods grpo,reweight,lopti] [--seeds
0,1,2] [--rollouts R] [--both-camps]``: each kind of study (--policy, --use_vllm) has its own defaults, and ``--help``
lists each kind's."""

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


def _kinds():
    """(label, spec) of each study kind, as `--help` names them."""
    from .llm_study import LLM, SAMPLER
    from .study import KK

    return (("K&K", KK), ("smollm2-135m", LLM), ("smollm2-135m --use_vllm", SAMPLER))


def _each(name: str, kinds) -> str:
    """Each kind's full-size default of the size field ``name``: "default K&K: 60; smollm2-135m: 8; ..." (a kind
    without the field is left out)."""

    def text(value) -> str:
        return ", ".join(map(str, value)) if isinstance(value, tuple) else str(value)

    found = [
        f"{label}: {text(getattr(spec.full, name))}" for label, spec in kinds if hasattr(spec.full, name)
    ]
    return "default " + "; ".join(found)


def register(sub) -> None:
    from .study import METHODS
    from .vllm_flag import add_sampler_alias, add_use_vllm

    kinds = _kinds()
    p = sub.add_parser(
        "study",
        help="methods x seeds x R rollouts from one policy: accuracy with 95 %% intervals, per-bin tables, the "
        "paper's Fig. 3 analogue and what reproduces (resumable)",
        description="Three kinds of study, each with its own defaults (listed per kind below): --policy default, the "
        "K&K study on the embedded default; --policy smollm2-135m, the seeded study on the real LLM on sums; and "
        "--policy smollm2-135m --use_vllm, that study with vLLM sampling.",
    )
    p.add_argument(
        "--out",
        default=None,
        help="output directory (runs/, start-s*/, tables/, figures/, study.md), used as given (default "
        + "; ".join(f"{label}: {spec.default_out}" for label, spec in kinds)
        + ")",
    )
    p.add_argument(
        "--quick", action="store_true", help="a smoke-test size (seconds to minutes), as the test suite runs"
    )
    p.add_argument(
        "--model", default=None, help="K&K only: policy directory or hub id (default: the embedded default)"
    )
    p.add_argument(
        "--policy",
        choices=["default", "smollm2-135m"],
        default="default",
        help="default: the K&K study on the embedded default (or --model); smollm2-135m: the seeded study on the "
        "real LLM on sums (GRPO, Reweight, Lopti, Lopti's two controls, the protecting camp; >= 4 training seeds; "
        "docs/study/llm)",
    )
    add_use_vllm(
        p,
        "--policy smollm2-135m: sample the rollouts with TRL's colocated vLLM engine (GRPO in bf16 with TRL's "
        "correction, without it, in float32; Reweight and Lopti in bf16) instead of the trainer's own float32 "
        "generate",
    )
    add_sampler_alias(p)  # the old spelling, `--sampler vllm`
    p.add_argument(
        "--reference",
        default=None,
        help="--use_vllm: the study whose generate-sampled GRPO / Reweight / Lopti runs the report compares with "
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
                   f"{kinds[1][1].default_work}), removed as each run ends")  # fmt: skip
    p.add_argument("--methods", type=_names, default=None,
                   help=f"comma-separated method names (K&K: from {', '.join(METHODS)}; a name the kind does not "
                   f"run is an error listing those it does; {_each('methods', kinds)})")  # fmt: skip
    p.add_argument(
        "--seeds", type=_ints("seeds"), default=None, help=f"comma-separated seeds ({_each('seeds', kinds)})"
    )
    p.add_argument(
        "--rollouts", type=int, default=None, help=f"rollout batches per run ({_each('rollouts', kinds)})"
    )
    p.add_argument(
        "--people",
        type=_ints("people"),
        default=None,
        help=f"K&K only: training sizes ({_each('people', kinds)})",
    )
    p.add_argument("--eval-people", type=_ints("eval-people"), default=None,
                   help=f"K&K only: held-out sizes ({_each('eval_people', kinds)})")  # fmt: skip
    p.add_argument(
        "--eval-n", type=int, default=None, help=f"held-out problems per size ({_each('eval_n', kinds)})"
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
    out = Path(args.out if args.out is not None else spec.default_out)  # an explicit --out, as given
    if not args.report_only:
        run_study(spec, out, size, model=model, work_dir=args.work)
    if args.report_only or not args.no_report:
        print(f"study: {report(out, size)}")
    return 0


def _kind(args: argparse.Namespace):
    """(spec, model, report writer) of the study the flags name; a one-line UsageError for a flag it does not
    take. --policy default: the K&K study (`tokendyn.commands.study`); smollm2-135m: the seeded study on the real LLM
    (`tokendyn.commands.llm_study`), its rollouts sampled by the trainer's ``generate`` or by vLLM (--use_vllm)."""
    from tokendyn.common import UsageError

    if args.policy == "default":
        if args.reference is not None:
            raise UsageError("--reference: an option of --policy smollm2-135m --use_vllm only")
        if args.use_vllm:
            raise UsageError(
                "--use_vllm: a mode of --policy smollm2-135m only; allowed here: --use_vllm false"
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
    if args.use_vllm:
        from .llm_study import SAMPLER
        from .sampler_study_report import write_sampler_study

        return SAMPLER, args.policy, lambda out, size: write_sampler_study(out, size, args.reference)
    if args.reference is not None:
        raise UsageError("--reference: an option of --use_vllm only, got --use_vllm false")
    from .llm_study import LLM
    from .llm_study_report import write_llm_study

    return LLM, args.policy, write_llm_study
