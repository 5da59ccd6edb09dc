"""Features and the least-squares fit: each component's measured peak as sum_k c_k f_k with features f_k in bytes
read from the code (`features`), coefficients kept >= 0 (a negative one is dropped and the fit redone): c_k is "how
many such buffers" (`fit_component`; the probe as the larger of its two phases, `ProbeFit`). `run` measures the
sizes and `fit_all` fits them and checks the fit on the held-out sizes."""

from __future__ import annotations

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


def probe_features(
    s: Size, rows: int, shard: int = 1, direct: bool = True, settings: dict | None = None
) -> dict[str, float]:
    """The probe inside the training step (a step with direct gradients when ``direct``)."""
    from tokendyn.probe.head import HEAD_CHUNK_BYTES

    t = rows * s.seq
    kc = min(PROBE_SETTINGS["check_tokens"], rows * s.completion)
    f = {
        "norms_PT4": (s.layers + 1) * t * 4,  # float32 norm of every position at every point
        "check_KH8": kc * s.hidden * 8,  # float64 [K, H] buffers of the head checks (three)
        # one vocabulary chunk of the head checks / power iteration: rows x (H + 6K) float64 within the budget
        "head_chunk": min(s.vocab / shard * (s.hidden + 6 * kc) * 8, HEAD_CHUNK_BYTES),
        "replay_rows": 0.0,
        "replay_slots": 0.0,
    }
    if direct:  # the layer replay's largest group (`replay.plan_rows`, under direct_memory_mb)
        f["replay_rows"], f["replay_slots"] = direct_plan(s, rows, settings)
    return f


PROBE_HEAD = ("norms_PT4", "check_KH8", "head_chunk")  # the head checks' phase (direct_tokens=0)
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
        keep = {"probe_head": PROBE_HEAD, "probe_direct": PROBE_DIRECT}.get(component, tuple(f))
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


@dataclass
class ProbeFit:
    """The probe in a step: the larger of its two phases, each fitted on its own measurement (probe_head,
    probe_direct); checked against the probe measured with both on."""

    head: Fit
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


def fit_probe(sizes: list[Size], measured: list[dict]) -> ProbeFit:
    pf = ProbeFit(
        fit_component("probe_head", sizes, measured), fit_component("probe_direct", sizes, measured)
    )
    errs = [
        abs(pf.predict(features("probe", s)) - m["probe"]) / max(m["probe"], 1.0)
        for s, m in zip(sizes, measured, strict=True)
    ]
    pf.train_err = max(errs)
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
    fits = {
        c: fit_probe(train, meas_train) if c == "probe" else fit_component(c, train, meas_train)
        for c in comps
    }
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
    """The fits of a --json file (a probe fit is its two phases)."""
    out = {}
    for c, f in payload["fits"].items():
        if "head" in f:
            out[c] = ProbeFit(Fit(**f["head"]), Fit(**f["direct"]), train_err=f["train_err"])
        else:
            out[c] = Fit(**f)
    return out
