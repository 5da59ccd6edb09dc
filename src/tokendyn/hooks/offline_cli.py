"""`tokendyn probe --model PATH_OR_ID --rollouts FILE --out RUN_DIR`: the training records of a rollout batch from any
RL stack (`tokendyn.hooks.offline`). Input is checked first (the rollouts schema, the out dir, every value range),
then the tokenizer, then the model; nothing is written unless the whole probe succeeds."""

from __future__ import annotations

import argparse
import math
import types
import typing
from dataclasses import MISSING, fields

from tokendyn.config import ProbeConfig, ProbeConfigError

# no float64: the probe takes vector_norm(..., dtype=float32) of the gradients, which refuses float64 input
DTYPES = ("float32", "bfloat16", "float16")


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `probe` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "probe",
        help="probe a rollouts file from any RL stack offline (same records as training)",
        description="Read a rollouts file (parquet or jsonl: prompt_ids + completion_ids or prompt + completion, "
        "and advantage or reward + group; optional old_logp, ref_logp, masks, temperature; see docs/records.md) or a verl "
        "rollout batch (a tensordict directory, or a DataProto.save_to_disk file with --allow_pickle; see "
        "docs/verl_dataproto.md), run "
        "one forward + backward of the token-mean loss per micro-batch under the gradient probe and the rebalancing "
        "analyses on the first sequences, and write RUN_DIR/records and RUN_DIR/run.json as a training run does.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="local model directory, Hugging Face hub id (owner/name), packaged model (smollm2-135m) or .gguf file "
        "(default: the embedded default)",
    )
    p.add_argument(
        "--rollouts",
        required=True,
        help="rollouts file, .parquet or .jsonl (one completion per row), or a verl batch: a tensordict directory "
        "(DataProto.batch.memmap(DIR)) or a DataProto.save_to_disk file (.dp, .pkl, .pickle; needs --allow_pickle)",
    )
    p.add_argument(
        "--allow_pickle",
        action="store_true",
        help="unpickle a verl DataProto file (.dp, .pkl, .pickle, as DataProto.save_to_disk writes it). Unpickling "
        "runs code from the file: pass this only for a file you trust. A tensordict directory is read without it",
    )
    p.add_argument("--out", required=True, help="run directory to create (must be absent or empty)")
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature T (default: the file's column, else 1.0)",
    )
    add_probe_arguments(p)
    p.add_argument("--batch_size", type=int, default=16, help="completions per forward + backward (>= 1)")
    p.add_argument("--epsilon", type=float, default=0.2, help="lower clip range of the ratio (>= 0)")
    p.add_argument("--epsilon_high", type=float, default=0.28, help="upper clip range of the ratio (>= 0)")
    p.add_argument("--delta", type=float, default=None, help="two-sided ratio cap (> 1; default none)")
    p.add_argument(
        "--beta", type=float, default=0.0, help="k3 KL coefficient (>= 0; > 0 needs a ref_logp column)"
    )
    p.add_argument(
        "--loss_type",
        default="dapo",
        help="the trained loss (TRL's loss_type): grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo",
    )
    p.add_argument("--sapo_temperature_pos", type=float, default=1.0, help="sapo: tau for A > 0 (> 0)")
    p.add_argument("--sapo_temperature_neg", type=float, default=1.05, help="sapo: tau for A <= 0 (> 0)")
    p.add_argument("--importance_sampling_level", default="token", help="token, or sequence (GSPO)")
    p.add_argument(
        "--use_bias_correction_kl",
        action="store_true",
        help="KL term times the ratio (TRL's default; off: plain k3)",
    )
    p.add_argument(
        "--top_entropy_quantile", type=float, default=1.0, help="keep the top-entropy tokens (0, 1]"
    )
    p.add_argument("--entropy_coef", type=float, default=0.0, help="entropy bonus coefficient")
    p.add_argument(
        "--max_completion_length",
        type=int,
        default=None,
        help="dr_grpo's constant normaliser (> 0; dr_grpo only)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the token samples")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="model dtype (default float32)")
    p.add_argument(
        "--positions",
        default="mask",
        choices=("mask", "model"),
        help="position ids: from the attention masks, as the sampler had them (default), or the model's own default "
        "(what TRL's training forward uses)",
    )
    p.set_defaults(func=run)
    return p


def _optional(kind):
    """argparse type of an ``X | None`` option: 'none' -> None, else ``kind(text)``."""

    def parse(text: str):
        return None if text.strip().lower() == "none" else kind(text)

    parse.__name__ = kind.__name__
    return parse


def add_probe_arguments(p: argparse.ArgumentParser) -> None:
    """One flag ``--<field>`` per `ProbeConfig` field (its help text; a flag not given is absent from the namespace
    and keeps ProbeConfig's default; 'none' sets an optional field to None)."""
    hints = typing.get_type_hints(ProbeConfig)
    for f in fields(ProbeConfig):
        hint, kw = hints[f.name], {}
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) is tuple or any(typing.get_origin(a) is tuple for a in args):
            inner = typing.get_args(hint if typing.get_origin(hint) is tuple else args[0])[0]
            kw = {"nargs": "+", "type": inner}
        elif isinstance(hint, types.UnionType):
            kw = {"type": _optional(args[0])}
        elif hint in (int, float):
            kw = {"type": hint}
        default = f.default if f.default is not MISSING else None
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        p.add_argument(
            f"--{f.name}", default=argparse.SUPPRESS, help=f"{f.metadata['help']} (default {shown})", **kw
        )


