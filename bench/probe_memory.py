"""Peak extra memory of the probe and of each rebalancing analysis, fitted as a memory model and extrapolated to
Qwen2.5-7B on 8 GPUs (issue 11, item 4).

What is measured (CPU, the allocator's own statistics, not RSS): `torch.profiler` with ``profile_memory=True`` has
the CPU allocator report every allocation and free with its running total of allocated bytes; the peak of a region
is the largest running total inside it (counted from 0 at the region's start, so memory that already existed, the
parameters, is not in it). A self-check allocates tensors of known sizes and requires the peak to the byte.

Per size (a random Qwen2 of that shape, float32 or bfloat16, unpadded rows of prompt + completion):
  step          the training step's own peak: TRL's fused-LM-head forward + the GRPO (dapo, clipped) loss + backward,
                gradients allocated (no probe); step_ckpt the same with non-reentrant gradient checkpointing
  probe         in the same step with a `GradientProbe` attached: the peak of the bytes the probe's own code allocated
                and had not freed (allocations under a Python frame of tokendyn/probe/, frees matched by address),
                an upper bound on what it adds to the step's peak, whichever phase it allocates in; the bench also
                prints what it did add at each size (probe_at_peak: the probed step's peak minus the step's, not
                fitted: a difference of maxima does not extrapolate); probe_nodirect with direct_tokens=0
  analyses      peak of `analyze_batch` on the sample sequences, one `RebalanceOptions` switch at a time
                (shares, token_shares, change, sweep, influence), the Lopti stages (influence and shares per stage),
                and `all` (the trainer's options with Lopti, the stage-1 shares and the real change's pi_before)

Each component is fitted by least squares as sum_k c_k f_k with features f_k in bytes read from the code (see
FEATURES), coefficients kept >= 0 (a negative one is dropped and the fit redone): c_k is "how many such buffers".
The fit is checked on held-out sizes, then evaluated for Qwen2.5-7B (28 layers, hidden 3584, intermediate 18944,
28 / 4 heads, vocab 152,064, bf16), 8 x 8 rollouts of 4,096 completion tokens + ~300 prompt tokens, 8 GPUs with
FSDP2, against the training step's own predicted peak per GPU.

Only public entry points are used (`GradientProbe(model, ...)`, `analyze_batch` / `RebalanceOptions`), and keywords
are passed only where the installed version has them, so the bench measures the code before and after the memory
work (the fit says which terms remain).

    python bench/probe_memory.py            # ~5 min on 2 cores
    python bench/probe_memory.py --quick    # ~1 min
    python bench/probe_memory.py --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import os
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

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


PROBE_SETTINGS = {"sample_tokens": 128, "direct_tokens": 16, "direct_chunk": 8, "check_tokens": 256}


def measure_probe(model, b: dict, c_len: int, **overrides) -> tuple[int, int]:
    """(peak of one probed training step, peak of the probe's own live allocations in it); a fresh probe, so its
    first step computes sigma_max too."""
    from tokendyn.probe.probe import GradientProbe

    kw = _accepted(GradientProbe.__init__, {**PROBE_SETTINGS, **overrides})
    probe = GradientProbe(model, **kw).attach()
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
    finally:
        probe.detach()
        _zero(model)
    return p.peak, p.peak_owned


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
LOPTI = ("lopti", "all")


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
    from tokendyn.probe.rebalance import RebalanceOptions, analyze_batch
    from tokendyn.probe.tokenloss import Objective

    batch, masks = _probe_batch(s)
    opts = RebalanceOptions(**_accepted(RebalanceOptions, {**ANALYSES[name], **(extra_options or {})}))
    objective = Objective(eps_low=EPS_LOW, eps_high=EPS_HIGH, delta=DELTA, loss_type="dapo")
    lopti = name in LOPTI
    _zero(model)
    with AllocPeak() as p:
        analyze_batch(
            model, batch, step=0, options=opts, objective=objective, stage_masks=masks if lopti else None
        )
        if lopti:  # what the trainer adds: the stage-1 shares at the start of the stage, pi before for the real change
            from tokendyn.probe.change import completion_probs, fix_pi_old
            from tokendyn.probe.rebalance import stage_shares_frame

            fixed, _ = fix_pi_old(model, batch)
            stage_shares_frame(model, fixed, masks[0], step=0, stage="low", objective=objective)
            if name == "all":
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
    want = set(components or ["step", "step_ckpt", "probe", "probe_nodirect", *ANALYSES])
    out: dict[str, int] = {}
    grpo_step(model, b, s.completion)  # warm-up (lazy buffers, first-call allocations)
    step = measure_step(model, b, s.completion)
    out["step"] = step
    # the probe's own live bytes at their peak (an upper bound on what it adds to the step's peak, whenever it
    # allocates), and what it did add to the step's peak at this size ("_at_peak", not fitted: a difference of maxima)
    if "probe" in want:
        peak, owned = measure_probe(model, b, s.completion, **(extra_probe or {}))
        out["probe"], out["probe_at_peak"] = owned, peak - step
    if "probe_nodirect" in want:
        peak, owned = measure_probe(model, b, s.completion, **{**(extra_probe or {}), "direct_tokens": 0})
        out["probe_nodirect"], out["probe_nodirect_at_peak"] = owned, peak - step
    for name in ANALYSES:
        if name in want:
            out[name] = measure_analysis(model, s, name, extra_options)
    if "step_ckpt" in want:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        grpo_step(model, b, s.completion)
        out["step_ckpt"] = measure_step(model, b, s.completion)
        model.gradient_checkpointing_disable()
    del model
    gc.collect()
    return out


# ---------------------------------------------------------------------------------------------------------------
# the features (bytes), read from the code; `shard` divides parameter-sized state (FSDP2)

K_BINS = 4
TRL_TOKENS, TRL_VOCAB = 4096, 32768  # trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE, trl's vocabulary chunk
CHECK_CHUNK = 64  # tokendyn.probe.direct.head_check_quantities: rows of float64 logits at once


def _direct_slots(s: Size) -> float:
    """Backward passes batched at once by `direct_norms`: min(direct_chunk, most sampled tokens in one row); the 16
    sampled tokens spread over the rows (expected maximum by a quick simulation of a uniform sample)."""
    kd, chunk = PROBE_SETTINGS["direct_tokens"], PROBE_SETTINGS["direct_chunk"]
    g = torch.Generator().manual_seed(0)
    total = s.rows * s.completion
    k = min(kd, total)
    if k == 0:
        return 0.0
    maxes = []
    for _ in range(64):
        idx = torch.randperm(total, generator=g)[:k]
        maxes.append(int(torch.bincount(idx // s.completion, minlength=s.rows).max()))
    return min(chunk, sum(maxes) / len(maxes))


def step_features(s: Size, rows: int, shard: int = 1) -> dict[str, float]:
    t, isz = rows * s.seq, s.itemsize
    n_head = rows * (
        s.seq - 1
    )  # positions the fused head projects (all of them off-GPU, the scored ones on GPU)
    return {
        "act_LTH": s.layers * t * s.hidden * isz,  # per-layer hidden-sized saved tensors
        "act_LTI": s.layers * t * s.intermediate * isz,  # MLP intermediates saved for backward
        "grads_P": n_params(s) * isz / shard,  # .grad
        # trl.kernels.chunked_logprob: a [min(N, 4096), 32768] tile (and its float32 temporaries off-GPU), the
        # float32 gradient of the head and of its input
        "head_tile": min(n_head, TRL_TOKENS) * TRL_VOCAB * 4,
        "head_tmp": min(n_head, TRL_TOKENS) * min(s.vocab, TRL_VOCAB) * 4,
        "head_grad_VH4": s.vocab * s.hidden * 4,
        "head_in_TH4": n_head * s.hidden * 4,
    }


def step_ckpt_features(s: Size, rows: int, shard: int = 1) -> dict[str, float]:
    t, isz = rows * s.seq, s.itemsize
    f = step_features(s, rows, shard)
    for k in ("act_LTH", "act_LTI"):
        del f[k]
    f["in_LTH"] = s.layers * t * s.hidden * isz  # layer inputs kept by checkpointing
    f["layer_TI"] = t * s.intermediate * isz  # one layer recomputed in the backward
    return f


def probe_features(s: Size, rows: int, shard: int = 1, direct: bool = True) -> dict[str, float]:
    t, isz = rows * s.seq, s.itemsize
    kc = min(PROBE_SETTINGS["check_tokens"], rows * s.completion)
    f = {
        "norms_PT4": (s.layers + 1) * t * 4,  # float32 norm of every position at every point
        "head64_VH8": s.vocab * s.hidden * 8,  # float64 copies of the LM head (checks, sigma_max)
        "check_V8": min(CHECK_CHUNK, kc) * s.vocab * 8,  # float64 logits / softmax rows of the checks
        "check_KH8": kc * s.hidden * 8,  # float64 head directions of the checked tokens
    }
    if direct:
        slots = _direct_slots(s)
        f["direct_sPTH"] = slots * (s.layers + 1) * t * s.hidden * isz  # batched grads of every probed tensor
        f["direct_sTI"] = slots * t * s.intermediate * isz  # one layer's batched backward intermediates
    return f


def analysis_features(s: Size, sample: int, shard: int = 1) -> dict[str, float]:
    t, isz, tc = sample * s.seq, s.itemsize, sample * s.completion
    return {
        "params_P": n_params(s) * isz / shard,  # parameter-sized buffers (grads, copies, per-bin grads)
        "bins64_KVH8": K_BINS * s.vocab * s.hidden * 8 / shard,  # per-bin float64 stack of the largest tensor
        "logits_TcV4": tc * s.vocab * 4,  # float32 logits / log-softmax of the completion positions
        "logits_TcV8": tc * s.vocab * 8,  # float64 logits (probability measurements)
        "act_LTH": s.layers * t * s.hidden * isz,
        "act_LTI": s.layers * t * s.intermediate * isz,
        "attn_nhS2": sample * s.heads * s.seq**2 * isz,  # math-SDPA attention of one layer (the JVP)
    }


def features(component: str, s: Size, *, rows=None, sample=None, shard: int = 1) -> dict[str, float]:
    rows = s.rows if rows is None else rows
    sample = s.sample if sample is None else sample
    if component == "step":
        return step_features(s, rows, shard)
    if component == "step_ckpt":
        return step_ckpt_features(s, rows, shard)
    if component == "probe":
        return probe_features(s, rows, shard)
    if component == "probe_nodirect":
        return probe_features(s, rows, shard, direct=False)
    return analysis_features(s, sample, shard)


# ---------------------------------------------------------------------------------------------------------------
# the fit


@dataclass
class Fit:
    component: str
    coef: dict[str, float]  # feature -> buffers (0: dropped)
    intercept: float  # bytes (small fixed allocations)
    train_err: float  # max relative error on the training sizes

    def predict(self, feats: dict[str, float]) -> float:
        return self.intercept + sum(c * feats[k] for k, c in self.coef.items())

    def terms(self, feats: dict[str, float]) -> dict[str, float]:
        return {k: c * feats[k] for k, c in self.coef.items() if c > 0}


def fit_component(component: str, sizes: list[Size], measured: list[dict]) -> Fit:
    """Least squares in the features (columns scaled to unit norm) plus an intercept, with every coefficient >= 0: the
    most negative is dropped and the fit redone until none is (a term the code no longer has goes to 0)."""
    rows = [features(component, s) for s in sizes]
    names = list(rows[0])
    y = torch.tensor([float(m[component]) for m in measured], dtype=torch.float64)
    x_all = torch.tensor([[r[k] for k in names] for r in rows], dtype=torch.float64)
    active = [i for i in range(len(names)) if float(x_all[:, i].abs().max()) > 0]
    while True:
        x = torch.cat([x_all[:, active], torch.ones(len(sizes), 1, dtype=torch.float64)], 1)
        scale = x.norm(dim=0).clamp(min=1e-30)
        sol = torch.linalg.lstsq(x / scale, y.unsqueeze(1), driver="gelsd").solution.squeeze(1) / scale
        coefs = sol[:-1]
        if len(active) == 0 or float(coefs.min()) >= 0:
            break
        del active[int(torch.argmin(coefs))]
    coef = {k: 0.0 for k in names}
    for i, c in zip(active, coefs.tolist(), strict=True):
        coef[names[i]] = c
    intercept = float(sol[-1])
    pred = x_all @ torch.tensor([coef[k] for k in names], dtype=torch.float64) + intercept
    err = float(((pred - y).abs() / y.abs().clamp(min=1.0)).max()) if len(y) else float("nan")
    return Fit(component, coef, intercept, err)


# ---------------------------------------------------------------------------------------------------------------
# the sizes

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

# ---------------------------------------------------------------------------------------------------------------
# Qwen2.5-7B on 8 GPUs with FSDP2 (the README's GPU recipe)

QWEN7B = Size(
    layers=28,
    hidden=3584,
    vocab=152064,
    completion=4096,
    rows=8,  # per_device_train_batch_size
    sample=8,  # probe_sample_sequences
    prompt=300,
    heads=28,
    kv=4,
    inter=18944,
    dtype="bfloat16",
)
GPUS = 8
H200 = 141e9


def persistent_per_gpu(s: Size, gpus: int, ref_model: bool) -> dict[str, float]:
    """What lives through the whole step on one GPU under FSDP2 (dtype of the model, transformers 5 loads Qwen2.5 in
    bf16): parameter shards, AdamW's two moments (same dtype as the parameters), the reference model's shards
    (beta > 0: tokendyn's defaults have beta = 0.001), and two layers gathered whole (the current one and the
    prefetched one)."""
    p, isz = n_params(s), s.itemsize
    layer = (n_params(s) - 2 * s.vocab * s.hidden) / s.layers
    out = {"params": p * isz / gpus, "adamw_m_v": 2 * p * isz / gpus, "gathered_layers": 2 * layer * isz}
    if ref_model:
        out["ref_model"] = p * isz / gpus
    return out


def gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def mb(x: float) -> str:
    return f"{x / 1e6:,.2f} MB"


def predict_7b(fits: dict[str, Fit], analyses_sharded: bool) -> dict:
    s = QWEN7B
    pers = persistent_per_gpu(s, GPUS, ref_model=True)
    out = {"persistent": pers}
    for comp in ("step", "step_ckpt"):
        if comp in fits:
            out[comp] = sum(pers.values()) + fits[comp].predict(features(comp, s, shard=GPUS))
    for comp, fit in fits.items():
        if comp.startswith("step"):
            continue
        shard = GPUS if (analyses_sharded or comp.startswith("probe")) else 1
        out[comp] = fit.predict(features(comp, s, shard=shard))
    return out


# ---------------------------------------------------------------------------------------------------------------


def run(train, held, components=None, log=print, extra_probe=None, extra_options=None) -> dict:
    t0 = time.time()
    meas_train, meas_held = [], []
    for group, sizes, store in (("train", train, meas_train), ("held-out", held, meas_held)):
        for s in sizes:
            t = time.time()
            m = measure_size(s, components, extra_probe, extra_options)
            store.append(m)
            log(f"  [{group}] {s.label():<42} step {mb(m['step']):>12}  ({time.time() - t:.1f} s)")
    comps = [c for c in meas_train[0] if all(c in m for m in meas_train) and not c.endswith("_at_peak")]
    fits = {c: fit_component(c, train, meas_train) for c in comps}
    held_err = {}
    for c in comps:
        errs = []
        for s, m in zip(held, meas_held, strict=True):
            pred = fits[c].predict(features(c, s))
            errs.append((pred, m[c], abs(pred - m[c]) / max(abs(m[c]), 1.0)))
        held_err[c] = errs
    return {
        "fits": fits,
        "held_err": held_err,
        "meas_train": meas_train,
        "meas_held": meas_held,
        "seconds": time.time() - t0,
    }


def report(res: dict, check: dict) -> dict:
    fits, held_err = res["fits"], res["held_err"]
    print()
    print(
        f"allocator self-check: expected {check['expected']} B, allocator's running total {check['allocator']}, "
        f"summed events {check['events']} -> {'exact' if check['ok'] else 'MISMATCH'}"
    )
    print()
    print("fit per component (coefficient = buffers of that feature; 0 = term not present; intercept in MB)")
    worst = 0.0
    for c, fit in fits.items():
        terms = ", ".join(f"{k} {v:.3g}" for k, v in fit.coef.items())
        he = max((e for _, _, e in held_err[c]), default=float("nan"))
        worst = max(worst, he)
        flag = "ok" if he <= 0.15 else "OVER 15%"
        print(f"  {c:<15} {terms}; intercept {mb(fit.intercept)}")
        for pred, meas, e in held_err[c]:
            print(
                f"  {'':<15} held-out: measured {mb(meas)}, predicted {mb(pred)}, error {e:.1%} ({flag}); "
                f"worst training error {fit.train_err:.1%}"
            )
    print(f"worst held-out error: {worst:.1%} (target <= 15%)")

    s = QWEN7B
    print()
    print(
        f"Qwen2.5-7B ({n_params(s) / 1e9:.2f} B parameters, bf16), micro-batch {s.rows} x ({s.prompt} + {s.completion})"
        f" tokens, {GPUS} GPUs with FSDP2; analyses on {s.sample} sample sequences"
    )
    today = predict_7b(fits, analyses_sharded=False)
    item3 = predict_7b(fits, analyses_sharded=True)
    pers = today["persistent"]
    print("  persistent per GPU: " + ", ".join(f"{k} {gb(v)}" for k, v in pers.items()))
    step, step_ck = today.get("step", float("nan")), today.get("step_ckpt", float("nan"))
    print(
        f"  training step's own peak per GPU: {gb(step)} as the README's recipe runs it (no gradient checkpointing;"
        f" {'fits' if step <= H200 else 'does NOT fit'} one H200's 141 GB), {gb(step_ck)} with gradient checkpointing"
    )
    base = step_ck if step > H200 else step
    base_name = "with checkpointing" if step > H200 else "as configured"
    for name in ("step", "step_ckpt"):
        if name in fits:
            feats = features(name, s, shard=GPUS)
            terms = ", ".join(f"{k} {gb(v)}" for k, v in fits[name].terms(feats).items())
            print(f"    {name} terms: {terms}")
    print(f"  extra per GPU (against the step {base_name}, {gb(base)}):")
    print(
        f"    {'component':<15} {'today (rank 0 unsharded)':>26} {'sharded /8 (item 3)':>22}  largest terms"
    )
    for c in fits:
        if c.startswith("step"):
            continue
        shard = GPUS if c.startswith("probe") else 1
        terms = fits[c].terms(features(c, s, shard=shard))
        top = sorted(terms.items(), key=lambda kv: -kv[1])[:3]
        print(
            f"    {c:<15} {gb(today[c]):>15} {today[c] / base:>9.1%} {gb(item3[c]):>12} {item3[c] / base:>8.1%}  "
            + ", ".join(f"{k} {gb(v)}" for k, v in top)
        )
    probe_ratio = today["probe"] / base
    total = today["probe"] + today["all"]
    total3 = item3["probe"] + item3["all"]
    print()
    print(
        f"  probe alone: {probe_ratio:.1%} of the step (target <= 2%): {'PASS' if probe_ratio <= 0.02 else 'FAIL'}"
    )
    print(
        f"  probe + analyses (README settings, Lopti): {gb(total)} = {total / base:.1%} today, "
        f"{gb(total3)} = {total3 / base:.1%} with sharded analyses (target <= 10%): "
        f"{'PASS' if total / base <= 0.10 else 'FAIL'} today"
    )
    fitting = settings_that_fit(fits, base)
    print("  settings that fit the targets (largest first):")
    for line in fitting or ["    none of the tried settings"]:
        print(line)
    block = readme_block(res, today, base, base_name, probe_ratio, total)
    print()
    print("README block (paste between the memory-model markers):")
    print(block)
    return {"today": today, "item3": item3, "probe_ratio": probe_ratio, "total": total, "base": base}


def settings_that_fit(fits: dict[str, Fit], base: float) -> list[str]:
    """Smaller sample sequences / fewer analyses, and the probe without direct gradients, where the targets need it."""
    s = QWEN7B
    lines = []
    probe = fits["probe"].predict(features("probe", s, shard=GPUS))
    probe_nd = fits.get("probe_nodirect")
    probe_nd = probe_nd.predict(features("probe_nodirect", s, shard=GPUS)) if probe_nd else float("nan")
    if probe / base > 0.02 and probe_nd / base <= 0.02:
        lines.append(f"    probe: direct_tokens 0 -> {gb(probe_nd)} ({probe_nd / base:.1%})")
    elif probe / base > 0.02:
        lines.append(
            f"    probe: no setting tried fits (with direct {probe / base:.1%}, without {probe_nd / base:.1%})"
        )
    else:
        lines.append(f"    probe: README settings ({probe / base:.1%})")
    p = min(probe, probe_nd) if probe / base > 0.02 else probe
    for shard, label in ((1, "today"), (GPUS, "sharded analyses")):
        found = None
        for sample in (8, 4, 2, 1):
            for comp in ("all", "lopti", "change", "shares"):
                if comp not in fits:
                    continue
                a = fits[comp].predict(features(comp, s, sample=sample, shard=shard))
                if (p + a) / base <= 0.10:
                    found = (sample, comp, a)
                    break
            if found:
                break
        if found:
            sample, comp, a = found
            lines.append(
                f"    analyses ({label}): probe_sample_sequences {sample}, analyses '{comp}' -> probe + analyses "
                f"{gb(p + a)} ({(p + a) / base:.1%})"
            )
        else:
            lines.append(
                f"    analyses ({label}): none fits (1 sample sequence, change only is still over 10%)"
            )
    return lines


def readme_block(res, today, base, base_name, probe_ratio, total) -> str:
    fits = res["fits"]
    worst = max(e for c in res["held_err"] for _, _, e in res["held_err"][c])
    return "\n".join(
        [
            "<!-- memory-model -->",
            f"Memory model (`python bench/probe_memory.py`; fitted on {len(res['meas_train'])} CPU sizes, worst "
            f"held-out error {worst:.0%}): Qwen2.5-7B, 8 x ({QWEN7B.prompt} + {QWEN7B.completion}) tokens per "
            f"GPU, 8 GPUs with FSDP2: training step {gb(today.get('step', float('nan')))} per GPU as configured, "
            f"{gb(today.get('step_ckpt', float('nan')))} with gradient checkpointing; the probe adds "
            f"{gb(today['probe'])} ({probe_ratio:.1%} of the step {base_name}, target 2%), probe + analyses "
            f"{gb(total)} ({total / base:.1%}, target 10%).",
            "",
            "| component | extra per GPU | of the step |",
            "|---|---|---|",
            *[f"| {c} | {gb(today[c])} | {today[c] / base:.1%} |" for c in fits if not c.startswith("step")],
            "<!-- /memory-model -->",
        ]
    )


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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (~1 min)")
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
    args = ap.parse_args(argv)
    extra_probe, extra_options = _kv(args.probe_kw), _kv(args.options_kw)
    torch.set_num_threads(1)
    check = self_check()
    if not check["ok"]:
        print(f"allocator self-check FAILED: {check}", file=sys.stderr)
    train, held = (QUICK_TRAIN, QUICK_HELD) if args.quick else (TRAIN_SIZES, HELD_OUT)
    print(f"measuring {len(train)} training sizes and {len(held)} held-out size(s) ...")
    res = run(train, held, extra_probe=extra_probe, extra_options=extra_options)
    summary = report(res, check)
    print(f"\nwall time {res['seconds']:.0f} s")
    if args.json:
        payload = {
            "self_check": check,
            "train": [dataclasses.asdict(s) | m for s, m in zip(train, res["meas_train"], strict=True)],
            "held": [dataclasses.asdict(s) | m for s, m in zip(held, res["meas_held"], strict=True)],
            "fits": {c: dataclasses.asdict(f) for c, f in res["fits"].items()},
            "qwen7b": {k: v for k, v in summary["today"].items()},
        }
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=1, default=float)


if __name__ == "__main__":
    main()
