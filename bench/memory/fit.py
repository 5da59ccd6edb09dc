"""Features and the least-squares fit: each component's measured peak as sum_k c_k f_k with features f_k in bytes
read from the code (`features`), coefficients kept >= 0 (a negative one is dropped and the fit redone): c_k is "how
many such buffers" (`fit_component`; the probe as the larger of its two phases, `ProbeFit`, its head checks as the
larger of their two passes, `HeadFit`). `run` measures the sizes and `fit_all` fits them and checks the fit on the
held-out sizes."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .measure import DIRECT_MEMORY_MB, PROBE_SETTINGS, Size, mb, measure_size, n_params

# ---------------------------------------------------------------------------------------------------------------
# the features (bytes), read from the code; `shard` divides parameter-sized state (FSDP2). A feature written
# min(..., cap) is capped where the code caps it (the cap is read from the code, not fitted); the fit gives each
# feature a coefficient ("how many such buffers") at the CPU sizes, where most caps do not bind.

TRL_TOKENS, TRL_VOCAB = 4096, 32768  # trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE, trl's vocabulary chunk


def direct_plan(s: Size, rows: int, settings: dict | None = None) -> tuple[float, float]:
    """(bytes of the replayed rows, bytes of their seed slots) in the largest group of the layer replay, from
    `replay.plan_rows` itself with `replay.replay_bytes`: r x S x (8H + 5W) and r x c x S x (2H + W), x itemsize,
    W = the intermediate size (`replay.layer_width`), averaged over 64 draws of `direct_tokens` sampled completion
    tokens (uniform, as the probe's bottom-k sample) over rows x C."""
    from tokendyn.probe.replay import plan_rows, replay_bytes

    st = {**PROBE_SETTINGS, **(settings or {})}
    k = min(st["direct_tokens"], rows * s.completion)
    if k == 0:
        return 0.0, 0.0
    cap = st.get("direct_memory_mb", DIRECT_MEMORY_MB)
    cap = None if cap is None else cap * 2**20
    row_b, slot_b = replay_bytes(s.seq, s.hidden, max(s.hidden, s.intermediate), s.itemsize)
    g = torch.Generator().manual_seed(0)
    held_rows = held_slots = 0.0
    for _ in range(64):
        idx = torch.randperm(rows * s.completion, generator=g)[:k]
        per_row = torch.bincount(idx // s.completion, minlength=rows).tolist()
        best = max(
            plan_rows(per_row, row_b, slot_b, st["direct_chunk"], cap),
            key=lambda gc: len(gc[0]) * (row_b + gc[1] * slot_b),
        )
        held_rows += len(best[0]) * row_b / 64
        held_slots += len(best[0]) * best[1] * slot_b / 64
    return held_rows, held_slots


def step_features(s: Size, rows: int, shard: int = 1) -> dict[str, float]:
    t, isz = rows * s.seq, s.itemsize
    n_head = rows * (s.seq - 1)  # positions the fused head projects
    return {
        "act_LTH": s.layers * t * s.hidden * isz,  # per-layer hidden-sized saved tensors
        "act_LTI": s.layers * t * s.intermediate * isz,  # MLP intermediates saved for backward
        "grads_P": n_params(s) * isz / shard,  # .grad
        # trl.kernels.chunked_logprob: a [min(N, 4096), 32768] tile (and its float32 temporaries off-GPU)
        "head_tile": min(n_head, TRL_TOKENS) * TRL_VOCAB * 4,
        "head_tmp": min(n_head, TRL_TOKENS) * min(s.vocab, TRL_VOCAB) * 4,
    }


def step_ckpt_features(s: Size, rows: int, shard: int = 1) -> dict[str, float]:
    t, isz = rows * s.seq, s.itemsize
    f = step_features(s, rows, shard)
    for k in ("act_LTH", "act_LTI"):
        del f[k]
    f["in_LTH"] = s.layers * t * s.hidden * isz  # layer inputs kept by checkpointing
    f["layer_TI"] = t * s.intermediate * isz  # one layer recomputed in the backward
    return f


def check_tokens_at(s: Size, rows: int, settings: dict | None = None) -> int:
    """K: the tokens checked exactly at the LM head on a probed micro-batch, as `GradientProbe._prepare` cuts them:
    `budget.check_tokens_within` of check_tokens, from a sample of max(sample_tokens, direct_tokens, check_tokens)
    tokens, within check_budget (ProbeConfig's default 0.02) of the step's flops 6 P N (P without the input
    embedding's table; the vocabulary at its global size under FSDP2). At the CPU sizes the budget allows the floor,
    32 tokens; at 7B the whole 256."""
    from tokendyn.config import ProbeConfig
    from tokendyn.probe import budget

    st = {**PROBE_SETTINGS, **(settings or {})}
    n_check = st["check_tokens"]
    avail = min(max(st["sample_tokens"], st["direct_tokens"], n_check), rows * s.completion)
    flop_params = n_params(s) - (0 if s.tied else s.vocab * s.hidden)
    check_budget = st.get("check_budget", ProbeConfig().check_budget)
    return budget.check_tokens_within(
        n_check, avail, flop_params, rows * s.seq, s.hidden, s.vocab, check_budget
    )


def live_rows(vocab: int, rows: int) -> int:
    """Rows of W held in float64 at once by a pass over `vocab` rows, `rows` at a time (`HeadShard.chunks`): the
    chunk worked on and, while the next one is made, the previous one (the loop variable still holds it):
    rows + min(rows, vocab - rows); all of them when one chunk holds the whole head (every CPU size)."""
    return vocab if vocab <= rows else rows + min(rows, vocab - rows)


def eigh_bytes(h: int) -> int:
    """`torch.linalg.eigh` of the H x H float64 Gram (`head.sigma_max_gram`) while the Gram lives: the Gram, the
    eigenvectors' copy, the eigenvalues, LAPACK dsyevd's workspace (1 + 6H + 2H^2 doubles, 3 + 5H int32), as the CPU
    build allocates them (measured: 4.0-4.2 x H^2 x 8 at H = 64..512)."""
    return 8 * (2 * h * h + h + 1 + 6 * h + 2 * h * h) + 4 * (3 + 5 * h)


def probe_features(
    s: Size, rows: int, shard: int = 1, direct: bool = True, settings: dict | None = None
) -> dict[str, float]:
    """The probe inside the training step (a step with direct gradients when ``direct``). The head checks run two
    passes over the head, one after the other (`GradientProbe._prepare`): the checks' pass (`head.head_partial` on
    K tokens, chunks of `head.vocab_chunk_rows(K, H)` rows, each with its float64 [K, rows] product z) and, on a
    sigma_max refresh (the first probed step, then every sigma_every-th check), the Gram matrix
    (`head.sigma_max_gram`: H x H float64 accumulated over chunks of HEAD_CHUNK_BYTES / (8 H) rows, then eigh).
    A 16-bit head that is not sharded adds, in the backward, two float64 passes that round as the head does
    (`rounding.rounded_head_gradient`: per chunk W and its rounded copy, several [K, rows] buffers)."""
    from tokendyn.probe.head import HEAD_CHUNK_BYTES, vocab_chunk_rows

    t = rows * s.seq
    kc = check_tokens_at(s, rows, settings)
    v_local = math.ceil(s.vocab / shard)  # FSDP2: this rank's vocabulary rows
    h8 = s.hidden * 8
    gram_rows = max(1, HEAD_CHUNK_BYTES // h8)
    check_rows = live_rows(v_local, vocab_chunk_rows(kc, s.hidden)) if kc else 0
    # `GradientProbe._prepare`: the rounded prediction only for a 16-bit head that is not vocabulary-sharded
    rounded = s.itemsize == 2 and shard == 1 and kc > 0
    rounded_rows = check_rows if rounded else 0  # chunks of the same rows
    f = {
        "norms_PT4": (s.layers + 1) * t * 4,  # float32 norm of every position at every point
        "check_KH8": kc * h8,  # float64 [K, H] buffers of the checks (h, acc, W_o, u, ...)
        # the checks' pass: the live float64 chunks of W with their [K, rows] products
        "check_chunks": check_rows * (s.hidden + kc) * 8,
        # a 16-bit unsharded head's rounded prediction (in the backward): its live rows of W, and of the [K, rows]
        "rounded_WH8": rounded_rows * h8,
        "rounded_KW8": rounded_rows * kc * 8,
        # the sigma_max refresh: the Gram and its live chunks while it accumulates, or eigh's working set
        "gram_peak": max(s.hidden * h8 + live_rows(v_local, gram_rows) * h8, eigh_bytes(s.hidden)),
        "replay_rows": 0.0,
        "replay_slots": 0.0,
    }
    if direct:  # the layer replay's largest group (`replay.plan_rows`, under direct_memory_mb)
        f["replay_rows"], f["replay_slots"] = direct_plan(s, rows, settings)
    return f


# the head checks' two passes, each measured alone (bench/memory/measure.py): the checks without a refresh, the
# refresh without checks; the head checks' phase (direct_tokens=0) is the larger of the two (`HeadFit`)
PROBE_CHECKS = ("norms_PT4", "check_KH8", "check_chunks", "rounded_WH8", "rounded_KW8")
PROBE_GRAM = ("norms_PT4", "gram_peak")
PROBE_HEAD = (*PROBE_CHECKS, "gram_peak")
PROBE_DIRECT = ("norms_PT4", "replay_rows", "replay_slots")  # the direct gradients' phase (check_tokens=0)


# components whose updates are undone from a host snapshot of the trainable parameters (P x itemsize): on CPU the
# allocator sees it, on a GPU it is host memory. Its coefficient is derived (1), not fitted: it is subtracted from
# these measurements before the fit and left out of the GPU prediction.
SNAPSHOT = ("change", "sweep", "influence", "lopti", "all", "all_ckpt")


def snapshot_bytes(component: str, s: Size) -> float:
    return float(n_params(s) * s.itemsize) if component in SNAPSHOT else 0.0


def analysis_features(
    s: Size, sample: int, shard: int = 1, ckpt: bool = False, fsdp: bool = False
) -> dict[str, float]:
    """The analyses' own transient (between steps). ``fsdp``: the 7B case, where the per-token shares' JVP is
    skipped (no eager-attention term) and the analysis forward calls the whole model (`fsdp_logits`, derived)."""
    from tokendyn.probe.tokenloss import chunk_tokens

    t, isz, tc = sample * s.seq, s.itemsize, sample * s.completion
    f = {
        "params_P": n_params(s) * isz / shard,  # streamed gradients: g and one g_b (parameter-sized)
        # one token chunk of the completion's logits: float32 + float64, recomputed in the backward
        "logits_chunk": min(tc, chunk_tokens(s.vocab)) * s.vocab * (4 + 8),
        "attn_nhS2": 0.0 if fsdp else sample * s.heads * s.seq**2 * isz,  # eager attention of the shares' JVP
    }
    if (
        ckpt
    ):  # decoder layers checkpointed (HF gradient checkpointing on): layer inputs + one layer recomputed
        f["in_LTH"] = s.layers * t * s.hidden * isz
        f["layer_TI"] = t * s.intermediate * isz
    else:
        f["act_LTH"] = s.layers * t * s.hidden * isz
        f["act_LTI"] = s.layers * t * s.intermediate * isz
    return f


FSDP_LOGITS_COEF = 2  # derived: the whole model's [B, C + 1, V] logits (model dtype) and their gradient


def fsdp_logits(s: Size, sample: int) -> float:
    return FSDP_LOGITS_COEF * sample * (s.completion + 1) * s.vocab * s.itemsize


def features(component: str, s: Size, *, rows=None, sample=None, shard: int = 1, **kw) -> dict[str, float]:
    rows = s.rows if rows is None else rows
    sample = s.sample if sample is None else sample
    if component == "step":
        return step_features(s, rows, shard)
    if component == "step_ckpt":
        return step_ckpt_features(s, rows, shard)
    if component.startswith("probe"):
        f = probe_features(s, rows, shard, direct=kw.get("direct", True), settings=kw.get("settings"))
        keep = {
            "probe_head": PROBE_HEAD,
            "probe_checks": PROBE_CHECKS,
            "probe_gram": PROBE_GRAM,
            "probe_direct": PROBE_DIRECT,
        }.get(component, tuple(f))
        return {k: f[k] for k in keep}
    return analysis_features(s, sample, shard, ckpt=component.endswith("_ckpt"), fsdp=kw.get("fsdp", False))


def fitted_value(component: str, s: Size, m: dict) -> float:
    """What the fit is asked to explain: the measurement less the derived host snapshot."""
    return float(m[component]) - snapshot_bytes(component, s)


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


U_KH8 = 1.0  # derived: the checks' u [K, H] float64 (`HeadQuantities.direction`) is live during the refresh


@dataclass
class HeadFit:
    """The head checks' phase: the larger of its two passes, each fitted on its own measurement (probe_checks: the
    checks without a sigma_max refresh; probe_gram: the refresh without checks), the refresh with the checks'
    result u (U_KH8 x check_KH8, derived) beside it; checked against probe_head (a fresh probe: both passes)."""

    checks: Fit
    gram: Fit
    component: str = "probe_head"
    train_err: float = float("nan")

    @property
    def coef(self) -> dict[str, float]:
        return {
            **{f"checks.{k}": v for k, v in self.checks.coef.items()},
            **{f"gram.{k}": v for k, v in self.gram.coef.items()},
        }

    @property
    def intercept(self) -> float:
        return max(self.checks.intercept, self.gram.intercept)

    def _parts(self, feats: dict[str, float]) -> tuple[float, float]:
        c = self.checks.predict({k: feats[k] for k in PROBE_CHECKS})
        g = self.gram.predict({k: feats[k] for k in PROBE_GRAM}) + U_KH8 * feats["check_KH8"]
        return c, g

    def predict(self, feats: dict[str, float]) -> float:
        return max(self._parts(feats))

    def terms(self, feats: dict[str, float]) -> dict[str, float]:
        c, g = self._parts(feats)
        if c >= g:
            return self.checks.terms({k: feats[k] for k in PROBE_CHECKS})
        return self.gram.terms({k: feats[k] for k in PROBE_GRAM}) | {"check_KH8": U_KH8 * feats["check_KH8"]}


@dataclass
class ProbeFit:
    """The probe in a step: the larger of its two phases, the head checks (`HeadFit`, probe_head) and the direct
    gradients (fitted on probe_direct); checked against the probe measured with both on."""

    head: HeadFit
    direct: Fit
    component: str = "probe"
    train_err: float = float("nan")

    @property
    def coef(self) -> dict[str, float]:
        return {
            **{f"head.{k}": v for k, v in self.head.coef.items()},
            **{f"direct.{k}": v for k, v in self.direct.coef.items()},
        }

    @property
    def intercept(self) -> float:
        return max(self.head.intercept, self.direct.intercept)

    def _parts(self, feats: dict[str, float]) -> tuple[float, float]:
        h = self.head.predict({k: feats[k] for k in PROBE_HEAD})
        d = self.direct.predict({k: feats[k] for k in PROBE_DIRECT})
        return h, d

    def predict(self, feats: dict[str, float]) -> float:
        return max(self._parts(feats))

    def terms(self, feats: dict[str, float]) -> dict[str, float]:
        h, d = self._parts(feats)
        fit, keys = (self.head, PROBE_HEAD) if h >= d else (self.direct, PROBE_DIRECT)
        return fit.terms({k: feats[k] for k in keys})


def _max_rel_err(fit, component: str, sizes: list[Size], measured: list[dict]) -> float:
    errs = [
        abs(fit.predict(features(component, s)) - m[component]) / max(m[component], 1.0)
        for s, m in zip(sizes, measured, strict=True)
    ]
    return max(errs) if errs else float("nan")


def fit_head(sizes: list[Size], measured: list[dict]) -> HeadFit:
    hf = HeadFit(fit_component("probe_checks", sizes, measured), fit_component("probe_gram", sizes, measured))
    hf.train_err = _max_rel_err(hf, "probe_head", sizes, measured)
    return hf


def fit_probe(sizes: list[Size], measured: list[dict]) -> ProbeFit:
    pf = ProbeFit(fit_head(sizes, measured), fit_component("probe_direct", sizes, measured))
    pf.train_err = _max_rel_err(pf, "probe", sizes, measured)
    return pf


# coefficients derived from the code, not fitted (subtracted before the fit): non-reentrant checkpointing keeps one
# hidden-sized input per decoder layer
FIXED = {"step_ckpt": {"in_LTH": 1.0}, "all_ckpt": {"in_LTH": 1.0}}


def fit_component(component: str, sizes: list[Size], measured: list[dict]) -> Fit:
    """Least squares of the relative error in the features (columns scaled to unit norm) plus an intercept, with
    every coefficient >= 0: the most negative is dropped and the fit redone until none is (a term the code no longer
    has goes to 0). Coefficients in FIXED are derived from the code and not fitted."""
    rows = [features(component, s) for s in sizes]
    names = list(rows[0])
    y = torch.tensor(
        [fitted_value(component, s, m) for s, m in zip(sizes, measured, strict=True)], dtype=torch.float64
    )
    x_all = torch.tensor([[r[k] for k in names] for r in rows], dtype=torch.float64)
    fixed = FIXED.get(component, {})
    y_free = y - sum((c * x_all[:, names.index(k)] for k, c in fixed.items()), torch.zeros_like(y))
    active = [i for i in range(len(names)) if float(x_all[:, i].abs().max()) > 0 and names[i] not in fixed]
    w = 1.0 / y.abs().clamp(min=1.0)  # relative errors: each size weighs the same
    while True:
        x = torch.cat([x_all[:, active], torch.ones(len(sizes), 1, dtype=torch.float64)], 1) * w.unsqueeze(1)
        scale = x.norm(dim=0).clamp(min=1e-30)
        sol = torch.linalg.lstsq(x / scale, (y_free * w).unsqueeze(1), driver="gelsd").solution.squeeze(1)
        sol = sol / scale
        coefs = sol[:-1]
        if len(active) == 0 or float(coefs.min()) >= 0:
            break
        del active[int(torch.argmin(coefs))]
    coef = {k: 0.0 for k in names}
    for i, c in zip(active, coefs.tolist(), strict=True):
        coef[names[i]] = c
    coef.update(fixed)
    intercept = float(sol[-1])
    pred = x_all @ torch.tensor([coef[k] for k in names], dtype=torch.float64) + intercept
    err = float(((pred - y).abs() / y.abs().clamp(min=1.0)).max()) if len(y) else float("nan")
    return Fit(component, coef, intercept, err)


# ---------------------------------------------------------------------------------------------------------------
# measure the sizes, fit them, check the fit on the held-out ones


def run(train, held, components=None, log=print, extra_probe=None, extra_options=None) -> dict:
    t0 = time.time()
    meas_train, meas_held = [], []
    for group, sizes, store in (("train", train, meas_train), ("held-out", held, meas_held)):
        for s in sizes:
            t = time.time()
            m = measure_size(s, components, extra_probe, extra_options)
            store.append(m)
            log(f"  [{group}] {s.label():<42} step {mb(m['step']):>12}  ({time.time() - t:.1f} s)")
    return fit_all(train, held, meas_train, meas_held) | {"seconds": time.time() - t0}


def fit_all(train, held, meas_train, meas_held) -> dict:
    comps = [c for c in meas_train[0] if all(c in m for m in meas_train) and not c.endswith("_at_peak")]

    def fit(c: str):
        if c == "probe":
            return fit_probe(train, meas_train)
        if c == "probe_head":  # the larger of its two passes, each fitted on its own measurement
            return fit_head(train, meas_train)
        return fit_component(c, train, meas_train)

    fits = {c: fit(c) for c in comps}
    held_err = {}
    for c in comps:
        errs = []
        for s, m in zip(held, meas_held, strict=True):
            pred = fits[c].predict(features(c, s)) + snapshot_bytes(c, s)
            errs.append((pred, m[c], abs(pred - m[c]) / max(abs(m[c]), 1.0)))
        held_err[c] = errs
    # do the analyses checkpoint their layers when gradient checkpointing is on? all_ckpt never above `all`, and
    # well below it where layer activations, not a vocabulary chunk, make the peak
    ckpt_active = (
        "all_ckpt" in comps
        and all(m["all_ckpt"] <= 1.001 * m["all"] for m in meas_train)
        and any(m["all_ckpt"] < 0.9 * m["all"] for m in meas_train)
    )
    return {
        "fits": fits,
        "held_err": held_err,
        "meas_train": meas_train,
        "meas_held": meas_held,
        "held_sizes": list(held),
        "ckpt_active": ckpt_active,
    }


def load_fits(payload: dict) -> dict:
    """The fits of a --json file (a probe fit is its two phases, its head phase the head checks' two passes)."""

    def head(f: dict) -> HeadFit:
        return HeadFit(Fit(**f["checks"]), Fit(**f["gram"]), train_err=f["train_err"])

    out = {}
    for c, f in payload["fits"].items():
        if "direct" in f:
            out[c] = ProbeFit(head(f["head"]), Fit(**f["direct"]), train_err=f["train_err"])
        elif "checks" in f:
            out[c] = head(f)
        else:
            out[c] = Fit(**f)
    return out
