"""Plain-language readings of each figure, generated from the same numbers the figure draws.

Each function takes the `Records` and returns a few sentences; it raises `MissingRecords` when its numbers are not
there (the report then prints the figure's note instead).
"""

from __future__ import annotations

import math

import polars as pl

from tokendyn.analysis.tables import checks_violations
from tokendyn.effects.precision import check_summary
from tokendyn.figures.data import MissingRecords, Records, bin_label, full_loss, one_point, run_order
from tokendyn.figures.dynamics import _pooled_influence, pooled_change
from tokendyn.figures.gradients import per_token_norms
from tokendyn.figures.style import method_kind
from tokendyn.figures.tokens import envelope, token_counts
from tokendyn.figures.training import accuracy_table
from tokendyn.vocab import TRAIN


def pct(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.0f}%"


def num(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.3g}"


def _lowest_highest(df: pl.DataFrame) -> tuple[int, int, float, float]:
    """(lowest bin, highest bin, upper edge of the lowest, lower edge of the highest)."""
    bins = sorted(b for b in df.get_column("bin").unique().to_list() if b >= 0)
    lo_row = df.filter(pl.col("bin") == bins[0])
    hi_row = df.filter(pl.col("bin") == bins[-1])
    return bins[0], bins[-1], float(lo_row["bin_hi"].mean()), float(hi_row["bin_lo"].mean())


def _need(records: Records, kind: str, what: str) -> pl.DataFrame:
    df = records.get(kind)
    if df is None:
        raise MissingRecords(what, [kind])
    return df


def token_share(records: Records) -> str:
    counts = token_counts(_need(records, "binstats", "token share"))
    lo, hi, e_lo, e_hi = _lowest_highest(counts)
    parts = []
    for run in run_order(counts):
        c = counts.filter(pl.col("run") == run)
        s_lo = c.filter(pl.col("bin") == lo)["share"].sum()
        s_hi = c.filter(pl.col("bin") == hi)["share"].sum()
        n = int(c["tokens"].sum())
        parts.append(
            f"{run}: {pct(s_lo)} of the {n} sampled tokens have π_old < {e_lo:g}, {pct(s_hi)} have π_old ≥ {e_hi:g}"
        )
    return "; ".join(parts) + ". (The paper, Qwen2.5-7B on K&K: 19% below 0.25, 61% above 0.75.)"


def advantage(records: Records) -> str:
    tk = one_point(_need(records, "tokens", "advantage"))
    if "in_stage" in tk.columns:
        tk = tk.filter(pl.col("in_stage"))
    s = tk.filter(pl.col("bin") >= 0).group_by("run", "bin").agg(pl.col("advantage").std().alias("sd"))
    parts, similar = [], True
    for run in run_order(s):
        sd = s.filter(pl.col("run") == run)["sd"].drop_nulls()
        if sd.len():
            parts.append(f"{run}: std {num(sd.min())}–{num(sd.max())}")
            similar &= bool(sd.min() > 0 and sd.max() / sd.min() < 1.5)
    if not parts:
        raise MissingRecords("advantage", ["tokens"], reason="too few tokens per interval")
    text = "Standard deviation of the advantage per interval: " + "; ".join(parts) + ". "
    if similar:
        return text + ("It is about the same in every interval, so the advantage does not explain which tokens "
                       "dominate the gradient; the (1 − π) factor does.")  # fmt: skip
    return text + "It differs between intervals by more than a factor 1.5 in at least one run."


def prob_change(records: Records) -> str:
    pooled = pooled_change(_need(records, "prob_change", "probability change")).filter(pl.col("bin") >= 0)
    lo, hi, e_lo, e_hi = _lowest_highest(pooled)
    parts = []
    for run in run_order(pooled):
        r = pooled.filter(pl.col("run") == run).sort("mean_abs", descending=True)
        top = r.row(0, named=True)
        high = r.filter(pl.col("bin") == hi)["mean_abs"].max()
        parts.append(
            f"{run}: largest mean |Δπ| = {num(top['mean_abs'])} in [{top['bin_lo']:g}, {top['bin_hi']:g}), "
            f"{num(high)} for π_old ≥ {e_hi:g}"
        )
    changes = _need(records, "prob_change", "probability change")
    counterfactual = changes.filter(pl.col("update") != "real") if "update" in changes.columns else changes
    check = records.get("precision_check")
    return ("After one update with all tokens, " + "; ".join(parts) + "."
            + resolution_note(counterfactual, check) + precision_note(check))  # fmt: skip


