"""Reduce one probed micro-batch into records (plain columns: kind -> column -> list).

Kinds: `binstats` (per point, bin, quantity), `hist` (non-empty log cells), `bound` (per point: envelope and rank
correlation, total and direct), `checks` (the exact LM-head / logits checks), `tokens` (the bounded token sample).
The column sets are the schemas in `tokendyn.records`.
"""

from __future__ import annotations

import math

import torch

from tokendyn.probe import bound as B
from tokendyn.probe.bins import assign_bins
from tokendyn.probe.stats import QUANTITIES, BinStats
from tokendyn.probe.step_data import Columns, HeadCheckData, StepData, StepResult

# what a step hands in and gets back (`tokendyn.probe.step_data`), re-exported
__all__ = ["HeadCheckData", "StepData", "StepResult"]


def _key(d: StepData, n: int) -> Columns:
    return {"step": [d.step] * n, "stage": [d.stage] * n, "rank": [d.rank] * n, "micro": [d.micro] * n}


def _nan_to_none(values: list[float]) -> list[float | None]:
    """NaN -> None (None and every other value kept): ``v != v`` holds for NaN only (None != None is False)."""
    return [None if v != v else v for v in values]


def _binstats_and_hist(d: StepData, stats: BinStats, edges: list[float]) -> tuple[Columns, Columns]:
    n_bins = stats.n_bins
    bs: Columns = {
        k: []
        for k in (
            "point",
            "point_index",
            "bin",
            "bin_lo",
            "bin_hi",
            "quantity",
            "count",
            "sum",
            "sumsq",
            "min",
            "max",
            "nonfinite",
        )
    }
    hs: Columns = {k: [] for k in ("point", "bin", "quantity", "cell", "lo", "hi", "count")}
    for q in QUANTITIES:
        s = stats.summary(q)
        for pi_, name in enumerate(d.points):
            bs["point"].extend([name] * n_bins)
            bs["point_index"].extend([pi_] * n_bins)
            bs["bin"].extend(range(n_bins))
            bs["bin_lo"].extend(edges[:-1])
            bs["bin_hi"].extend(edges[1:])
            bs["quantity"].extend([q] * n_bins)
            bs["count"].extend(int(x) for x in s["count"][pi_].tolist())
            for col in ("sum", "sumsq", "min", "max"):
                bs[col].extend(s[col][pi_].tolist())
            bs["nonfinite"].extend(int(x) for x in s["nonfinite"][pi_].tolist())
        nz = torch.nonzero(s["hist"])
        counts = s["hist"][nz[:, 0], nz[:, 1], nz[:, 2]].tolist()
        for (pi_, b, cell), cnt in zip(nz.tolist(), counts, strict=True):
            lo, hi = stats.hist.bounds(cell)
            hs["point"].append(d.points[pi_])
            hs["bin"].append(b)
            hs["quantity"].append(q)
            hs["cell"].append(cell)
            hs["lo"].append(lo)
            hs["hi"].append(hi)
            hs["count"].append(int(cnt))
    for col in ("min", "max"):
        bs[col] = _nan_to_none(bs[col])
    return {**_key(d, len(bs["point"])), **bs}, {**_key(d, len(hs["point"])), **hs}


