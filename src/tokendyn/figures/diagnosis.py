"""The report's first section: the diagnosis of its runs (`tokendyn.analysis.diagnosis`, the findings of
`tokendyn doctor`) as one HTML table per run, the findings not measured folded below it."""

from __future__ import annotations

import html
import os
from collections.abc import Iterable

from tokendyn.analysis.diagnosis import diagnose
from tokendyn.analysis.diagnosis.diagnose import finding_line

VERDICT_STYLE = {"act": "color:#b00;font-weight:bold", "watch": "color:#a60", "fine": "color:#070"}


def diagnosis_html(run_dirs: Iterable[str | os.PathLike]) -> str:
    """``<h2 id='diagnosis'>`` and a table per run: verdict, finding, value [interval] with its reference, what to
    try; a diagnosis that fails is a note naming the error (the rest of the report is drawn either way)."""
    esc = html.escape
    try:
        doc = diagnose(list(run_dirs))
    except Exception as exc:  # noqa: BLE001 (one failed section never costs the report; the note names it)
        return f"<h2 id='diagnosis'>Diagnosis</h2><div class='note'>Not computed: {esc(type(exc).__name__)}: {esc(str(exc))}</div>"
    out = ["<h2 id='diagnosis'>Diagnosis <span class='meta'>(tokendyn doctor; docs/doctor.md)</span></h2>"]
    for run in doc["runs"]:
        c = run["counts"]
        out.append(
            f"<h3>{esc(run['method'])} <span class='meta'>{esc(run['run_dir'])}: {c['act']} act, {c['watch']} "
            f"watch, {c['fine']} fine, {c['not measured']} not measured</span></h3>"
        )
        rows = []
        for f in run["findings"]:
            if f["status"] == "not measured":
                continue
            line = finding_line(f).strip().split("  ", 1)[-1].strip()
            verdict = f["verdict"] or ""
            rows.append(
                f"<tr><td class='s' style='{VERDICT_STYLE.get(verdict, '')}'>{esc(verdict)}</td>"
                f"<td class='s'>{esc(line)}</td></tr>"
            )
        out.append(
            f"<table><thead><tr><th>verdict</th><th>finding</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
        )
        missing = [f for f in run["findings"] if f["status"] == "not measured"]
        if missing:
            items = "".join(f"<li>{esc(f['title'])}: {esc(f['reason'])}</li>" for f in missing)
            out.append(
                f"<details class='not-measured'><summary>not measured ({len(missing)})</summary><ul>{items}</ul></details>"
            )
    return "".join(out)
