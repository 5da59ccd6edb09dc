"""Cost of the probe and of the rebalancing analyses on the real LLM (SmolLM2-135M-Instruct: 30 layers, V = 49,152,
tied head), in time and in memory, on a rollout of its own samples, as ratios measured in this one run.

The rollout is what `tokendyn demo --policy smollm2-135m` trains on: `--prompts` sums of one- and two-digit numbers
(the task's training stream), `--group` samples each at T = 0.7, at most 16 completion tokens, rewards from the exact
scorer and group-normalised advantages. The training step of that rollout = its generation + its update phase
(micro-batches of `--micro` rows: the fused-head GRPO micro-step of `memory.measure.grpo_step`, backward, then one
AdamW step). Measured:

- time: the probe on the update phase (its first probed step, which refreshes sigma_max and replays every layer for
  the direct gradients, and a later one), every analysis on the first `--sample` rows (`analyze_update` as the
  trainer makes it: by default with step_precision measured, its check step (float64 and model-dtype steps) and a
  later step in the precision the check chose, and their mean over one check every `CHECK_EVERY` analysed steps),
  and the paired comparison (base, Reweight, Lopti at equal norm) in that precision, each against the whole step
  and its update phase;
- memory: the allocator's peak (`memory.measure.AllocPeak`, not RSS) of one micro-step plain, with the probe, and of
  the analyses on their sample (steps in the model's dtype; float64 steps of the float32 gradient, a check step's
  float64 half; every op in float64), against the micro-step's peak.

    python bench/real_llm_cost.py                      # ~15 min of one quiet thread (30 min under load)
    python bench/real_llm_cost.py --sample 4 --step-precision model --no-memory   # what the analyses' cost scales with
    python bench/real_llm_cost.py --model DIR_OR_GGUF  # another policy
"""

from __future__ import annotations

import argparse
import time

import torch
from memory.measure import AllocPeak, grpo_step, measure_probe, measure_step

T = 0.7
LOPTI_STAGE = (
    0.5,
    "low_first",
)  # the compared Lopti's first stage, kept from the analyses as the trainer does


