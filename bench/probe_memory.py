"""Peak extra memory of the probe and of each rebalancing analysis, fitted as a memory model and extrapolated to
Qwen2.5-7B on 8 GPUs.

What is measured: the CPU allocator's own peak of a region (not RSS), checked to the byte by a self-check at the
start (bench/memory/measure.py says how).

Per size (a random Qwen2 of that shape, float32 or bfloat16, unpadded rows of prompt + completion):
  step          the training step's own peak: TRL's fused-LM-head forward + the GRPO (dapo, clipped) loss + backward,
                gradients allocated (no probe); step_ckpt the same with non-reentrant gradient checkpointing
  probe         in the same step with a `GradientProbe` attached (a fresh probe: its first step has direct gradients
                and a sigma_max refresh): the peak of the bytes the probe's own code allocated and had not freed
                (allocations under a Python frame of tokendyn/probe/, frees matched by address), an upper bound on
                what it adds to the step's peak, whichever phase it allocates in; the bench also prints what it did
                add at each size (probe_at_peak: the probed step's peak minus the step's, not fitted: a difference of
                maxima does not extrapolate). Its two phases are measured apart: probe_direct (no check tokens) and
                probe_head (no direct gradients), the head checks, themselves the larger of two passes measured
                apart: probe_checks (a probe resumed mid-schedule: no sigma_max refresh) and probe_gram (the
                refresh alone: no check tokens). The 7B prediction is given for a step with direct gradients and for
                one without (direct_every: most probed steps), the latter with the direct features at 0; what the
                probe adds to the 7B step's peak counts its head checks (in the backward) whole and its direct
                gradients (a layer replay between the forward and the backward) only above the backward's own
                transient (`probe_increase`)
  analyses      peak of `analyze_batch` on the sample sequences, one `RebalanceOptions` switch at a time
                (shares, token_shares, change, sweep, influence), the Lopti stages (influence and shares per stage),
                and `all` (the trainer's options with Lopti, the stage-1 shares and the real change's pi_before);
                `all_ckpt` is `all` with HF gradient checkpointing on (non-reentrant)

Each component is fitted by least squares on features in bytes read from the code, coefficients >= 0 ("how many
such buffers"; bench/memory/fit.py), checked on held-out sizes, then evaluated for Qwen2.5-7B (28 layers, hidden
3584, intermediate 18944, 28 / 4 heads, vocab 152,064, bf16), 8 x 8 rollouts of 4,096 completion tokens + ~300
prompt tokens, 8 GPUs with FSDP2, against the training step's own predicted peak per GPU (with gradient
checkpointing: without it the step does not fit one H200; bench/memory/predict.py). The report ends with the
memory-model block of docs/results.md. This script is the entry point: the sizes measured and the arguments.

    python bench/probe_memory.py            # ~9 min on 2 cores
    python bench/probe_memory.py --quick    # ~2 min
    python bench/probe_memory.py --json out.json

Exit status 1 when the worst held-out error of the fitted components is over its target (15 %), or the allocator
self-check failed: the report is printed either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from memory import HELD_OUT_TARGET, Size, fit_all, report, run, self_check  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# the sizes measured

# one-at-a-time variations around a base, a few joint ones, and bfloat16 (separates dtype-sized from float32 terms)
BASE = Size(layers=2, hidden=64, vocab=4096, completion=128)
TRAIN_SIZES = [
    BASE,
    dataclasses.replace(BASE, hidden=128),
    dataclasses.replace(BASE, hidden=192, heads=6),
    dataclasses.replace(BASE, layers=4),
    dataclasses.replace(BASE, layers=6),
    dataclasses.replace(BASE, vocab=8192),
    dataclasses.replace(BASE, vocab=16384),
    dataclasses.replace(BASE, completion=256),
    dataclasses.replace(BASE, completion=384),
    dataclasses.replace(BASE, rows=2, sample=2),
    dataclasses.replace(BASE, rows=8, sample=8),
    dataclasses.replace(BASE, sample=8),
    dataclasses.replace(BASE, layers=4, hidden=128, vocab=8192, completion=256),
    # the transformer body larger than the vocabulary (as at 7B): activations and parameters dominate
    Size(layers=6, hidden=256, vocab=512, completion=128, heads=8, kv=2),
    Size(layers=4, hidden=192, vocab=1024, completion=256, heads=6, kv=2, inter=1024),
    dataclasses.replace(BASE, dtype="bfloat16"),
    Size(layers=4, hidden=128, vocab=512, completion=256, dtype="bfloat16"),
]
HELD_OUT = [
    Size(layers=5, hidden=160, vocab=12288, completion=320, rows=4, sample=6, heads=5, kv=1),
    Size(layers=5, hidden=224, vocab=768, completion=192, rows=4, sample=6, heads=7, kv=1, inter=640),
]
QUICK_TRAIN = [
    Size(layers=2, hidden=32, vocab=1024, completion=64),
    Size(layers=2, hidden=64, vocab=1024, completion=64),
    Size(layers=4, hidden=32, vocab=1024, completion=64),
    Size(layers=2, hidden=32, vocab=4096, completion=64),
    Size(layers=2, hidden=32, vocab=1024, completion=192),
    Size(layers=2, hidden=32, vocab=1024, completion=64, rows=8, sample=8),
    Size(layers=3, hidden=64, vocab=2048, completion=128),
    Size(layers=2, hidden=32, vocab=1024, completion=64, dtype="bfloat16"),
    Size(layers=2, hidden=64, vocab=4096, completion=128, dtype="bfloat16"),
]
QUICK_HELD = [Size(layers=3, hidden=96, vocab=3072, completion=160, rows=4, sample=6, heads=4, kv=2)]


def _kv(items: list[str]) -> dict:
    import ast

    out = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def load_measurements(payload: dict) -> tuple[list[Size], list[dict], list[Size], list[dict]]:
    """(train sizes, their measurements, held-out sizes, theirs) of a --json file."""
    names = {f.name for f in dataclasses.fields(Size)}
    out = []
    for group in ("train", "held"):
        rows = payload[group]
        out.append([Size(**{k: v for k, v in r.items() if k in names}) for r in rows])
        out.append([{k: v for k, v in r.items() if k not in names} for r in rows])
    return tuple(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (~2 min)")
    ap.add_argument("--json", help="write the measurements and fits to this file")
    ap.add_argument(
        "--probe-kw",
        nargs="*",
        default=[],
        metavar="K=V",
        help="extra GradientProbe keywords (e.g. direct_memory_mb=256); ignored where this version lacks them",
    )
    ap.add_argument(
        "--options-kw", nargs="*", default=[], metavar="K=V", help="extra RebalanceOptions fields, likewise"
    )
    ap.add_argument(
        "--refit",
        metavar="JSON",
        help="no measuring: refit and report the measurements stored in a --json file",
    )
    args = ap.parse_args(argv)
    if args.refit:
        with open(args.refit) as fh:
            payload = json.load(fh)
        train, meas_train, held, meas_held = load_measurements(payload)
        check = payload["self_check"]
        print(f"refitting {len(train)} training sizes and {len(held)} held-out size(s) from {args.refit}")
        res = fit_all(train, held, meas_train, meas_held) | {"seconds": payload.get("seconds", float("nan"))}
    else:
        extra_probe, extra_options = _kv(args.probe_kw), _kv(args.options_kw)
        torch.set_num_threads(1)
        check = self_check()
        if not check["ok"]:
            print(f"allocator self-check FAILED: {check}", file=sys.stderr)
        train, held = (QUICK_TRAIN, QUICK_HELD) if args.quick else (TRAIN_SIZES, HELD_OUT)
        print(f"measuring {len(train)} training sizes and {len(held)} held-out size(s) ...")
        res = run(train, held, extra_probe=extra_probe, extra_options=extra_options)
    payload = {
        "self_check": check,
        "seconds": res["seconds"],
        "train": [dataclasses.asdict(s) | m for s, m in zip(train, res["meas_train"], strict=True)],
        "held": [dataclasses.asdict(s) | m for s, m in zip(held, res["meas_held"], strict=True)],
    }
    if args.json and not args.refit:  # the measurements first: a report that fails can be redone by --refit
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=1, default=float)
    summary = report(res, check)
    print(f"\nwall time of the measurements {res['seconds']:.0f} s")
    if args.json:
        payload["fits"] = {c: dataclasses.asdict(f) for c, f in res["fits"].items()}
        payload["qwen7b"], payload["settings"] = summary["pred"], summary["table"]
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=1, default=float)
    if summary["worst"] > HELD_OUT_TARGET or not check["ok"]:
        print(
            f"FAIL: worst held-out error {summary['worst']:.1%} (target <= {HELD_OUT_TARGET:.0%}), allocator "
            f"self-check {'exact' if check['ok'] else 'MISMATCH'}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