def _envelope(ratio: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[int, float, float, float]:
    """(n, min, max, spearman(x, y)) over the finite entries of ratio."""
    ok = torch.isfinite(ratio) & torch.isfinite(x)
    n = int(ok.sum())
    if n == 0:
        return 0, math.nan, math.nan, math.nan
    r = ratio[ok]
    return n, float(r.min()), float(r.max()), B.spearman(x[ok], y[ok])


def reduce_step(d: StepData) -> StepResult:
    valid = d.valid.bool()
    logp = d.logp.detach().to(torch.float64)
    pi = torch.exp(logp)
    pi_old = pi if d.pi_old is None else d.pi_old.to(torch.float64)
    edges_t = d.bins.edges_for(pi_old, valid, d.reduce_fn)
    edges = edges_t.tolist()
    n_bins = len(edges) - 1
    bins = assign_bins(pi_old, edges_t).clamp(max=n_bins - 1)
    w = d.w.detach().to(torch.float64)
    absw = w.abs()
    omp = B.one_minus_pi(logp)
    n_pts = len(d.points)
    flat_bins = bins.reshape(-1)
    norms = d.norms.reshape(n_pts, -1).to(torch.float64)
    vflat = valid.reshape(-1)
    wflat, ompflat = absw.reshape(-1), omp.reshape(-1)
    ratio = B.bound_ratio(norms, wflat.unsqueeze(0), ompflat.unsqueeze(0))
    npw = torch.where(wflat > 0, norms / wflat, torch.full_like(norms, math.nan))

    stats = BinStats(n_pts, n_bins, device=norms.device, hist=d.hist)
    stats.update("norm", norms, flat_bins, vflat)
    stats.update("norm_per_w", npw, flat_bins, vflat & (wflat > 0))
    stats.update("ratio", ratio, flat_bins, vflat & (wflat * ompflat > 0))
    binstats, hist = _binstats_and_hist(d, stats, edges)

    # bound: per point envelope of the ratio and spearman(||delta||/|w|, 1 - pi), total and direct
    keep = vflat & (wflat > 0)
    sel = d.sample_idx
    sel_ok = d.sample_valid
    bd: Columns = {
        k: []
        for k in (
            "point",
            "point_index",
            "n",
            "ratio_min",
            "ratio_max",
            "spearman",
            "nonfinite",
            "unreached",
            "direct_n",
            "direct_ratio_min",
            "direct_ratio_max",
            "direct_spearman",
        )
    }
    direct_ratio = None
    if d.direct is not None:
        kd = d.direct.shape[1]
        omp_d = ompflat[sel[:kd]]
        direct_ratio = d.direct.to(torch.float64) / omp_d.unsqueeze(0)
        direct_ratio = torch.where(
            sel_ok[:kd] & (omp_d > 0), direct_ratio, torch.full_like(direct_ratio, math.nan)
        )
    for j, name in enumerate(d.points):
        n, lo, hi, rho = _envelope(
            torch.where(keep, ratio[j], torch.full_like(ratio[j], math.nan)), npw[j], ompflat
        )
        bd["point"].append(name)
        bd["point_index"].append(j)
        bd["n"].append(n)
        bd["ratio_min"].append(lo)
        bd["ratio_max"].append(hi)
        bd["spearman"].append(rho)
        bd["nonfinite"].append(int((vflat & ~torch.isfinite(norms[j])).sum()))
        bd["unreached"].append(0 if d.reached is None or d.reached[j] else int(vflat.sum()))
        if direct_ratio is not None:
            dn, dlo, dhi, drho = _envelope(direct_ratio[j], d.direct[j].to(torch.float64), omp_d)
        else:
            dn, dlo, dhi, drho = 0, math.nan, math.nan, math.nan
        bd["direct_n"].append(dn)
        bd["direct_ratio_min"].append(dlo)
        bd["direct_ratio_max"].append(dhi)
        bd["direct_spearman"].append(drho)
    for col in (
        "ratio_min",
        "ratio_max",
        "spearman",
        "direct_ratio_min",
        "direct_ratio_max",
        "direct_spearman",
    ):
        bd[col] = _nan_to_none(bd[col])
    bound_cols = {**_key(d, n_pts), **bd}

    records = {"binstats": binstats, "hist": hist, "bound": bound_cols}
    checks, per_token_check = _checks(d, ratio, keep, wflat, ompflat)
    if checks is not None:
        records["checks"] = checks
    records["tokens"] = _tokens(d, pi, pi_old, w, bins, norms, ratio, direct_ratio, per_token_check)
    return StepResult(records, edges, bins, d.norms, w, pi, pi_old)


def check_tolerances(
    grad_dtype: torch.dtype, head_dtype: torch.dtype, rounded: bool
) -> tuple[float, float, float]:
    """(tol, tol_rel, tol_bound) from the arithmetic that ran. The identity is violated where
    ||delta - pred|| > tol |w| sigma_max / T + tol_rel ||pred||; the head bound where the ratio exceeds it by a
    factor 1 + tol_bound.

    A head computing in float32 or wider: tol = max(1e-4, 8 eps(grad dtype)) on the scale |w| sigma_max / T (float32
    cancellation in e_o - pi, which the plain relative error magnifies by 1 / (1 - pi)), tol_rel = 0, tol_bound = tol.
    A 16-bit head (autocast, or 16-bit weights): its rounding is in the prediction (`rounding.py`) and what is left
    is the rounding of delta itself: tol_rel = eps(head dtype) (tol stays the float32 softmax's); where the
    prediction could not be rounded (a vocabulary-sharded head), tol_rel = 8 eps(head dtype), since the forward's
    rounded logits move pi by about 2 eps. The bound, an inequality on exact arithmetic, allows the same 8 eps."""
    eps = torch.finfo(grad_dtype).eps if grad_dtype.is_floating_point else 1e-7
    tol = max(1e-4, 8 * eps) if head_dtype not in (torch.bfloat16, torch.float16) else 1e-4
    if head_dtype not in (torch.bfloat16, torch.float16):
        return tol, 0.0, tol
    eps_head = torch.finfo(head_dtype).eps
    return tol, eps_head if rounded else 8 * eps_head, max(tol, 8 * eps_head)


def _checks(d: StepData, ratio, keep, wflat, ompflat):
    """The exact checks: LM-head identity, logits-level bound, provable bound at the LM-head input."""
    c = d.check
    if c is None or d.final_index is None or d.completion_ids is None:
        return None, None
    kc = c.direction.shape[0]
    idx, ok = d.sample_idx[:kc], d.sample_valid[:kc]
    w_sel = d.w.detach().reshape(-1)[idx].to(torch.float64)
    vocab = c.vocab_size
    lo_b, hi_b = B.logits_bound_constants(vocab)
    lr = c.logits_ratio
    lr_ok = ok & torch.isfinite(lr)
    viol_logits = int((lr_ok & ((lr < lo_b * (1 - 1e-9)) | (lr > hi_b * (1 + 1e-9)))).sum())
    ident = torch.full((kc,), math.nan, dtype=torch.float64, device=lr.device)
    scaled = ident.clone()
    tol, tol_rel, tol_bound = check_tolerances(c.grad_dtype, c.head_dtype, rounded=c.rounded is not None)
    viol = torch.zeros(kc, dtype=torch.bool, device=lr.device)
    entropy_part = None  # e v: an entropy bonus's gradient at the LM-head input (`head_entropy`)
    if c.entropy_direction is not None and c.entropy_weight is not None:
        entropy_part = c.entropy_direction * c.entropy_weight.to(lr.device).unsqueeze(-1)
    if c.delta is not None:
        pred = c.direction * w_sel.unsqueeze(-1) if c.rounded is None else c.rounded.to(lr.device)
        if entropy_part is not None and c.rounded is None:
            pred = pred + entropy_part
        ident = torch.where(ok, B.relative_error(c.delta, pred), ident)
        # the same error on the scale |w| sigma_max / T of a token far from pi = 1: float32 cancellation in
        # (e_o - pi) makes the plain relative error grow like eps / (1 - pi) as pi -> 1, this one does not
        scale = w_sel.abs() * c.sigma_max / d.temperature
        diff = torch.linalg.vector_norm(c.delta.to(torch.float64) - pred, dim=-1)
        scaled = torch.where(ok & (scale > 0), diff / scale, scaled)
        # violated beyond both: tol on that scale, tol_rel of the prediction (a 16-bit head's own rounding)
        limit = tol * scale + tol_rel * torch.linalg.vector_norm(pred, dim=-1)
        viol = ok & (scale > 0) & (diff > limit)
    ident_logits = math.nan
    if c.logits_identity_err is not None:
        err = c.logits_identity_err.to(ok.device)
        err = err[ok & torch.isfinite(err)]
        ident_logits = float(err.max()) if err.numel() else math.nan
    head_bound = B.head_upper_bound(c.sigma_max, d.temperature)
    head_ratio = torch.where(
        keep & (wflat * ompflat > 0), ratio[d.final_index], torch.full_like(ratio[0], math.nan)
    )
    if entropy_part is not None:
        # the bound is about the policy-gradient term: delta - e v, known on the check tokens only
        pg = torch.linalg.vector_norm(c.delta.to(torch.float64) - entropy_part, dim=-1)
        pg_ratio = torch.full_like(head_ratio, math.nan)
        pg_ratio[idx] = B.bound_ratio(pg, wflat[idx], ompflat[idx])
        head_ratio = torch.where(torch.isfinite(head_ratio), pg_ratio, head_ratio)
    elif c.entropy_weight is not None:
        # an entropy bonus whose part could not be predicted (no check tokens on this micro-batch, or a sharded
        # head): the policy-gradient part cannot be separated, so no token is bounded
        head_ratio = torch.full_like(head_ratio, math.nan)
    finite = torch.isfinite(head_ratio)
    head_n = int(finite.sum())
    head_max = float(head_ratio[finite].max()) if head_n else math.nan
    head_viol = int((head_ratio[finite] > head_bound * (1 + tol_bound)).sum())
    fin_ident = ident[torch.isfinite(ident)]
    fin_scaled = scaled[torch.isfinite(scaled)]
    ident_viol = int(viol.sum())
    lr_fin = lr[lr_ok]
    cols = {
        "vocab_size": [vocab],
        "temperature": [float(d.temperature)],
        "grad_dtype": [str(c.grad_dtype).replace("torch.", "")],
        "head_dtype": [str(c.head_dtype).replace("torch.", "")],
        # what the identity's prediction held; null on a micro-batch whose checks the budget skipped (no prediction)
        "identity_rounded": [c.rounded is not None if kc else None],
        "entropy_term": [entropy_part is not None if kc else None],
        "n_checked": [int(ok.sum())],
        "identity_n": [int(fin_ident.numel())],
        "identity_max_rel_err": [float(fin_ident.max()) if fin_ident.numel() else math.nan],
        "identity_mean_rel_err": [float(fin_ident.mean()) if fin_ident.numel() else math.nan],
        "identity_max_scaled_err": [float(fin_scaled.max()) if fin_scaled.numel() else math.nan],
        "identity_violations": [ident_viol],
        "identity_logits_max_rel_err": [ident_logits],
        "logits_lo": [lo_b],
        "logits_hi": [hi_b],
        "logits_ratio_min": [float(lr_fin.min()) if lr_fin.numel() else math.nan],
        "logits_ratio_max": [float(lr_fin.max()) if lr_fin.numel() else math.nan],
        "logits_violations": [viol_logits],
        "head_sigma_max": [c.sigma_max],
        "head_sigma_step": [int(c.sigma_step)],
        "head_bound": [head_bound],
        "head_ratio_max": [head_max],
        "head_n": [head_n],
        "head_violations": [head_viol],
        "tolerance": [tol],
        "tolerance_rel": [tol_rel],
        "bound_tolerance": [tol_bound],
    }
    for k, v in cols.items():
        if isinstance(v[0], float):
            cols[k] = _nan_to_none(v)
    return {**_key(d, 1), **cols}, (ident, lr)


def _tokens(d: StepData, pi, pi_old, w, bins, norms, ratio, direct_ratio, per_token_check) -> Columns:
    """The token sample: one row per (sampled token, point); direct and check columns are null outside their
    subsets (the first Kd / Kc tokens of the sample)."""
    n = min(d.n_record, d.sample_idx.shape[0])
    keep = d.sample_valid[:n]
    idx = d.sample_idx[:n]
    n_pts = len(d.points)
    nan = torch.full((n_pts, n), math.nan, dtype=torch.float64, device=norms.device)
    wabs = w.reshape(-1)[idx].abs()
    dn, dr = nan.clone(), nan.clone()
    if direct_ratio is not None:
        kd = min(direct_ratio.shape[1], n)
        dn[:, :kd] = d.direct[:, :kd].to(torch.float64) * wabs[:kd]
        dr[:, :kd] = direct_ratio[:, :kd]
    ie, lr = nan[0].clone(), nan[0].clone()
    if per_token_check is not None:
        kc = min(per_token_check[0].shape[0], n)
        ie[:kc], lr[:kc] = per_token_check[0][:kc], per_token_check[1][:kc]
    idx = idx[keep]
    m = int(idx.shape[0])
    c_len = d.valid.shape[1]

    def col(t: torch.Tensor) -> list:
        return t.reshape(-1).tolist()

    base = {
        "row": col(idx // c_len),
        "pos": col(idx % c_len),
        "token_id": [None] * m if d.completion_ids is None else col(d.completion_ids.reshape(-1)[idx]),
        "bin": col(bins.reshape(-1)[idx]),
        "pi_old": col(pi_old.reshape(-1)[idx]),
        "pi": col(pi.reshape(-1)[idx]),
        "advantage": [None] * m
        if d.advantages is None
        else col(d.advantages.reshape(-1)[idx].to(torch.float64)),
        "w": col(w.reshape(-1)[idx]),
    }
    out: Columns = {k: v * n_pts for k, v in base.items()}
    out["point"] = [name for name in d.points for _ in range(m)]
    out["norm"] = col(norms[:, idx])
    out["ratio"] = _nan_to_none(col(ratio[:, idx]))
    out["direct_norm"] = _nan_to_none(col(dn[:, keep]))
    out["direct_ratio"] = _nan_to_none(col(dr[:, keep]))
    out["identity_rel_err"] = _nan_to_none(col(ie[keep]) * n_pts)
    out["logits_ratio"] = _nan_to_none(col(lr[keep]) * n_pts)
    return {**_key(d, len(out["point"])), **out}
