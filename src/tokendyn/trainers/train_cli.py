"""``tokendyn train``: GRPO (+Reweight, +Lopti) on K&K with TRL-style flags.

Every field of :class:`RunArguments` and of :class:`TokendynGRPOConfig` (TRL's ``GRPOConfig``
and the paper's remedies) is a flag; ``--config run.yaml`` sets any of them (flags win).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="GRPO / +Reweight / +Lopti on K&K (every GRPOConfig field is a flag; "
        "`tokendyn train --help` lists them)",
        add_help=False,
    )
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=run)


def _fail(message: str):
    from ..common import UsageError

    raise UsageError(" ".join(str(message).split()))  # one line, whatever the source's layout


def config_flags(path: str, known: set[str]) -> list[str]:
    """The YAML file of ``--config`` as flags (put before the command line's own, which win): every key checked
    against the known fields, so argparse converts and checks the values exactly as on the command line."""
    import json
    import os

    import yaml

    p = Path(path)
    if not p.is_file():
        _fail(f"config: {path!r} does not exist or is not a file")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        _fail(f"config: {path!r} is not UTF-8 text (byte {exc.start})")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        _fail(f"config: {path!r}: YAML syntax error{where}: {getattr(exc, 'problem', None) or exc}")
    if data is None:
        return []
    if not isinstance(data, dict):
        _fail(f"config: {path!r} must hold a YAML mapping of field: value, got a {type(data).__name__}")
    env = data.pop("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) for k in env):
        _fail(f"config: {path!r}: 'env' must be a mapping of variable: value")
    flags = []
    for key, value in data.items():
        if not isinstance(key, str) or key not in known:
            _fail(f"config: {path!r}: unknown field {key!r} (`tokendyn train --help` lists the fields)")
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, dict | list) for v in values) and not isinstance(value, dict):
            _fail(f"config: {path!r}: field {key!r} must be a value or a list of values, got {value!r}")
        flags.append(f"--{key}")
        if isinstance(value, dict):
            flags.append(json.dumps(value))
        else:
            flags.extend(str(v).lower() if isinstance(v, bool) else str(v) for v in values)
    for k, v in env.items():
        os.environ[k] = str(v)
    return flags


def parse(argv: list[str]):
    """(RunArguments, TokendynGRPOConfig) from flags and an optional ``--config`` YAML; any bad input is a one-line
    `UsageError` naming the field (argparse's own errors included)."""
    import warnings

    import torch
    from trl import TrlParser

    # transformers 5 warns on every config about its own renamed fields: not the user's doing
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*deprecated", category=FutureWarning)

    from .config import TokendynGRPOConfig
    from .runner import EMBEDDED_DEFAULTS, RunArguments

    parser = TrlParser((RunArguments, TokendynGRPOConfig), prog="tokendyn train")
    parser.error = _fail  # type: ignore[method-assign]  (argparse prints usage and exits otherwise)
    defaults = dict(EMBEDDED_DEFAULTS)
    if not torch.cuda.is_available():
        defaults["use_cpu"] = True
    parser.set_defaults(**defaults)
    argv = list(argv)
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            _fail("config: --config needs a YAML file path")
        path = argv[i + 1]
        del argv[i : i + 2]
        known = {a.dest for a in parser._actions}
        argv = config_flags(path, known) + argv
    preset = given_preset(argv)
    if preset is not None:
        from .presets import preset_values

        try:
            parser.set_defaults(**preset_values(preset))  # the preset's values; flags and --config win
        except ValueError as exc:
            _fail(str(exc))
    if "--help-all" not in argv:
        short_help(parser)
    else:
        argv = ["--help" if a == "--help-all" else a for a in argv]
    try:
        run_args, cfg = parser.parse_args_into_dataclasses(args=argv)
    except (ValueError, TypeError) as exc:
        text = str(exc) or type(exc).__name__
        if "generation_batch_size" in text and "per_device_train_batch_size" not in text:
            # TRL names the derived size only: say which fields make it
            text += (
                " (generation_batch_size = per_device_train_batch_size x steps_per_generation x processes; set "
                "per_device_train_batch_size, steps_per_generation or num_generations accordingly)"
            )
        _fail(text)
    given = given_fields(parser, argv, ("max_steps", "rollouts", "max_completion_length"))
    resolve_length(run_args, cfg, given)
    if run_args.task == "arith" and "max_completion_length" not in given:
        from .arith_eval import ARITH_MAX_NEW_TOKENS

        cfg.max_completion_length = ARITH_MAX_NEW_TOKENS  # an answer is a few tokens, not K&K's 264
    return run_args, cfg


def given_preset(argv: list[str]) -> str | None:
    """The value of the last ``--preset NAME`` / ``--preset=NAME`` in argv (None when absent)."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--preset":
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                _fail("preset: --preset needs a name (`tokendyn train --help` lists them)")
            found = argv[i + 1]
        elif arg.startswith("--preset="):
            found = arg.split("=", 1)[1]
    return found


def given_fields(parser, argv: list[str], names: tuple[str, ...]) -> set[str]:
    """The fields among ``names`` that ``argv`` sets (``--config`` flags included), as argparse matches them
    (``--flag=value`` and abbreviations too): parsed again into a namespace that holds a marker for each, which
    argparse keeps where no flag sets it."""
    unset = object()
    namespace = argparse.Namespace(**{name: unset for name in names})
    parser.parse_known_args(argv, namespace=namespace)
    return {name for name in names if getattr(namespace, name) is not unset}


def resolve_length(run_args, cfg, given: set[str]) -> None:
    """The run's length: an explicit ``--max_steps`` with ``--rollouts`` left at its default sets ``rollouts`` to 0
    (max_steps as given); both given, with ``rollouts`` > 0, is an error naming both."""
    if "max_steps" not in given:
        return
    if "rollouts" not in given:
        run_args.rollouts = 0
    elif run_args.rollouts:
        _fail(
            f"rollouts, max_steps: give one of them, not both (got rollouts={run_args.rollouts}, "
            f"max_steps={cfg.max_steps}); --rollouts N sets max_steps to N x the optimizer steps per rollout, "
            "--rollouts 0 trains --max_steps steps"
        )


# TRL/transformers fields a K&K run commonly sets: listed by the short `--help` next to tokendyn's own
COMMON_TRL_FIELDS = (
    "output_dir",
    "report_to",
    "learning_rate",
    "per_device_train_batch_size",
    "num_generations",
    "max_completion_length",
    "temperature",
    "beta",
    "seed",
    "save_steps",
    "resume_from_checkpoint",
)


def own_fields() -> set[str]:
    """The fields tokendyn adds: every RunArguments field and what TokendynGRPOConfig adds to TRL's GRPOConfig."""
    from dataclasses import fields

    from trl import GRPOConfig

    from .config import TokendynGRPOConfig
    from .runner import RunArguments

    trl = {f.name for f in fields(GRPOConfig)}
    return {f.name for f in fields(RunArguments)} | {f.name for f in fields(TokendynGRPOConfig)} - trl


# controls a study sets, not a method a user trains with: listed by --help-all
STUDY_CONTROLS = ("random_halves",)
# the colocated vLLM engine's settings TRL has no field for: beside TRL's vllm_* fields, under --help-all
ENGINE_SETTINGS = ("vllm_dtype", "vllm_enforce_eager")
# the probe's switches that stay on in nearly every run: under --help-all
PROBE_SWITCHES = ("probe_floor",)


def short_help(parser) -> None:
    """`tokendyn train --help` lists tokendyn's flags and a few common TRL ones; `--help-all` lists every flag
    (TRL's ~200 fields are accepted either way)."""
    import argparse as ap

    from ..probe.rules import params

    # each per-token rule's parameters (dppo_tv_delta, aspo_*, ...): the rule is chosen by --policy_loss in the short
    # help, its published defaults rarely change, so its parameters are listed by --help-all
    rule_params = (
        {p.name for p in params()} | set(STUDY_CONTROLS) | set(ENGINE_SETTINGS) | set(PROBE_SWITCHES)
    )
    keep = (own_fields() - rule_params) | set(COMMON_TRL_FIELDS) | {"help", "config"}
    hidden = tuned = 0
    for action in parser._actions:
        if action.dest not in keep and action.help != ap.SUPPRESS:
            action.help = ap.SUPPRESS
            tuned += (
                action.dest in rule_params
                and action.dest not in STUDY_CONTROLS + ENGINE_SETTINGS + PROBE_SWITCHES
            )
            hidden += action.dest not in rule_params

    def rank(action) -> int:  # tokendyn's own first, then the common TRL fields (each in its declared order)
        return 0 if action.dest in own_fields() or action.dest in ("help", "config") else 1

    parser._actions.sort(key=rank)
    for group in parser._action_groups:
        group._group_actions.sort(key=rank)
    parser.description = (
        "GRPO (+Reweight, +Lopti) on K&K. Flags below: tokendyn's own, then the TRL fields a run usually sets; "
        "`--config run.yaml` sets any of them (flags win)."
    )
    parser.epilog = (
        f"{tuned} parameters of the per-token rules of --policy_loss (published defaults), the study's controls "
        "(--random_halves), the vLLM engine's --vllm_dtype and --vllm_enforce_eager (with --use_vllm), the probe's "
        "--probe_floor (on), and "
        f"{hidden} more TRL "
        "GRPOConfig / transformers TrainingArguments flags are accepted: `tokendyn train --help-all` lists them."
    )


def run(args: argparse.Namespace) -> int:
    from ..common import check_writable

    try:
        run_args, cfg = parse(args.argv)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    check_writable(cfg.output_dir + "/run.json", "output_dir")

    from rich.console import Console

    from .runner import method_name, prepare, train

    resume = prepare(run_args, cfg)  # every check before any work: nothing is created by a rejected command
    console = Console()
    on = f"K&K {run_args.people}" if run_args.task == "kk" else f"arith digits {run_args.arith_digits}"
    console.print(
        f"[bold]tokendyn train[/bold]: {method_name(cfg)} on {on} -> {cfg.output_dir}"
        + (f" (resuming from {resume})" if resume is not None else "")
    )
    meta = train(run_args, cfg)
    s = meta["summary"]
    console.print(
        f"finished in {meta['wall_time_s']:.0f} s; mean train reward {_fmt(s['mean_train_reward'])}, "
        f"mean train accuracy {_fmt(s['mean_train_accuracy'])}, mean held-out accuracy "
        f"{_fmt(s['mean_heldout_accuracy'])}"
    )
    print(f"run directory: {cfg.output_dir} (run.json, metrics.parquet, checkpoint-N/, final/)")
    return 0


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    sys.exit(run(argparse.Namespace(argv=sys.argv[1:])))