def precision_note(check: pl.DataFrame | None) -> str:
    """One sentence per run of its measured step-precision checks (`tokendyn.effects.precision.check_summary`)."""
    if check is None or check.is_empty():
        return ""
    runs = run_order(check) if "run" in check.columns else [None]
    parts = [
        (f"{run}: " if run is not None else "")
        + check_summary(check.filter(pl.col("run") == run) if run else check)
        for run in runs
    ]
    return (
        " Measured step precision (float64 against the model's dtype, same state): " + "; ".join(parts) + "."
    )


def gradient_norm(records: Records) -> str:
    sh = records.get("shares")
    if sh is not None:
        sh = full_loss(sh).filter(pl.col("group") == "all")
        m = sh.group_by("run", "stage", "bin").agg(pl.col("grad_norm").mean(), pl.col("bin_lo").mean(),
                                                   pl.col("bin_hi").mean())  # fmt: skip
        lo, hi, e_lo, e_hi = _lowest_highest(m)
        parts = []
        for run in run_order(m):
            r = m.filter(pl.col("run") == run)
            g_all = r.filter(pl.col("bin") < 0)["grad_norm"].mean()
            g_lo = r.filter(pl.col("bin") == lo)["grad_norm"].mean()
            g_hi = r.filter(pl.col("bin") == hi)["grad_norm"].mean()
            parts.append(
                f"{run}: tokens below {e_lo:g} alone give ‖g_b‖ = {num(g_lo)} ({pct(g_lo / g_all if g_all else None)} "
                f"of the all-token ‖g‖ = {num(g_all)}), tokens above {e_hi:g} give {num(g_hi)} "
                f"({pct(g_hi / g_all if g_all else None)})"
            )
        falls = all(
            float(r.filter(pl.col("bin") == lo)["grad_norm"].mean() or 0) > float(r.filter(pl.col("bin") == hi)["grad_norm"].mean() or 0)
            for run in run_order(m)
            if (r := m.filter(pl.col("run") == run)).height
        )  # fmt: skip
        tail = (
            " The gradient norm is larger for the low-probability interval, as the (1 − π) bound predicts."
            if falls
            else ""
        )
        return "; ".join(parts) + "." + tail
    bs = _need(records, "binstats", "gradient norm")
    per_bin, all_tokens = per_token_norms(bs)
    lo, hi, e_lo, e_hi = _lowest_highest(per_bin)
    parts = []
    for run in run_order(per_bin):
        r = per_bin.filter(pl.col("run") == run)
        a = r.filter(pl.col("bin") == lo)["m"].max()
        b = r.filter(pl.col("bin") == hi)["m"].max()
        parts.append(
            f"{run}: a token below {e_lo:g} gets {num(a / b if b else None)}× the gradient of a token above {e_hi:g}"
        )
    return "Per token at the final norm: " + "; ".join(parts) + "."


def layer_heatmap(records: Records) -> str:
    sh = records.get("shares")
    if sh is not None:
        r = full_loss(sh).filter((pl.col("group") != "all") & (pl.col("bin") >= 0))
        rel = r.group_by("run", "group", "bin").agg(
            (pl.col("grad_norm") / pl.col("total_norm")).mean().alias("v")
        )
        lo = int(rel["bin"].min())
        parts = []
        for run in run_order(rel):
            v = rel.filter((pl.col("run") == run) & (pl.col("bin") == lo))["v"]
            parts.append(f"{run}: {num(v.min())}–{num(v.max())}")
        top = rel.group_by("run", "group").agg(pl.col("bin").sort_by("v").last().alias("top"))
        n_top = int((top["top"] == lo).sum())
        return (f"The lowest interval has the largest relative gradient in {n_top} of {top.height} (run, parameter "
                "group) pairs; its ‖g_b‖ / ‖g‖ across groups: " + "; ".join(parts) + ".")  # fmt: skip
    _need(records, "binstats", "layer heatmap")
    return "Per probe point, the mean per-token gradient norm per interval relative to all tokens (from binstats)."


