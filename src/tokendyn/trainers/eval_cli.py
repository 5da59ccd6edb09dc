"""``tokendyn eval --model PATH --people 3 4 5 6 7 --n 100``: the paper's per-difficulty table."""

from __future__ import annotations

import argparse

from ..tasks.kk.generator import MAX_PEOPLE, MIN_PEOPLE


def register(sub) -> None:
    p = sub.add_parser(
        "eval", help="per-difficulty K&K accuracy on the official test puzzles (greedy and sampled)"
    )
    p.add_argument(
        "--model",
        default=None,
        help="policy directory, hub id (owner/name), packaged model (smollm2-135m) or .gguf file (default: the "
        "embedded default)",
    )
    p.add_argument("--people", type=int, nargs="+", default=[3, 4, 5, 6, 7], help="puzzle sizes (2..8)")
    p.add_argument("--n", type=int, default=100, help="puzzles per size, 1..100 (the official test split)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (> 0)")
    p.add_argument("--modes", nargs="+", default=["greedy", "sampled"], help="greedy and/or sampled")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--batch_size", type=int, default=64, help="generation batch size (> 0)")
    p.add_argument("--out", default="eval.parquet", help="output FILE.parquet (long format)")
    p.set_defaults(func=run)


def validate(args: argparse.Namespace) -> None:
    bad = [k for k in args.people if not MIN_PEOPLE <= k <= MAX_PEOPLE]
    if bad:
        raise ValueError(f"people: every size must be in {MIN_PEOPLE}..{MAX_PEOPLE}, got {bad}")
    if not 1 <= args.n <= 100:
        raise ValueError(
            f"n: must be in 1..100 (the official test split has 100 puzzles per size), got {args.n}"
        )
    if not args.temperature > 0:
        raise ValueError(f"temperature: must be > 0, got {args.temperature}")
    if set(args.modes) - {"greedy", "sampled"} or not args.modes:
        raise ValueError(f"modes: must be greedy and/or sampled, got {args.modes}")
    if args.batch_size <= 0:
        raise ValueError(f"batch_size: must be > 0, got {args.batch_size}")
    if not args.out.endswith(".parquet"):
        raise ValueError(f"out: must be a .parquet file path, got {args.out!r}")


def accuracy_table(rows: list[dict], title: str):
    """A rich table: one row per mode, one column per size, and the average (the paper's layout)."""
    from rich.table import Table

    sizes = sorted({r["people"] for r in rows})
    t = Table(title=title)
    t.add_column("mode")
    for k in sizes:
        t.add_column(f"{k} ppl", justify="right")
    t.add_column("avg", justify="right")
    t.add_column("format valid", justify="right")
    t.add_column("mean reward", justify="right")
    for mode in dict.fromkeys(r["mode"] for r in rows):
        rs = {r["people"]: r for r in rows if r["mode"] == mode}
        accs = [rs[k]["accuracy"] for k in sizes]
        t.add_row(
            mode,
            *[f"{a:.2f}" for a in accs],
            f"{sum(accs) / len(accs):.2f}",
            f"{sum(rs[k]['format_valid'] for k in sizes) / len(sizes):.0%}",
            f"{sum(rs[k]['mean_reward'] for k in sizes) / len(sizes):+.2f}",
        )
    return t


def run(args: argparse.Namespace) -> int:
    from ..common import atomic_write, check_writable, progress_bar

    validate(args)
    out = check_writable(args.out, "out")
    model_path = None
    if args.model is not None:
        from ..packaged import resolve
        from ..policy import check_model_source

        # one resolver for the config, the weights and the tokenizer (a packaged name or a .gguf file: its
        # converted directory in the cache)
        model_path = resolve(args.model, "model")
        check_model_source(model_path, "model")

    import polars as pl
    from rich.console import Console

    from ..policy import default_policy_dir, load_policy
    from .evaluate import evaluate

    model, tok = load_policy(model_path)
    name = args.model or str(default_policy_dir())
    with progress_bar("eval", len(args.people) * len(args.modes)) as tick:
        results = evaluate(
            model,
            tok,
            args.people,
            n=args.n,
            temperature=args.temperature,
            modes=tuple(args.modes),
            seed=args.seed,
            batch_size=args.batch_size,
            on_result=lambda r: tick(f"{r.people} people, {r.mode}: accuracy {r.accuracy:.2f}"),
        )
    rows = [{"model": name, **r.row()} for r in results]
    Console().print(accuracy_table(rows, f"K&K accuracy (reward == 3) of {name}, n={args.n} per size"))
    atomic_write(out, lambda tmp: pl.DataFrame(rows).write_parquet(tmp))
    print(f"wrote {out}")
    return 0
