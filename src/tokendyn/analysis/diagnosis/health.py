"""The probe's own health: unreached points and non-finite norms (`bound`), unresolved counterfactual steps and
diverged rules (`prob_change`, `influence`, `paired`, `precision_check`), skipped analyses (`notes`: no signal in
the sample), checks switched off (`notes`), and the check budget (`checks`: micro-batches whose exact checks ran).

    skipped share = #probed steps with a no_signal_sample note / #probed steps
    checked share = #micro-batches with n_checked > 0 / #micro-batches
"""

from __future__ import annotations

import re

import polars as pl

from tokendyn.analysis.diagnosis.context import RunContext
from tokendyn.analysis.diagnosis.finding import Finding, measured, not_measured
from tokendyn.analysis.diagnosis.thresholds import try_flag

FAMILY = "health"
SKIP = re.compile(r"^no_signal_sample(_step_(\d+))?$")
ANALYSES = ("prob_change", "influence", "paired")


def _unreached(ctx: RunContext) -> Finding:
    name, title = (
        "health.unreached",
        "Probe: tokens whose gradient never reached a probed point, non-finite norms",
    )
    if not ctx.has("bound"):
        return not_measured(FAMILY, name, title, "no `bound` records", threshold="unreached")
    b = ctx.frame("bound")
    unreached, nonfinite = int(b["unreached"].fill_null(0).sum()), int(b["nonfinite"].fill_null(0).sum())
    return measured(FAMILY, name, title, "unreached", float(unreached + nonfinite),
                    details={"unreached": unreached, "nonfinite": nonfinite})  # fmt: skip


def _unresolved(ctx: RunContext) -> Finding:
    name, title = (
        "health.unresolved",
        "Probe: counterfactual steps unresolved, rules diverged, precision checks failed",
    )
    kinds = [k for k in (*ANALYSES, "precision_check") if ctx.has(k)]
    if not kinds:
        return not_measured(FAMILY, name, title, "no counterfactual analyses recorded (prob_change, influence, paired)",
                            threshold="unresolved")  # fmt: skip
    counts, rows = {}, 0
    for k in kinds:
        df = ctx.frame(k)
        rows += df.height
        if "step_resolved" in df.columns:
            counts[f"{k}.unresolved"] = int((df["step_resolved"] == False).sum())  # noqa: E712 (nulls not counted)
        if "diverged" in df.columns:
            counts[f"{k}.diverged"] = int(df["diverged"].fill_null(False).sum())
        if "agreed" in df.columns:
            counts[f"{k}.disagreed"] = int((df["agreed"] == False).sum())  # noqa: E712
    return measured(FAMILY, name, title, "unresolved", float(sum(counts.values())),
                    try_flag=try_flag("smaller_step", ctx.stack), details={**counts, "rows": rows})  # fmt: skip


def _notes(ctx: RunContext) -> pl.DataFrame:
    return (
        ctx.frame("notes") if ctx.has("notes") else pl.DataFrame(schema={"code": pl.Utf8, "step": pl.Int64})
    )


def _skipped(ctx: RunContext) -> Finding:
    name, title = (
        "health.skipped",
        "Probe: probed steps whose analyses were skipped (no signal in the sample)",
    )
    analysed = any(ctx.has(k) for k in ("shares", *ANALYSES))
    steps = ctx.probed_steps
    notes = _notes(ctx)
    skipped = set()
    for code, step in zip(notes["code"].to_list(), notes["step"].to_list(), strict=True):
        m = SKIP.match(code or "")
        if m:
            skipped.add(int(m.group(2)) if m.group(2) else (step if step is not None else -1))
    if not steps:
        return not_measured(FAMILY, name, title, "no `binstats` records: no probed step", threshold="skipped")
    if not analysed and not skipped:
        return not_measured(FAMILY, name, title, "no analysis was asked for (shares, prob_change, influence, paired)",
                            threshold="skipped")  # fmt: skip
    share = min(1.0, len(skipped) / len(steps))
    return measured(FAMILY, name, title, "skipped", share, try_flag=try_flag("more_signal", ctx.stack),
                    details={"skipped_steps": sorted(skipped), "probed_steps": len(steps)})  # fmt: skip


def _switched_off(ctx: RunContext) -> Finding:
    name, title = "health.checks_off", "Probe: checks switched off by the run's conditions (notes)"
    if not ctx.probed_steps:
        return not_measured(
            FAMILY, name, title, "no `binstats` records: the probe did not run", threshold="checks_off"
        )
    notes = _notes(ctx)
    codes = sorted(
        {c for c in notes["code"].to_list() if c and not SKIP.match(c) and not c.startswith("no_update")}
    )
    no_update = sorted({c for c in notes["code"].to_list() if c and c.startswith("no_update")})
    return measured(FAMILY, name, title, "checks_off", float(len(codes)),
                    details={"codes": codes, "no_update_notes": no_update,
                             "value_is": "how many distinct conditions switched a check off"})  # fmt: skip


def _budget(ctx: RunContext) -> Finding:
    name, title = "health.budget", "Probe: micro-batches whose exact checks ran (the check budget)"
    if not ctx.has("checks"):
        return not_measured(FAMILY, name, title, "no `checks` records", threshold="checked")
    c = ctx.frame("checks")
    ran = int((c["n_checked"].fill_null(0) > 0).sum())
    if ran == 0:
        return not_measured(FAMILY, name, title, f"none of {c.height} micro-batches was checked: the budget skipped "
                            "every one (raise --probe_check_budget)", threshold="checked")  # fmt: skip
    return measured(FAMILY, name, title, "checked", ran / c.height,
                    details={"micro_batches": c.height, "checked": ran, "tokens_checked": int(c["n_checked"].sum())})  # fmt: skip


def health_findings(ctx: RunContext) -> list[Finding]:
    return [_unreached(ctx), _unresolved(ctx), _skipped(ctx), _switched_off(ctx), _budget(ctx)]
