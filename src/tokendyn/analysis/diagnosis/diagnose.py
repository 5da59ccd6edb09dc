"""`diagnose`: the findings of one or more run directories, as a JSON-ready document (`schema.SCHEMA`), and their
text: one line per finding (verdict, title, value [interval] against the reference, what to try), then the reasons
of the findings not measured. Each run directory is diagnosed on its own records."""

from __future__ import annotations

import os

from tokendyn.analysis.diagnosis.bound import bound_findings
from tokendyn.analysis.diagnosis.concentration import concentration_findings
from tokendyn.analysis.diagnosis.context import RunContext
from tokendyn.analysis.diagnosis.dominance import dominance_findings
from tokendyn.analysis.diagnosis.finding import ACT, FAMILIES, NOT_MEASURED, VERDICTS, WATCH, Finding, finite
from tokendyn.analysis.diagnosis.health import health_findings
from tokendyn.analysis.diagnosis.remedies import remedy_findings
from tokendyn.analysis.diagnosis.sampler import sampler_findings
from tokendyn.analysis.diagnosis.spikes import spike_findings
from tokendyn.analysis.run import load_run
from tokendyn.version import __version__


def run_findings(ctx: RunContext) -> list[Finding]:
    """Every finding of one run, in the order of `FAMILIES`."""
    dominance = dominance_findings(ctx)
    whole = next((f for f in dominance if f.name in ("dominance.train", "dominance")), dominance[0])
    found = [
        *dominance,
        *bound_findings(ctx),
        *sampler_findings(ctx),
        *concentration_findings(ctx),
        *remedy_findings(ctx, whole.verdict),
        *health_findings(ctx),
        *spike_findings(ctx),
    ]
    return sorted(found, key=lambda f: FAMILIES.index(f.family))


def diagnose_run(run_dir: str | os.PathLike) -> dict:
    """One run's entry of the document: its directory, method, stack, record kinds, verdict counts, findings."""
    ctx = RunContext(load_run(run_dir))
    findings = [f.to_dict() for f in run_findings(ctx)]
    counts = {v: sum(f["verdict"] == v for f in findings) for v in VERDICTS}
    counts[NOT_MEASURED] = sum(f["status"] == NOT_MEASURED for f in findings)
    return {
        "run_dir": str(run_dir),
        "method": str(ctx.run.method),
        "stack": ctx.stack,
        "kinds": list(ctx.run.kinds),
        "counts": counts,
        "findings": findings,
    }


def diagnose(run_dirs) -> dict:
    """The document of `schema.SCHEMA` for ``run_dirs``."""
    return {"version": __version__, "runs": [diagnose_run(d) for d in run_dirs]}


def any_act(doc: dict) -> bool:
    return any(f["verdict"] == ACT for r in doc["runs"] for f in r["findings"])


def fmt(x) -> str:
    """A number in 3 significant digits (scientific below 1e-3), '-' for null."""
    if not finite(x):
        return "-"
    if x == 0:
        return "0"
    if abs(x) < 1e-3 or abs(x) >= 1e5:
        return f"{x:.2e}"
    return f"{x:.3g}"


def _reference_text(ref: dict) -> str:
    parts = []
    hw = ref.get("higher_is_worse", True)
    for level in ("watch", "act"):
        if finite(ref.get(level)):
            parts.append(f"{level} {'>=' if hw else '<='} {fmt(ref[level])}")
    if finite(ref.get("floor")):
        extra = f" ({fmt(ref['times_floor'])}x)" if finite(ref.get("times_floor")) else ""
        parts.append(f"floor {fmt(ref['floor'])}{extra}")
    elif ref.get("floor_source"):
        parts.append("no floor recorded")
    return ", ".join(parts) if parts else "informational"


def finding_line(f: dict) -> str:
    """``VERDICT  title: value [lo, hi] (reference) -> try: flag``."""
    value = fmt(f["value"])
    if f["interval"]:
        value += f" [{fmt(f['interval'][0])}, {fmt(f['interval'][1])}]"
    line = f"  {(f['verdict'] or '').upper():5}  {f['title']}: {value} ({_reference_text(f['reference'])})"
    if f["reason"]:
        line += f"; {f['reason']}"
    if f["try"]:
        line += f"\n         try: {f['try']}"
    return line


def render_text(doc: dict) -> str:
    """The document as text: per run a header, the measured findings, then the ones not measured with reasons, then
    the sources of the thresholds used (once per threshold)."""
    lines = []
    for run in doc["runs"]:
        c = run["counts"]
        lines.append(
            f"{run['run_dir']}: {run['method']} ({run['stack']}): {c['act']} act, {c['watch']} watch, "
            f"{c['fine']} fine, {c['not measured']} not measured"
        )
        family = None
        for f in run["findings"]:
            if f["status"] == NOT_MEASURED:
                continue
            if f["family"] != family:
                family = f["family"]
                lines.append(f" {family}")
            lines.append(finding_line(f))
        missing = [f for f in run["findings"] if f["status"] == NOT_MEASURED]
        if missing:
            lines.append(" not measured")
            lines += [f"  -      {f['title']}: {f['reason']}" for f in missing]
        lines.append("")
    sources = {}
    for run in doc["runs"]:
        for f in run["findings"]:
            if f["reference"].get("threshold"):
                sources.setdefault(f["reference"]["threshold"], f["reference"]["source"])
    lines.append("sources of the thresholds")
    lines += [f"  {name}: {src}" for name, src in sources.items()]
    return "\n".join(lines)


def summary_line(run: dict) -> str:
    """One line for a log: the counts and the findings that say act, then those that say watch."""
    c = run["counts"]
    named = [
        f"{v}: {', '.join(names)}"
        for v in (ACT, WATCH)
        if (names := [f["name"] for f in run["findings"] if f["verdict"] == v])
    ]
    tail = f" ({'; '.join(named)})" if named else ""
    return f"tokendyn doctor: {c['act']} act, {c['watch']} watch, {c['fine']} fine, {c['not measured']} not measured{tail}"
