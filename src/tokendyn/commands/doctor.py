"""``tokendyn doctor RUN_DIR [RUN_DIR ...]``: the diagnosis of runs from their records (any stack: TRL, verl's
actor, ``tokendyn probe``): a short list of findings, each a measured value with its interval, the reference it is
judged against and its source, a verdict fine / watch / act, and what to try (`tokendyn.analysis.diagnosis`).

    tokendyn doctor runs/demo/grpo                   # text
    tokendyn doctor runs/a runs/b --json > d.json    # JSON, validated against the committed schema
    tokendyn doctor runs/demo/grpo --strict          # exit 1 when a finding says act (for CI)
"""

from __future__ import annotations

import argparse
import json
import sys

STRICT_EXIT = 1


def register(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="diagnose runs from their records: findings with intervals, references, verdicts (fine / watch / act) "
        "and what to try",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run directory (records/, run.json)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON (schema: "
                   "tokendyn.analysis.diagnosis.SCHEMA) instead of text")  # fmt: skip
    p.add_argument("--strict", action="store_true", help=f"exit {STRICT_EXIT} when a finding says act")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tokendyn.analysis.diagnosis import any_act, diagnose, render_text, validate
    from tokendyn.analysis.run import load_run

    for d in args.run_dirs:  # every path checked before any work
        load_run(d)
    doc = diagnose(args.run_dirs)
    validate(doc)
    if args.json:
        json.dump(doc, sys.stdout, indent=1, ensure_ascii=False)
        print()
    else:
        print(render_text(doc))
    return STRICT_EXIT if args.strict and any_act(doc) else 0
