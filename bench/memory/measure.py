"""Measurement: the allocator's peak of a region (`AllocPeak`, checked to the byte by `self_check`), the random
Qwen2 of a `Size`, its batch, and the peak bytes of every component at one size (`measure_size`): the training
step (with and without gradient checkpointing), the probe in it, and each rebalancing analysis.

What is measured (CPU, the allocator's own statistics, not RSS): `torch.profiler` with ``profile_memory=True`` has
the CPU allocator report every allocation and free with its running total of allocated bytes; the peak of a region
is the largest running total inside it (counted from 0 at the region's start, so memory that already existed, the
parameters, is not in it). A self-check allocates tensors of known sizes and requires the peak to the byte.

Only public entry points are used (`GradientProbe(model, ...)`, `analyze_batch` / `RebalanceOptions`), and keywords
are passed only where the installed version has them, so the bench measures the code before and after the memory
work (the fit says which terms remain)."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import os
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

# ---------------------------------------------------------------------------------------------------------------
# the allocator's peak


def _walk(nodes):
    for n in nodes:
        yield n
        yield from _walk(n.children)


class AllocPeak:
    """Peak bytes allocated inside a ``with`` block, from the CPU allocator's reports under the profiler.

    The allocator reports, with every allocation and free, its running total of allocated bytes; that total is
    process-wide (it carries what earlier profiled blocks left allocated, and misses frees made while no profiler
    ran), so the peak is taken relative to the total just before the block's first event. ``peak``: that relative
    maximum (the allocator's own statistic); ``peak_events``: the same from the block's allocation / free sizes
    summed in time order (a cross-check); ``end``: bytes still allocated at the end, relative."""

    def __init__(self, owner: str | None = None) -> None:
        # owner: a path fragment (e.g. "tokendyn/probe/"); ``peak_owned`` is then the peak of the bytes allocated
        # under a Python frame from such a file and not yet freed (Python stacks recorded: slower)
        self.owner = owner

    def __enter__(self) -> AllocPeak:
        gc.collect()
        self._prof = profile(
            activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=self.owner is not None
        )
        self._prof.__enter__()
        return self

    def _owned(self, node) -> bool:
        q = node.parent
        while q is not None:
            if self.owner in q.name:
                return True
            q = q.parent
        return False

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        events = []
        for node in _walk(self._prof.profiler.kineto_results.experimental_event_tree()):
            ef = node.extra_fields
            if type(ef).__name__.endswith("Allocation") and str(ef.device) == "cpu":
                owned = self.owner is not None and ef.alloc_size > 0 and self._owned(node)
                events.append(
                    (node.start_time_ns, int(ef.alloc_size), int(ef.total_allocated), ef.ptr, owned)
                )
        events.sort(key=lambda e: e[0])
        live: dict[int, int] = {}
        running, best = 0, 0
        for _, n, _, ptr, owned in events:
            if owned:
                live[ptr] = n
                running += n
            elif n < 0 and ptr in live:
                running -= live.pop(ptr)
            best = max(best, running)
        self.peak_owned = best
        base = events[0][2] - events[0][1] if events else 0
        self.peak = max([0, *(e[2] - base for e in events)])
        self.end = events[-1][2] - base if events else 0
        running, best = 0, 0
        for _, n, *_ in events:
            running += n
            best = max(best, running)
        self.peak_events = best
        self.n_events = len(events)
        del self._prof


def self_check() -> dict:
    """Allocate known tensors and compare: A (1e6 float32) + B (5e5 float64) live together -> 8,000,000 B, then A
    freed and C (2.5e5 float32) -> 5,000,000 B; a matmul (64x128 @ 128x32 float32) adds its 8,192-byte output; and a
    block after one that left 4,000,000 B allocated (kept) counts only its own 1,000,000 B."""

    def body():
        a = torch.empty(1_000_000, dtype=torch.float32)
        b = torch.empty(500_000, dtype=torch.float64)
        del a
        c = torch.empty(250_000, dtype=torch.float32)
        del b, c

    x, y = torch.ones(64, 128), torch.ones(128, 32)
    with AllocPeak() as p1:
        body()
    with AllocPeak() as p2:
        z = x @ y
        del z
    kept = []
    with AllocPeak() as p3:
        kept.append(torch.empty(1_000_000, dtype=torch.float32))
    with AllocPeak() as p4:
        d = torch.empty(250_000, dtype=torch.float32)
        del d
    kept.clear()
    expected = (8_000_000, 64 * 32 * 4, 4_000_000, 1_000_000)
    got = (p1.peak, p2.peak, p3.peak, p4.peak)
    got_events = (p1.peak_events, p2.peak_events, p3.peak_events, p4.peak_events)
    return {
        "expected": expected,
        "allocator": got,
        "events": got_events,
        "ok": got == expected and got_events == expected,
    }


# ---------------------------------------------------------------------------------------------------------------
# sizes, models, batches


@dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    vocab: int
    completion: int  # C, completion tokens per row
    rows: int = 4  # rows of the training micro-batch (the probed step)
    sample: int = 4  # sample sequences (rows) of the analyses
    prompt: int = 16
    heads: int = 4
    kv: int = 2
    inter: int | None = None  # default 3 x hidden
    dtype: str = "float32"
    tied: bool = False  # LM head tied to the embeddings (the embedded policies; Qwen2.5-7B is untied)

    @property
    def intermediate(self) -> int:
        return self.inter or 3 * self.hidden

    @property
    def seq(self) -> int:
        return self.prompt + self.completion

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()

    def label(self) -> str:
        d = "" if self.dtype == "float32" else f" {self.dtype}"
        return (
            f"L{self.layers} H{self.hidden} V{self.vocab} C{self.completion} b{self.rows} n{self.sample}{d}"
        )


def n_params(s: Size) -> int:
    """Trainable parameters of an untied Qwen2 of this shape (q/k/v biases, two norms per layer, final norm)."""
    hd = s.hidden // s.heads
    attn = s.hidden * s.hidden * 2 + 2 * s.hidden * s.kv * hd + s.hidden + 2 * s.kv * hd
    mlp = 3 * s.hidden * s.intermediate
    layer = attn + mlp + 2 * s.hidden
    return s.layers * layer + (1 if s.tied else 2) * s.vocab * s.hidden + s.hidden


def build_model(s: Size):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv,
        max_position_embeddings=s.seq + 8,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, s.dtype))
    model.train()
    n = sum(p.numel() for p in model.parameters())
    if n != n_params(s):
        raise RuntimeError(f"parameter count formula: {n_params(s)} != {n} for {s}")
    return model


def make_batch(s: Size, rows: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, s.vocab, (rows, s.seq), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "completion_mask": torch.ones(rows, s.completion, dtype=torch.bool),
        "advantages": torch.randn(rows, generator=g).sign(),
        "completion_ids": ids[:, -s.completion :],
    }


def _accepted(fn, kwargs: dict) -> dict:
    """The keywords ``fn`` (a callable or a dataclass) accepts: new options only where this version has them."""
    if dataclasses.is_dataclass(fn):
        names = {f.name for f in dataclasses.fields(fn)}
    else:
        names = set(inspect.signature(fn).parameters)
    return {k: v for k, v in kwargs.items() if k in names}


# ---------------------------------------------------------------------------------------------------------------
# what is measured

EPS_LOW, EPS_HIGH, DELTA = 0.2, 0.24, 10.0  # the paper's clipped dapo loss (TokendynGRPOConfig's docstring)


def grpo_step(model, b: dict, c_len: int) -> None:
    """TRL's training micro-step in miniature: the fused LM head's per-token log-probs of the completion, the clipped
    dapo loss (on-policy: pi_old = pi detached), backward into .grad."""
    labels = b["input_ids"].clone()
    labels[:, :-c_len] = -100
    out = model(
        input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=labels, fused_lm_head=True
    )
    logp = out.log_probs[:, -c_len:]
    ratio = torch.exp(logp - logp.detach())
    adv = b["advantages"].to(logp.dtype).unsqueeze(1)
    pg = -torch.minimum(ratio.clamp(max=DELTA) * adv, ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * adv)
    m = b["completion_mask"].to(logp.dtype)
    ((pg * m).sum() / m.sum()).backward()


def _zero(model) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()


def measure_step(model, b: dict, c_len: int) -> int:
    _zero(model)
    with AllocPeak() as p:
        grpo_step(model, b, c_len)
    _zero(model)
    return p.peak


# the probe's defaults (ProbeConfig) except direct_every = 1 is implied: a fresh probe's first step has direct
# gradients (step 0 of every direct_every), which is the step measured
# every direct token replayed (no budget: a budget replays the prefix one step affords), as the memory model's fit
# counts them: the probe's worst replay
PROBE_SETTINGS = {
    "sample_tokens": 128,
    "direct_tokens": 16,
    "direct_chunk": 8,
    "check_tokens": 256,
    "direct_budget": None,
}
DIRECT_MEMORY_MB = 512  # ProbeConfig.direct_memory_mb's default
# the README's 7B recipe: --probe_direct_memory_mb 2048 (one 4,396-token row of a Qwen2.5-7B layer replays in about
# 1.1 GB, over the default cap; the replay runs between the forward and the backward, far below the backward's own
# transient, see probe_increase)
RECIPE_PROBE = {"direct_memory_mb": 2048}


def measure_probe(
    model, b: dict, c_len: int, resume: dict | None = None, **overrides
) -> tuple[int, int, dict]:
    """(peak of one probed training step, peak of the probe's own live allocations in it, the probe's
    `sigma_state` after it); a fresh probe, so its first step computes sigma_max too, unless ``resume`` (a
    `sigma_state`) is loaded first: a probe resumed mid-schedule (n_checks 1 of sigma_every) does not refresh it."""
    from tokendyn.probe.probe import GradientProbe

    try:  # the probe's options are ProbeConfig's fields (GradientProbe takes them as **options)
        from tokendyn.config import ProbeConfig

        kw = _accepted(ProbeConfig, {**PROBE_SETTINGS, **overrides})
    except ImportError:
        kw = _accepted(GradientProbe.__init__, {**PROBE_SETTINGS, **overrides})
    probe = GradientProbe(model, **kw).attach()
    if resume is not None:
        probe.load_sigma_state(resume)
    _zero(model)
    try:
        with AllocPeak(owner=f"tokendyn{os.sep}probe{os.sep}") as p:
            probe.begin_step(
                0,
                completion_mask=b["completion_mask"],
                advantages=b["advantages"],
                completion_ids=b["completion_ids"],
            )
            grpo_step(model, b, c_len)
            probe.end_step()
        state = probe.sigma_state()
    finally:
        probe.detach()
        _zero(model)
    return p.peak, p.peak_owned, state


# the trainer's options (hooks/trainer.py: token_shares=32) and the README's GPU recipe (Lopti on)
ANALYSES = {
    "shares": dict(shares=True, token_shares=0, prob_change=False, influence=False),
    "token_shares": dict(shares=False, token_shares=32, prob_change=False, influence=False),
    "change": dict(shares=False, token_shares=0, prob_change=True, influence=False),
    "sweep": dict(shares=False, token_shares=0, prob_change=True, influence=False, lr_sweep=(1e-2,)),
    "influence": dict(shares=False, token_shares=0, prob_change=False, influence=True),
    "lopti": dict(shares=True, token_shares=0, prob_change=True, influence=True),
    "all": dict(shares=True, token_shares=32, prob_change=True, influence=True),
}
# `all` again with HF gradient checkpointing on (non-reentrant): the analyses' gradient forwards checkpoint the
# decoder layers when model.is_gradient_checkpointing (measured after the other components, on the same model)
CKPT_ANALYSES = {"all_ckpt": "all"}
LOPTI = ("lopti", "all", "all_ckpt")


def _probe_batch(s: Size):
    from tokendyn.probe.tokenloss import ProbeBatch

    b = make_batch(s, s.sample, seed=1)
    batch = ProbeBatch(
        input_ids=b["input_ids"],
        attention_mask=b["attention_mask"],
        completion_mask=b["completion_mask"],
        advantages=b["advantages"],
        temperature=0.7,
    )
    g = torch.Generator().manual_seed(2)
    low = torch.rand(s.sample, s.completion, generator=g) < 0.5
    return batch, (low, ~low)


def measure_analysis(model, s: Size, name: str, extra_options: dict | None = None) -> int:
    from tokendyn.effects.rebalance import RebalanceOptions, analyze_batch
    from tokendyn.probe.tokenloss import Objective

    batch, masks = _probe_batch(s)
    base_name = CKPT_ANALYSES.get(name, name)
    # step_precision "model": the steps the predicted configuration makes (FSDP2's shards step in their own dtype,
    # `tokendyn.effects.change.InPlaceUpdate`); an unsharded run's default float64 steps add a float64 copy of the
    # parameters and float64 activations of the analysis sample (docs/results.md, beside the block)
    options = {"step_precision": "model", **ANALYSES[base_name], **(extra_options or {})}
    opts = RebalanceOptions(**_accepted(RebalanceOptions, options))
    objective = Objective(eps_low=EPS_LOW, eps_high=EPS_HIGH, delta=DELTA, loss_type="dapo")
    lopti = name in LOPTI
    _zero(model)
    with AllocPeak() as p:
        analyze_batch(
            model, batch, step=0, options=opts, objective=objective, stage_masks=masks if lopti else None
        )
        if lopti:  # what the trainer adds: the stage-1 shares at the start of the stage, pi before for the real change
            from tokendyn.effects.change import completion_probs, fix_pi_old
            from tokendyn.effects.rebalance import stage_shares_frame

            fixed, _ = fix_pi_old(model, batch)
            stage_shares_frame(model, fixed, masks[0], step=0, stage="low", objective=objective)
            if base_name == "all":
                pi_before = completion_probs(model, fixed)
                del pi_before
    _zero(model)
    return p.peak


def measure_size(s: Size, components=None, extra_probe: dict | None = None, extra_options=None) -> dict:
    """Peak bytes of every component at one size (probe components as extra over the step)."""
    from trl.trainer.utils import add_fused_lm_head

    torch.set_num_threads(1)
    model = build_model(s)
    add_fused_lm_head(model, temperature=0.7)
    b = make_batch(s, s.rows)
    want = set(components or ["step", "step_ckpt", "probe", *ANALYSES, *CKPT_ANALYSES])
    out: dict[str, int] = {}
    grpo_step(model, b, s.completion)  # warm-up (lazy buffers, first-call allocations)
    step = measure_step(model, b, s.completion)
    out["step"] = step
    # the probe's own live bytes at their peak (an upper bound on what it adds to the step's peak, whenever it
    # allocates), in a step with direct gradients; and what it did add to the step's peak at this size
    # ("_at_peak", not fitted: a difference of maxima)
    if "probe" in want:
        extra = extra_probe or {}
        peak, owned, _ = measure_probe(model, b, s.completion, **extra)
        out["probe"], out["probe_at_peak"] = owned, peak - step
        # its two phases apart: the head checks and the direct gradients (both after the forward, one after the
        # other) never hold memory at the same time, so the probe's peak is the larger of the two
        out["probe_head"] = measure_probe(model, b, s.completion, **{**extra, "direct_tokens": 0})[1]
        out["probe_direct"] = measure_probe(model, b, s.completion, **{**extra, "check_tokens": 0})[1]
        # the head checks' two passes apart: the sigma_max refresh alone (a fresh probe with no check tokens still
        # computes the Gram matrix) and the checks alone (a probe resumed from that one's state mid-schedule)
        _, out["probe_gram"], state = measure_probe(
            model, b, s.completion, **{**extra, "direct_tokens": 0, "check_tokens": 0}
        )
        out["probe_checks"] = measure_probe(
            model, b, s.completion, resume={**state, "n_checks": 1}, **{**extra, "direct_tokens": 0}
        )[1]
    for name in ANALYSES:
        if name in want:
            out[name] = measure_analysis(model, s, name, extra_options)
    ckpt = [n for n in CKPT_ANALYSES if n in want]
    if "step_ckpt" in want or ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if "step_ckpt" in want:
            grpo_step(model, b, s.completion)
            out["step_ckpt"] = measure_step(model, b, s.completion)
        for name in ckpt:
            out[name] = measure_analysis(model, s, name, extra_options)
        model.gradient_checkpointing_disable()
    del model
    gc.collect()
    return out


def gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def mb(x: float) -> str:
    return f"{x / 1e6:,.2f} MB"