def _moved(r: pl.DataFrame, src: int, targets: list[int]) -> float | None:
    """Token-weighted mean |delta pi| over the target bins after updating only the source bin."""
    x = r.filter((pl.col("source_bin") == src) & pl.col("target_bin").is_in(targets))
    return float((x["mean_abs"] * x["tokens"]).sum() / x["tokens"].sum()) if x.height else None


def _checked(rows: pl.DataFrame, check: pl.DataFrame | None) -> pl.DataFrame:
    """The ``rows`` stepped in the model's dtype on the agreement of the run's latest `precision_check` at or before
    their step (`tokendyn.effects.precision`): their rounding bound was measured not to bind."""
    if check is None or check.is_empty() or rows.is_empty():
        return rows.clear()
    by = ["run"] if "run" in rows.columns and "run" in check.columns else []
    verdict = check.group_by([*by, "step"]).agg(pl.col("agreed").all(), pl.col("rel_diff").max())
    verdict = verdict.rename({"step": "check_step"}).sort("check_step")
    low = rows.filter(pl.col("step_dtype") != "float64").sort("step")
    joined = low.join_asof(verdict, left_on="step", right_on="check_step", by=by or None, strategy="backward")
    return joined.filter(pl.col("agreed").fill_null(False))


def resolution_note(df: pl.DataFrame, check: pl.DataFrame | None = None) -> str:
    """What the records say of their counterfactual steps' resolution (`step_rounding`, `step_resolved`): "" for
    records that do not say (written before it was recorded), else one sentence, a warning where a step was not
    resolved and no measured check (``check``: the runs' `precision_check` records) agreed to its dtype; and a
    sentence counting the updates that were no update (`no_update`: no policy-gradient signal,
    `tokendyn.effects.resolution`), whose rows are empty."""
    note = _no_update_note(df)
    if "step_rounding" not in df.columns:
        return note
    known = df.filter(pl.col("step_rounding").is_not_null())
    if known.height == 0:
        return note
    worst = float(known["step_rounding"].max())
    bad = known.filter(~pl.col("step_resolved"))
    covered = _checked(bad, check)
    if covered.height:
        keys = [c for c in ("run", "step") if c in bad.columns]  # (coverage is per run and step)
        bad = bad.join(covered.select(keys).unique(), on=keys, how="anti")
        note = (f" {covered.height} rows come from steps in the model's dtype whose rounding bound (up to "
                f"{100 * float(covered['step_rounding'].max()):.3g} % of a step) a measured check agreed not to bind "
                f"(float64 and model-dtype steps within {float(covered['rel_diff'].max()):.2g} of the largest "
                f"|Δπ|: precision_check).") + note  # fmt: skip
        if bad.height == 0:
            return note
    if bad.height == 0:
        return (
            f" Every counterfactual step was resolved (rounding could take at most {worst:.1e} of a step)."
            + note
        )
    return (f" WARNING: {bad.height} of {known.height} rows come from counterfactual steps that are not resolved: "
            f"rounding the parameters could take up to {100 * worst:.3g} % of a step (in the model's dtype "
            "--probe_step_precision float64 or a larger --probe_lr resolves them; in float64 only a larger "
            "--probe_lr does)." + note)  # fmt: skip


def _no_update_note(df: pl.DataFrame) -> str:
    if "no_update" not in df.columns:
        return ""
    keys = [c for c in ("run", "step", "update", "update_stage", "source_bin", "lr") if c in df.columns]
    updates = df.select(keys).n_unique() if keys else 0
    none = df.filter(pl.col("no_update").fill_null(False)).select(keys).n_unique() if keys else 0
    if not none:
        return ""
    return (f" {none} of {updates} counterfactual updates carried no policy-gradient signal (no token with A ≠ 0 and "
            "a non-zero weight): no update, their rows are empty.")  # fmt: skip


