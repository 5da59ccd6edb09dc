"""``tokendyn kk generate`` and ``tokendyn kk score``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ...common import atomic_write, check_writable
from .generator import MAX_PEOPLE, MIN_PEOPLE


def register(sub) -> None:
    kk = sub.add_parser("kk", help="Knights-and-Knaves: generate puzzles, score responses")
    kk_sub = kk.add_subparsers(dest="kk_command", metavar="KK_COMMAND", required=True)

    gen = kk_sub.add_parser(
        "generate", help="puzzles at stream positions I..I+C-1 as a parquet file in the official schema"
    )
    gen.add_argument("--people", type=int, required=True, help=f"puzzle size N ({MIN_PEOPLE}..{MAX_PEOPLE})")
    gen.add_argument("--seed", type=int, default=1234, help="stream seed (1234 = the official data)")
    gen.add_argument("--start", type=int, default=0, help="first stream position I (>= 0)")
    gen.add_argument("--count", type=int, required=True, help="number of puzzles C (> 0)")
    gen.add_argument("--template", default="qwen-instruct", help="prompt template: qwen-instruct | base")
    gen.add_argument("--split", default="test", help="value of extra_info.split: train | test")
    gen.add_argument("--out", required=True, help="output FILE.parquet")
    gen.set_defaults(func=run_generate)

    sc = kk_sub.add_parser("score", help="score responses with the official reward (3 / -0.5 / -1 / -3)")
    sc.add_argument(
        "--input",
        required=True,
        help="FILE.jsonl, one row per response: prompt, ground_truth (or solution_text_format), response",
    )
    sc.add_argument("--out", default=None, help="output jsonl (default: INPUT with .scores.jsonl)")
    sc.set_defaults(func=run_score)


def run_generate(args: argparse.Namespace) -> int:
    from .datasets import official_record, puzzles
    from .generator import check_people
    from .prompts import TEMPLATES

    check_people(args.people)
    if args.count <= 0:
        raise ValueError(f"count: must be > 0, got {args.count}")
    if args.start < 0:
        raise ValueError(f"start: must be >= 0, got {args.start}")
    if args.template not in TEMPLATES:
        raise ValueError(f"template: must be one of {sorted(TEMPLATES)}, got {args.template!r}")
    if args.split not in ("train", "test"):
        raise ValueError(f"split: must be train or test, got {args.split!r}")
    if not args.out.endswith(".parquet"):
        raise ValueError(f"out: must be a .parquet file path, got {args.out!r}")
    out = check_writable(args.out, "out")

    import polars as pl

    items = puzzles(args.people, args.seed, args.start, args.count)
    rows = [official_record(p, args.split, k, args.template) for k, p in enumerate(items)]
    atomic_write(out, lambda tmp: pl.DataFrame(rows).write_parquet(tmp))
    print(
        f"wrote {len(rows)} puzzles ({args.people} people, seed {args.seed}, positions "
        f"{args.start}..{args.start + args.count - 1}) to {out}"
    )
    return 0


def _read_rows(path: Path) -> list[dict]:
    """Parse and validate every row before any scoring; errors name the line and the field."""
    if not path.is_file():
        raise FileNotFoundError(f"input: no such file {str(path)!r}")
    if path.suffix.lower() in (".parquet", ".pq", ".arrow", ".csv", ".json", ".gz"):
        raise ValueError(
            f"input: {str(path)!r} is a {path.suffix} file; kk score reads JSON lines (FILE.jsonl, one object per "
            "line with prompt, ground_truth, response)"
        )
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"input line {lineno}: not UTF-8 text (byte {exc.start} of the line); kk score reads JSON lines"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"input line {lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(
                    f"input line {lineno}: expected a JSON object with prompt, ground_truth, response"
                )
            prompt = obj.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):  # official message list
                prompt = prompt[0].get("content")
            gt = obj.get("ground_truth", obj.get("solution_text_format"))
            if isinstance(gt, dict):
                gt = gt.get("solution_text_format")
            if gt is None and isinstance(obj.get("reward_model"), dict):
                gt = obj["reward_model"].get("ground_truth", {}).get("solution_text_format")
            response = obj.get("response")
            for field, value in (("prompt", prompt), ("ground_truth", gt), ("response", response)):
                if not isinstance(value, str):
                    raise ValueError(
                        f"input line {lineno}: field {field!r} must be a string, got {type(value).__name__}"
                    )
            rows.append({"prompt": prompt, "ground_truth": gt, "response": response})
    if not rows:
        raise ValueError(f"input: {str(path)!r} holds no rows")
    return rows


def run_score(args: argparse.Namespace) -> int:
    from .reward import compute_score

    path = Path(args.input)
    out = check_writable(args.out or str(path.with_suffix("")) + ".scores.jsonl", "out")
    rows = _read_rows(path)
    results = []
    for i, r in enumerate(rows):
        s = compute_score(r["prompt"] + r["response"], r["ground_truth"])
        results.append({"row": i, "reward": s.total, "format_ok": s.format_ok, "correct": s.correct})
        print(f"{i}\t{s.total:g}")

    def _w(tmp: str) -> None:
        with open(tmp, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")

    atomic_write(out, _w)
    acc = sum(r["correct"] for r in results) / len(results)
    mean = sum(r["reward"] for r in results) / len(results)
    print(f"{len(results)} rows: mean reward {mean:.3f}, accuracy {acc:.1%}; wrote {out}")
    return 0