def timed_once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@torch.no_grad()
def sample_rollout(model, tok, prompts: int, group: int, seed: int = 0) -> tuple[dict, int, float]:
    """(batch in `memory.measure`'s format: left-padded prompts, completions right-padded to the longest, mask up to
    and including the first EOS, group-normalised advantages), completion length, generation seconds."""
    from tokendyn.tasks.arith.datasets import arith_problems
    from tokendyn.tasks.arith.prompts import render_prompt
    from tokendyn.tasks.arith.reward import score

    problems = arith_problems([1, 2], "train", seed=7, count=prompts // 2 + 1)
    problems = (problems[: prompts // 2] + problems[-(prompts - prompts // 2) :])[:prompts]
    texts = [render_prompt(p.a, p.b, tok) for p in problems for _ in range(group)]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    torch.manual_seed(seed)
    model.eval()
    t0 = time.perf_counter()
    out = model.generate(
        **enc, do_sample=True, temperature=T, top_p=1.0, top_k=0, max_new_tokens=16,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    gen_s = time.perf_counter() - t0
    model.train()
    completion = out[:, enc["input_ids"].size(1) :]
    is_eos = completion == tok.eos_token_id
    after = is_eos.long().cumsum(1) - is_eos.long()  # EOS tokens strictly before this position
    mask = after == 0
    rewards = torch.tensor(
        [score(tok.decode(c[m]), p.answer) for c, m, p in zip(completion, mask, [q for q in problems for _ in range(group)], strict=True)]
    ).view(prompts, group)  # fmt: skip
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()
    batch = {
        "input_ids": out,
        "attention_mask": torch.cat([enc["attention_mask"], mask.long()], dim=1),
        "completion_mask": mask,
        "advantages": adv,
        "completion_ids": completion,
        "rewards": rewards.flatten(),
    }
    return batch, completion.size(1), gen_s


def rows(batch: dict, lo: int, hi: int) -> dict:
    return {k: v[lo:hi] for k, v in batch.items()}


def update_phase(model, opt, batch: dict, c_len: int, micro: int, probe=None, step: int = 0) -> None:
    """The rollout's update: micro-steps of ``micro`` rows (``probe``: each one probed as optimizer step ``step``),
    then one AdamW step."""
    n = batch["input_ids"].size(0)
    for lo in range(0, n, micro):
        b = rows(batch, lo, lo + micro)
        if probe is not None:
            probe.begin_step(step, completion_mask=b["completion_mask"], advantages=b["advantages"],
                             completion_ids=b["completion_ids"])  # fmt: skip
        grpo_step(model, b, c_len)
        if probe is not None:
            probe.end_step()
    opt.step()
    opt.zero_grad(set_to_none=True)


def probe_batch(batch: dict, n: int):
    from tokendyn.probe.tokenloss import ProbeBatch

    b = rows(batch, 0, n)
    return ProbeBatch(b["input_ids"], b["attention_mask"], b["completion_mask"], b["advantages"].double(),
                      temperature=T)  # fmt: skip


def timing(args, model, tok, opt, batch, c_len, gen_s, sample, objective) -> None:
    """The time section (module docstring)."""
    from tokendyn.config import ProbeConfig
    from tokendyn.effects.compare import compare_rules, make_rule
    from tokendyn.effects.precision import CHECK_EVERY, MeasuredPrecision, check_summary
    from tokendyn.effects.rebalance import RebalanceOptions, analyze_update
    from tokendyn.probe.probe import GradientProbe

    # -- time
    update_phase(model, opt, batch, c_len, args.micro)  # warm-up
    plain = [timed_once(lambda: update_phase(model, opt, batch, c_len, args.micro)) for _ in range(2)]
    probe = GradientProbe(model, ProbeConfig(), temperature=T, seed=0).attach()
    try:
        # step 0: sigma_max refreshed and direct gradients (every direct_every-th step); steps 1, 2: neither
        first = timed_once(lambda: update_phase(model, opt, batch, c_len, args.micro, probe, 0))
        later = [
            timed_once(lambda s=s: update_phase(model, opt, batch, c_len, args.micro, probe, s))
            for s in (1, 2)
        ]
    finally:
        probe.detach()
    plain.append(timed_once(lambda: update_phase(model, opt, batch, c_len, args.micro)))
    upd = sorted(plain)[1]
    whole = gen_s + upd
    held: dict = {}
    model.eval()

    state = MeasuredPrecision()  # (step_precision measured: the run's schedule, a check on its first step)
    options = RebalanceOptions(step_precision=args.step_precision)

    def analyses():
        with MeasuredPrecision.quiet(state):
            held["frames"], held["full"] = analyze_update(model, sample, step=0, options=options, objective=objective,
                                                          tokenizer=tok, precision_state=state,
                                                          first_stage=LOPTI_STAGE)  # fmt: skip

    t_check = None
    if args.step_precision == "measured":  # the check step, then a later one in the precision it chose
        t_check = timed_once(analyses)
        check = held["frames"]["precision_check"]
        print(f"the check: {check_summary(check)}", flush=True)
    t_an = timed_once(analyses)
    used = MeasuredPrecision.used(args.step_precision, state)
    rules = [make_rule(r, objective) for r in ("base", "reweight", "lopti")]

    def paired():
        with MeasuredPrecision.quiet(state):
            compare_rules(model, sample, rules, modes=("equal_norm",), lr=1e-3, optimizer=opt, full=held["full"],
                          precision=used)  # fmt: skip

    t_cmp = timed_once(paired)
    model.train()
    later_s = sorted(later)[0]
    print(f"\ntime (s; one run, {args.threads} thread(s)): generation {gen_s:.1f}, update phase {upd:.1f} "
          f"(plain runs {', '.join(f'{p:.1f}' for p in plain)}), whole step {whole:.1f}")  # fmt: skip
    print(f"{'':<64}{'seconds':>9}{'/ whole':>9}{'/ update':>10}")
    lines = [
        ("update phase, first probed step (probe on)", first),
        ("update phase, later probed step (probe on)", later_s),
    ]
    if t_check is not None:
        lines.append((f"every analysis on {args.sample} rows, the check step (both)", t_check))
        amortised = (t_check + (CHECK_EVERY - 1) * t_an) / CHECK_EVERY
    lines.append((f"every analysis on {args.sample} rows ({used} steps)", t_an))
    if t_check is not None:
        lines.append((f"  the same, one check every {CHECK_EVERY} analysed steps", amortised))
        t_an = amortised
    lines.append((f"+ paired comparison base/reweight/lopti, equal_norm ({used} steps)", t_cmp))
    for label, t in lines:
        print(f"{label:<64}{t:>9.1f}{t / whole:>9.3f}{t / upd:>10.3f}")
    print(f"probed step / plain step, whole step: first {(whole - upd + first) / whole:.3f}x, later "
          f"{(whole - upd + later_s) / whole:.3f}x; a step with every analysis {(whole + t_an) / whole:.3f}x, "
          f"and the comparison {(whole + t_an + t_cmp) / whole:.3f}x")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--micro", type=int, default=8, help="rows per micro-batch of the update phase")
    ap.add_argument("--sample", type=int, default=16, help="rows of the analysis sample")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--step-precision",
        choices=("measured", "float64", "float64_step", "model"),
        default="measured",
        help="the analyses' counterfactual steps (timed): measured (the default: a check step made both ways, then "
        "steps in the dtype it chose), float64 or in the model's dtype",
    )
    ap.add_argument("--no-memory", action="store_true", help="time only")
    ap.add_argument("--no-time", action="store_true", help="memory only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from trl.trainer.utils import add_fused_lm_head

    from tokendyn.effects.rebalance import RebalanceOptions, analyze_update
    from tokendyn.policy import load_policy
    from tokendyn.probe.tokenloss import Objective

    model, tok = load_policy(args.model, dtype=torch.float32)
    add_fused_lm_head(model, temperature=T)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-8)
    batch, c_len, gen_s = sample_rollout(model, tok, args.prompts, args.group)
    n = batch["input_ids"].size(0)
    tokens = int(batch["completion_mask"].sum())
    print(f"{args.model}: rollout {args.prompts} prompts x {args.group} samples = {n} rows, prompt "
          f"{batch['input_ids'].size(1) - c_len} + completion {c_len} columns, {tokens} completion tokens; "
          f"mean reward {batch['rewards'].mean():.3f}; {torch.get_num_threads()} thread(s)", flush=True)  # fmt: skip

    sample = probe_batch(batch, args.sample)
    objective = Objective(eps_low=0.2, eps_high=0.24, delta=10.0, loss_type="dapo")
    if not args.no_time:
        timing(args, model, tok, opt, batch, c_len, gen_s, sample, objective)

    if args.no_memory:
        return
    # -- memory (the allocator's peaks, one micro-batch of the update phase)
    b = rows(batch, 0, args.micro)
    step_peak = measure_step(model, b, c_len)
    probe_peak, probe_owned, _ = measure_probe(model, b, c_len)
    print(f"\nmemory (allocator peak, one micro-step of {args.micro} rows, parameters not counted):")
    print(f"micro-step plain {step_peak / 1e9:.3f} GB; with the probe {probe_peak / 1e9:.3f} GB "
          f"({probe_peak / step_peak:.3f}x; the probe's own live bytes at most {probe_owned / 1e6:.1f} MB)", flush=True)  # fmt: skip
    for precision in (
        "model",
        "float64_step",
        "float64",
    ):  # (measured: a check step's peak is float64_step's on float32 weights, the all-float64 path's on bf16; the
        # others the model's dtype's)
        model.eval()
        model.zero_grad(set_to_none=True)
        with AllocPeak() as p:
            analyze_update(model, sample, step=0, options=RebalanceOptions(step_precision=precision),
                           objective=objective, first_stage=LOPTI_STAGE)  # fmt: skip
        model.train()
        print(f"every analysis on {args.sample} rows, steps in {precision}: {p.peak / 1e9:.3f} GB "
              f"({p.peak / step_peak:.3f}x the micro-step's peak)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