def isolation(records: Records) -> str:
    pooled = _pooled_influence(_need(records, "influence", "isolation"))
    bins = sorted(b for b in pooled["source_bin"].unique().to_list() if b >= 0)
    lo, hi = bins[0], bins[-1]
    middle = list(range(lo + 1, hi))
    parts = []
    for run in run_order(pooled):
        r = pooled.filter((pl.col("run") == run) & (pl.col("target_bin") >= 0))
        a, b = _moved(r, lo, middle), _moved(r, hi, middle)
        c, d = _moved(r, lo, [hi]), _moved(r, hi, [hi])
        said = []
        if a is not None and b is not None and middle:
            said.append(f"the frozen middle intervals move by mean |Δπ| = {num(a)} when only the lowest interval is "
                        f"updated and by {num(b)} when only the highest is ({num(a / b if b else None)}×)")  # fmt: skip
        if c is not None and d is not None:
            said.append(f"the highest interval's own tokens move by {num(d)} when they alone are updated, against "
                        f"{num(c)} when only the lowest interval is")  # fmt: skip
        if said:
            parts.append(f"{run}: " + "; ".join(said))
    if not parts:
        return "Not enough source bins with tokens to compare the lowest and highest interval."
    return (". ".join(parts) + ". Ideally a frozen interval does not move at all. The paper (Fig. 1e/f): updating "
            "the low tokens alone reproduces most of the full update, and the high tokens move less when updated "
            "themselves than when only the low ones are."
            + resolution_note(_need(records, "influence", "isolation"), records.get("precision_check")))  # fmt: skip


def influence_matrix(records: Records) -> str:
    pooled = _pooled_influence(_need(records, "influence", "influence matrix"))
    off = pooled.filter((pl.col("source_bin") >= 0) & (pl.col("target_bin") >= 0) &
                        (pl.col("source_bin") != pl.col("target_bin")))  # fmt: skip
    parts = []
    for run in run_order(off):
        r = off.filter(pl.col("run") == run).sort("mean_abs", descending=True)
        if r.height:
            t = r.row(0, named=True)
            stage = "" if t["update_stage"] == TRAIN else f" ({t['update_stage']} stage)"
            parts.append(
                f"{run}{stage}: the strongest cross-interval effect is from [{t['source_lo']:g}, {t['source_hi']:g}) "
                f"on [{t['target_lo']:g}, {t['target_hi']:g}), mean |Δπ| = {num(t['mean_abs'])}"
            )
    return ("Rows are the updated interval, columns the measured one. " + "; ".join(parts) + "."
            + resolution_note(_need(records, "influence", "influence matrix"), records.get("precision_check")))  # fmt: skip


def bound(records: Records) -> str:
    tk = _need(records, "tokens", "bound")
    parts = []
    checks = records.get("checks")
    if checks is not None:
        v = checks_violations(checks)
        n = int(checks["n_checked"].sum())
        parts.append(f"At the logits the exact bound √(V/(V−1))(1−π) ≤ ‖∂ℓ/∂z‖/|w| ≤ √2(1−π) was checked on {n} "
                     f"tokens with {v} violation{'s' * (v != 1)}")  # fmt: skip
    b = records.get("bound")
    if b is not None:
        env = envelope(b).filter(pl.col("point") == "final_norm.out")
        for run in run_order(env):
            e = env.filter(pl.col("run") == run).row(0, named=True)
            parts.append(f"{run}: at the final norm ‖δ‖/|w| stays between {num(e['C'])}(1−π) and {num(e['D'])}(1−π), "
                         f"Spearman ρ with (1−π) = {num(e['spearman'])}")  # fmt: skip
    if not parts:
        parts.append(f"{one_point(tk).height} sampled tokens drawn")
    return (
        "; ".join(parts)
        + ". Inner layers carry other tokens' gradients through attention: their envelope is empirical."
    )


def correct_ratio(records: Records) -> str:
    pooled = pooled_change(_need(records, "prob_change", "correct ratio")).filter(pl.col("bin") >= 0)
    lo, hi, e_lo, e_hi = _lowest_highest(pooled)
    parts = []
    for run in run_order(pooled):
        r = pooled.filter(pl.col("run") == run)
        a = r.filter(pl.col("bin") == lo)["correct_pos"].max()
        b = r.filter(pl.col("bin") == hi)["correct_pos"].max()
        n = r.filter(pl.col("bin") == hi)["n_pos"].sum()
        ties = r.filter(pl.col("bin") == hi)["tie_pos"].sum()
        parts.append(
            f"{run}: {pct(b)} of the {n - ties} positive tokens with π_old ≥ {e_hi:g} that moved rose, {ties} ties "
            f"(below {e_lo:g}: {pct(a)})"
        )
    return ("Positive-advantage tokens whose probability rose, among those that moved (float64 resolution), after the "
            "full update — " + "; ".join(parts)
            + ". The paper finds GRPO below 50% for high-probability tokens and both remedies above it.")  # fmt: skip