def probe_config(args: argparse.Namespace) -> ProbeConfig:
    """The `ProbeConfig` of the flags given (an error names the flag)."""
    given = {f.name: getattr(args, f.name) for f in fields(ProbeConfig) if hasattr(args, f.name)}
    try:
        return ProbeConfig(**given)
    except ProbeConfigError as exc:
        raise ValueError(f"--{exc}") from None


def _check_args(args: argparse.Namespace):
    """Value ranges; returns (probe config, objective). Raises ValueError naming the flag."""
    from tokendyn.probe.tokenloss import Objective

    def finite(name: str, v: float | None) -> None:
        if v is not None and not math.isfinite(v):
            raise ValueError(f"--{name}: must be a finite number, got {v!r}")

    for name in ("temperature", "epsilon", "epsilon_high", "delta", "beta"):
        finite(name, getattr(args, name))
    if args.temperature is not None and not args.temperature > 0:
        raise ValueError(f"--temperature: must be > 0, got {args.temperature:g}")
    if args.batch_size < 1:
        raise ValueError(f"--batch_size: must be >= 1, got {args.batch_size}")
    for name in ("epsilon", "epsilon_high", "beta"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name}: must be >= 0, got {getattr(args, name):g}")
    if args.delta is not None and not args.delta > 1:
        raise ValueError(f"--delta: must be > 1 (or left unset), got {args.delta:g}")
    config = probe_config(args)
    finite("top_entropy_quantile", args.top_entropy_quantile)
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        finite(name, getattr(args, name))
    finite("entropy_coef", args.entropy_coef)
    try:
        objective = Objective(
            eps_low=args.epsilon,
            eps_high=args.epsilon_high,
            delta=args.delta,
            beta=args.beta,
            loss_type=args.loss_type,
            importance_sampling_level=args.importance_sampling_level,
            bias_correction_kl=args.use_bias_correction_kl,
            top_entropy_quantile=args.top_entropy_quantile,
            entropy_coef=args.entropy_coef,
            max_completion_length=args.max_completion_length,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
        )
    except ValueError as exc:  # "objective: <field> ..." -> the flag
        field = str(exc).removeprefix("objective: ").split(" ", 1)
        raise ValueError(f"--{field[0]}: {field[1] if len(field) > 1 else exc}") from None
    return config, objective


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device: unknown device {name!r} (auto, cpu, cuda, cuda:N, mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {name!r} asked but no CUDA device is available")
    return device


def _load(what: str, fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except (OSError, ValueError) as exc:  # transformers raises OSError for missing repos or folders
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"--model: cannot load the {what} ({first})") from None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tokendyn.hooks.offline import check_run_dir, resolve_temperature
    from tokendyn.hooks.rollouts import read_rollouts

    console = Console(stderr=True)
    options, objective = _check_args(args)
    rollouts = read_rollouts(args.rollouts, allow_pickle=args.allow_pickle)
    temperature = resolve_temperature(rollouts, args.temperature)
    if args.beta > 0 and rollouts.ref_logp is None:
        raise ValueError(
            f"--beta: {args.beta:g} > 0 needs a 'ref_logp' column in the rollouts file; use --beta 0"
        )
    check_run_dir(args.out)
    device = _device(args.device)

    import torch

    from tokendyn.hooks.model_fit import check_fits, model_limits
    from tokendyn.hooks.offline import probe_rollouts
    from tokendyn.packaged import resolve
    from tokendyn.policy import check_model_source, default_policy_dir, load_tokenizer

    model_name = args.model or str(default_policy_dir())
    # one resolver for the config, the tokenizer and the weights: a packaged name (smollm2-135m) or a .gguf file
    # becomes its converted directory in the cache, anything else stays as given
    model_path = resolve(model_name, "--model")
    config = check_model_source(model_path, "--model")  # the config only: no weights yet
    tokenizer = _load("tokenizer", load_tokenizer, model_path)
    rollouts = rollouts.encode(tokenizer)  # text rows tokenized and checked before the model is loaded
    # ids < vocabulary, rows within the positions: still no weights loaded
    check_fits(rollouts, *model_limits(config))
    console.print(
        f"rollouts: {rollouts.n} completions ({'token ids' if rollouts.mode == 'ids' else 'text'}), advantages from "
        f"{rollouts.advantage_source}, pi_old {'from old_logp' if rollouts.old_logp is not None else 'on-policy'}, "
        f"T = {temperature:g}"
        + (f"; ignored columns: {', '.join(rollouts.ignored)}" if rollouts.ignored else "")
    )
    from transformers import AutoModelForCausalLM

    shown = model_name if model_path == model_name else f"{model_name} ({model_path})"
    console.print(f"loading {shown} ({args.dtype}, {device})")
    model = _load("model", AutoModelForCausalLM.from_pretrained, model_path, dtype=getattr(torch, args.dtype))
    model.to(device)
    result = probe_rollouts(
        model,
        tokenizer,
        rollouts,
        args.out,
        options,
        temperature=temperature,
        batch_size=args.batch_size,
        objective=objective,
        seed=args.seed,
        progress=True,
        meta={"model": model_name, "device": str(device), "dtype": args.dtype}
        | ({} if model_path == model_name else {"model_path": model_path}),
        positions=args.positions,
    )
    console.print(
        f"probed {result.tokens} tokens of {result.rows} completions in {result.micro_batches} micro-batch(es)"
        + (f"; analyses on {result.analysed_rows} sequences" if result.analysed_rows else "")
    )
    print(
        f"wrote {len(result.files)} record files to {result.run_dir / 'records'} and {result.run_dir / 'run.json'}"
    )
    print(f"next: tokendyn analyze {result.run_dir}")
    return 0
