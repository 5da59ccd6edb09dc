"""`build_report(run_dirs, out_dir)`: every figure the records allow (PNG, SVG or PDF files), the tables (CSV), and
``report.html``: one self-contained file (images embedded as base64 PNG) with the tables and, under each figure, a
plain-language reading generated from the numbers. A figure, table or the token view whose record kinds these runs
lack is one collapsed line in the report ("<section>: not in these runs (needs <records>; <how to get them>)") and a
note in `ReportResult.notes`.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import math
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.pyplot as plt
import polars as pl
from matplotlib.figure import Figure

from tokendyn.figures.data import MissingRecords, Records, load_runs
from tokendyn.figures.diagnosis import diagnosis_html
from tokendyn.figures.glossary import GLOSSARY_ID, glossary_html
from tokendyn.figures.sections import FIGURES, hint
from tokendyn.figures.tables import TABLES
from tokendyn.figures.view import view_fragment

# the report's token view keeps at most this many tokens (~85 bytes each on the page: ~8.5 MB), the latest probed
# steps of each run; `tokendyn view` writes all of them
REPORT_VIEW_TOKENS = 100_000

FORMATS = ("png", "svg", "pdf")
REPORT = "report.html"


@dataclass
class ReportResult:
    """What `build_report` wrote: the report, figure files, table files, and a note per skipped item."""

    path: Path
    figures: dict[str, Path] = field(default_factory=dict)
    tables: dict[str, Path] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def build_report(
    run_dirs: Iterable[str | os.PathLike] | Records,
    out_dir: str | os.PathLike,
    *,
    fmt: str = "png",
    strict: bool = False,
    progress: Callable[[str], None] | None = None,
) -> ReportResult:
    """Draw every figure the records allow into OUT_DIR/{name}.{fmt}, write the tables to OUT_DIR/tables/*.csv and
    OUT_DIR/report.html. Missing record kinds become notes; with ``strict`` any other error is raised (tests),
    else it also becomes a note (with a warning) so one broken figure never costs the whole report."""
    if fmt not in FORMATS:
        raise ValueError(f"format: must be one of {', '.join(FORMATS)}, got {fmt!r}")
    records = run_dirs if isinstance(run_dirs, Records) else load_runs(run_dirs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = ReportResult(out / REPORT)
    say = progress or (lambda msg: None)
    sections = []
    for spec in FIGURES:
        say(f"figure {spec.name}")
        image = reading = note = missing = None
        try:
            fig = spec.draw(records)
            try:
                image = _png(fig)
                path = out / f"{spec.name}.{fmt}"
                if fmt == "png":
                    path.write_bytes(image)
                else:
                    fig.savefig(path, format=fmt)
                result.figures[spec.name] = path
            finally:
                plt.close(fig)
            reading = _safe(lambda s=spec: s.read(records), strict, f"reading of {spec.name}")
        except MissingRecords as exc:
            note, missing = _skip_note(exc), exc
        except Exception as exc:  # noqa: BLE001  (a broken figure becomes a note unless strict)
            if strict:
                raise
            warnings.warn(f"figure {spec.name} failed: {exc!r}", stacklevel=2)
            note = f"Not drawn: {type(exc).__name__}: {exc}"
        if note:
            result.notes[spec.name] = note
        sections.append((spec, image, reading, note, _partial(records, spec.kinds), missing))
    tables = []
    tdir = out / "tables"
    for name, (title, fn) in TABLES.items():
        say(f"table {name}")
        try:
            df = fn(records)
            if not df.height:
                raise MissingRecords(title, [name], reason="no rows")
            tdir.mkdir(exist_ok=True)
            path = tdir / f"{name}.csv"
            df.write_csv(path)
            result.tables[name] = path
            tables.append((name, title, df, None, None))
        except MissingRecords as exc:
            note = _skip_note(exc)
            result.notes[f"table:{name}"] = note
            tables.append((name, title, None, note, exc))
        except Exception as exc:  # noqa: BLE001
            if strict:
                raise
            warnings.warn(f"table {name} failed: {exc!r}", stacklevel=2)
            note = f"Not computed: {type(exc).__name__}: {exc}"
            result.notes[f"table:{name}"] = note
            tables.append((name, title, None, note, None))
    say("token view")
    view = view_missing = None
    if records.get("token_view") is None:
        view_missing = MissingRecords("token view", ["token_view"])
        result.notes["token_view"] = _skip_note(view_missing)
    else:
        view = _safe(lambda: view_fragment(records, REPORT_VIEW_TOKENS), strict, "token view")
        if view is None:
            result.notes["token_view"] = "Not drawn: the token view failed (see the warning)."
    result.path.write_text(
        render_html(records, sections, tables, view, result.notes.get("token_view"), view_missing),
        encoding="utf-8",
    )
    return result


def _skip_note(exc: MissingRecords) -> str:
    h = hint(exc.kinds)
    return f"Skipped: {exc}. {h[:1].upper()}{h[1:]}."


def _absent(exc: MissingRecords) -> str:
    """What the runs lack and how to get it, for one line: "needs `paired` records; train with ..." (the
    exception's own text after its subject, without the "none found"; then `hint`)."""
    text = str(exc).removeprefix(f"{exc.what}: ")
    need = "needs " + " or ".join(f"`{k}`" for k in exc.kinds) + " records"
    if text.startswith(f"{need}, none found"):
        text = need + text.removeprefix(f"{need}, none found")
    return f"{text}; {hint(exc.kinds)}"


def _safe(fn: Callable[[], str], strict: bool, what: str) -> str | None:
    try:
        return fn()
    except MissingRecords:
        return None
    except Exception as exc:  # noqa: BLE001
        if strict:
            raise
        warnings.warn(f"{what} failed: {exc!r}", stacklevel=2)
        return None


def _partial(records: Records, kinds: tuple[str, ...]) -> str | None:
    """A note when some runs lack the figure's first available kind."""
    for k in kinds:
        df = records.get(k)
        if df is not None:
            have = set(df.get_column("run").unique().to_list())
            missing = [r for r in records.labels if r not in have]
            return f"No `{k}` records in: {', '.join(missing)} (not drawn for them)." if missing else None
    return None


# ------------------------------------------------------------------------------------------------------- HTML
CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1250px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}
h1{margin-bottom:.2em} h2{border-bottom:2px solid #ddd;padding-bottom:.2em;margin-top:2em}
img{max-width:100%;height:auto;border:1px solid #eee}
dt{font-weight:600;margin-top:.5em}dd{margin:0 0 .3em 1.5em}
.reading{background:#f4f8fb;border-left:4px solid #4393c3;padding:.6em 1em;margin:.6em 0}
.note{background:#fff6e5;border-left:4px solid #f0a030;padding:.6em 1em;margin:.6em 0}
details.absent{color:#666;font-size:.9em;margin:.8em 0} details.absent summary{cursor:pointer}
details.absent p{margin:.3em 0 0 1.2em}
.meta{color:#666;font-size:.9em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0 1.5em 0;display:block;overflow-x:auto}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:right;white-space:nowrap}
th{background:#f0f0f0} td.s{text-align:left}
code{background:#f3f3f3;padding:0 3px}
"""


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if v == 0 or 1e-3 <= abs(v) < 1e5:
            return f"{v:.4g}"
        return f"{v:.3e}"
    return html.escape(str(v))


def table_html(df: pl.DataFrame, max_rows: int = 200) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in df.columns)
    rows = []
    for row in df.head(max_rows).iter_rows():
        cells = "".join(
            f'<td class="s">{_fmt(v)}</td>' if isinstance(v, str) else f"<td>{_fmt(v)}</td>" for v in row
        )
        rows.append(f"<tr>{cells}</tr>")
    more = (
        f'<p class="meta">{df.height - max_rows} more rows in the CSV file.</p>'
        if df.height > max_rows
        else ""
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>{more}"


def absent_html(anchor: str, section: str, exc: MissingRecords, detail: str = "") -> str:
    """A section whose records these runs lack: one collapsed line, "<section>: not in these runs (<what is
    missing>; <how to get it>)", with ``detail`` (what the section would show) inside."""
    esc = html.escape
    inside = f"<p>{esc(detail)}</p>" if detail else ""
    return (
        f"<details class='absent' id='{anchor}'><summary>{esc(section)}: not in these runs "
        f"({esc(_absent(exc))})</summary>{inside}</details>"
    )


def render_html(
    records: Records,
    sections,
    tables,
    view: str | None = None,
    view_note: str | None = None,
    view_missing: MissingRecords | None = None,
) -> str:
    esc = html.escape
    runs = "".join(
        f"<tr><td class='s'>{esc(r.label)}</td><td class='s'>{esc(str(r.path))}</td>"
        f"<td class='s'>{esc(', '.join(k for k in records.kinds() if _has(records, k, r.label)))}</td></tr>"
        for r in records.runs
    )
    toc = "".join(f"<li><a href='#{s.name}'>{esc(s.title)}</a> ({esc(s.paper)})</li>" for s, *_ in sections)
    toc += "<li><a href='#token-view-section'>Token view</a></li>"
    toc += "".join(f"<li><a href='#table-{n}'>{esc(t)}</a></li>" for n, t, *_ in tables)
    body = []
    for spec, image, reading, note, partial, missing in sections:
        if missing is not None:
            section = f"{spec.title} ({spec.paper})"
            body.append(
                absent_html(spec.name, section, missing, f"{spec.shows} Records: {', '.join(spec.kinds)}.")
            )
            continue
        body.append(
            f"<h2 id='{spec.name}'>{esc(spec.title)} <span class='meta'>({esc(spec.paper)})</span></h2>"
        )
        body.append(f"<p class='meta'>{esc(spec.shows)} Records: {esc(', '.join(spec.kinds))}.</p>")
        if image is not None:
            b64 = base64.b64encode(image).decode("ascii")
            body.append(f"<img alt='{esc(spec.title)}' src='data:image/png;base64,{b64}'>")
        if reading:
            body.append(f"<div class='reading'>{esc(reading)}</div>")
        for n in (note, partial):
            if n:
                body.append(f"<div class='note'>{esc(n)}</div>")
    if view_missing is not None:
        body.append(
            absent_html(
                "token-view-section", "Token view", view_missing, "Every token of the recorded sequences."
            )
        )
    else:
        body.append(
            "<h2 id='token-view-section'>Token view <span class='meta'>(every token of the recorded sequences)"
            "</span></h2>"
        )
        body.append(
            view
            if view is not None
            else f"<div class='note'>{esc(view_note or 'No token_view records.')}</div>"
        )
    body.append("<h2>Tables</h2>")
    for name, title, df, note, missing in tables:
        if missing is not None:
            body.append(absent_html(f"table-{name}", title, missing))
            continue
        body.append(f"<h3 id='table-{name}'>{esc(title)}</h3>")
        body.append(table_html(df) if df is not None else f"<div class='note'>{esc(note)}</div>")
    stamp = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>tokendyn report: {esc(' vs '.join(records.labels))}</title><style>{CSS}</style></head><body>"
        f"<h1>Which tokens drive the update?</h1><p class='meta'>tokendyn report, {stamp}. "
        "Bins are intervals of π_old, the sampling policy's probability of the sampled token at the sampling "
        f"temperature. Every term: <a href='#{GLOSSARY_ID}'>glossary</a>.</p>"
        f"<table><thead><tr><th>run</th><th>directory</th><th>records</th></tr></thead><tbody>{runs}</tbody></table>"
        f"{diagnosis_html(r.path for r in records.runs)}"  # the diagnosis opens the report
        f"<ul>{toc}</ul>{''.join(body)}{glossary_html()}</body></html>"
    )


def _has(records: Records, kind: str, label: str) -> bool:
    df = records.get(kind)
    return df is not None and df.filter(pl.col("run") == label).height > 0