def update_shares(records: Records) -> str:
    all_sh = _need(records, "shares", "update shares").filter(pl.col("group") == "all")
    sh = full_loss(all_sh)
    per = sh.group_by("run", "bin").agg(pl.col("share").mean(), pl.col("count").sum(), pl.col("bin_lo").mean(),
                                       pl.col("bin_hi").mean())  # fmt: skip
    per = per.filter(pl.col("bin") >= 0).with_columns(
        (pl.col("count") / pl.col("count").sum().over("run")).alias("tok")
    )
    lo, hi, e_lo, e_hi = _lowest_highest(per)
    staged = all_sh.filter((pl.col("stage") != "train") & (pl.col("bin") >= 0))
    staged_runs = set(staged["run"].unique().to_list())
    parts = []
    for run in run_order(per):
        r = per.filter((pl.col("run") == run) & (pl.col("bin") == lo)).row(0, named=True)
        h = per.filter((pl.col("run") == run) & (pl.col("bin") == hi)).row(0, named=True)
        what = "the update"
        if run in staged_runs:
            what = "the full loss's gradient (which Lopti never steps along)"
        elif method_kind(run) in ("lopti", "both"):  # recorded before the stages were decomposed
            what = "the full loss's gradient (these records hold no per-stage shares)"
        parts.append(f"{run}: tokens below π = {e_lo:g} are {pct(r['tok'])} of tokens and carry {pct(r['share'])} of "
                     f"{what}; tokens above {e_hi:g} are {pct(h['tok'])} and carry {pct(h['share'])}")  # fmt: skip
    text = "; ".join(parts) + "."
    if staged.height:
        st = staged.group_by("run", "stage", "bin").agg(
            pl.col("share").mean(), pl.col("count").sum(), pl.col("bin_lo").mean(), pl.col("bin_hi").mean()
        )
        st = st.with_columns((pl.col("count") / pl.col("count").sum().over("run", "stage")).alias("tok"))
        notes = []
        first = staged.group_by("run", "stage").agg(pl.col("step").min())  # stage 1 is recorded first
        pairs = [(r, s) for r, s, _ in sorted(first.rows(), key=lambda p: (p[0], p[2], p[1]))]
        for run, stage in pairs:
            r = st.filter((pl.col("run") == run) & (pl.col("stage") == stage) & (pl.col("count") > 0))
            top = r.sort("share", descending=True, nulls_last=True).row(0, named=True) if r.height else None
            if top is not None:
                where = bin_label(top["bin_lo"], top["bin_hi"], top["bin_hi"] >= 1)
                notes.append(f"{run}, stage {stage}: {where} holds {pct(top['tok'])} of "
                             f"the stage's tokens and carries {pct(top['share'])} of its update")  # fmt: skip
        if notes:
            text += (" Each Lopti stage decomposed on its own (the stage loss's gradient at the start of the stage, "
                     "stage 2 after the real stage-1 steps): " + "; ".join(notes) + ".")  # fmt: skip
    return text


def training(records: Records) -> str:
    m = _need(records, "metrics", "training curves")
    parts = []
    try:
        acc = accuracy_table(m)
        for row in acc.iter_rows(named=True):
            gain = row.get("vs GRPO (%)")
            g = (
                f" ({gain:+.0f}% vs GRPO)"
                if gain is not None and row["run"].strip().upper() != "GRPO"
                else ""
            )
            parts.append(f"{row['run']}: held-out accuracy {num(row['mean'])}{g}")
    except MissingRecords:
        pass
    for run in run_order(m):
        r = m.filter(pl.col("run") == run)
        if "reward" in r.columns and r["reward"].drop_nulls().len():
            rw = r.drop_nulls("reward")
            parts.append(f"{run}: training reward {num(rw['reward'].head(3).mean())} → {num(rw['reward'].tail(3).mean())} "
                         f"(first / last three logs)")  # fmt: skip
    return "; ".join(parts) + "." if parts else "No reward or accuracy logged."
