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

from tokendyn.figures import axis, camps, dynamics, gradients, paired, readings, sweep, tokens, training
from tokendyn.figures.data import ANALYSIS_KINDS, MissingRecords, Records, load_runs
from tokendyn.figures.tables import TABLES
from tokendyn.figures.view import view_fragment

# the report's token view keeps at most this many tokens (~85 bytes each on the page: ~8.5 MB), the latest probed
# steps of each run; `tokendyn view` writes all of them
REPORT_VIEW_TOKENS = 100_000

FORMATS = ("png", "svg", "pdf")
REPORT = "report.html"


@dataclass(frozen=True)
class FigureSpec:
    """One figure of the report: file stem, title, the paper's panel, the record kinds it reads, what it shows,
    how it is drawn and read."""

    name: str
    title: str
    paper: str
    kinds: tuple[str, ...]
    shows: str
    draw: Callable[[Records], Figure]
    read: Callable[[Records], str]


def _g(r: Records, k: str):
    return r.get(k)


FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec("a_token_share", "Tokens per probability interval", "Fig. 1a", ("binstats", "tokens"),
               "Share of sampled tokens per interval of π_old (log scale) and the density of π_old.",
               lambda r: tokens.token_share(_g(r, "binstats"), _g(r, "tokens")), readings.token_share),
    FigureSpec("b_advantage", "Advantage per interval", "Fig. 1b", ("tokens",),
               "Distribution of the advantage used in the loss, per interval.",
               lambda r: tokens.advantage_by_bin(_g(r, "tokens"), _g(r, "binstats")), readings.advantage),
    FigureSpec("c_prob_change", "Probability change after the full update", "Fig. 1c", ("prob_change",),
               "Δπ per interval after one update with all tokens (box q25–q75, whiskers q01–q99).",
               lambda r: dynamics.prob_change_by_bin(_g(r, "prob_change"), _g(r, "token_shares")),
               readings.prob_change),
    FigureSpec("d_gradient_norm", "Gradient norm per interval", "Fig. 1d", ("shares", "binstats"),
               "Norm of the gradient of each interval's loss against the all-token gradient.",
               lambda r: gradients.gradient_norm_by_bin(_g(r, "shares"), _g(r, "binstats")), readings.gradient_norm),
    FigureSpec("d_layer_heatmap", "Gradient per layer and interval", "Fig. 1d, per layer", ("shares", "binstats"),
               "Each layer's gradient per interval relative to the layer's all-token gradient.",
               lambda r: gradients.layer_bin_heatmap(_g(r, "shares"), _g(r, "binstats")), readings.layer_heatmap),
    FigureSpec("e_isolation", "Isolation: updating one interval only", "Fig. 1e/f", ("influence",),
               "Δπ per interval when only the lowest (left) or highest (right) interval is updated; grey: all tokens "
               "updated. Quantiles are averaged over the probed steps, weighted by tokens.",
               lambda r: dynamics.isolation(_g(r, "influence")), readings.isolation),
    FigureSpec("e_influence_matrix", "Influence matrix", "Fig. 1e/f, all rows", ("influence",),
               "Mean |Δπ| of each measured interval (columns) after updating one interval (rows).",
               lambda r: dynamics.influence_matrix(_g(r, "influence")), readings.influence_matrix),
    FigureSpec("f_bound", "The (1 − π) bound", "Fig. 2a", ("tokens", "bound"),
               "‖δ_l‖/|w| of sampled tokens against π per layer, the measured envelope and the theoretical lines.",
               lambda r: tokens.bound(_g(r, "tokens"), _g(r, "bound"), _g(r, "checks")), readings.bound),
    FigureSpec("g_correct_ratio", "Correct ratio per interval", "Fig. 2b", ("prob_change",),
               "Share of tokens moved in the direction of their advantage after the full update, per run.",
               lambda r: dynamics.correct_ratio(_g(r, "prob_change")), readings.correct_ratio),
    FigureSpec("g_correct_sweep", "Correct ratio against the step size", "Fig. 2b, along lr", ("prob_change",),
               "The correct ratio of positive-advantage tokens per interval as the counterfactual SGD step grows from "
               "the paper's lr = 1e-3 (dashed) to clearly non-linear steps; ties left out.",
               lambda r: sweep.correct_vs_step(_g(r, "prob_change")), sweep.reading),
    FigureSpec("g_limit_sweep", "The lr → 0 limit beside the finite step", "theory vs Fig. 2b", ("prob_change",), "Correct ratio (A > 0) and mean |Δπ| per unit lr per interval, from the lr → 0 limit (d π/d lr at lr = 0, the paper's theory) through the sweep's finite SGD steps (its figures: lr 1e-3).", lambda r: sweep.limit_vs_step(_g(r, "prob_change")), sweep.limit_reading),
    FigureSpec("h_update_shares", "Update shares per interval", "new", ("shares",),
               "Projection shares s_b of the update, per parameter group and over training steps; a Lopti run shows "
               "its two stages apart: each stage loss's gradient at the start of the stage.",
               lambda r: gradients.update_shares(_g(r, "shares")), readings.update_shares),
    FigureSpec("h_paired", "Paired comparison of update rules", "new", ("paired",),
               "Each compared rule's Δπ and correct ratio minus the base rule's, per interval, from the same states "
               "(equal ‖Δθ‖ and/or the run's optimizer), with 95 % intervals over probed steps × sequences.",
               lambda r: paired.paired_differences(_g(r, "paired")), paired.reading),
    FigureSpec("h_both_camps", "Both camps from the same states", "new", ("paired",),
               "Every compared rule (rows, grouped: tames low-π, protects low-π, other) × interval of π_old: the paired "
               "difference from the base rule, ▲ / ▼ where its 95 % interval lies above / below 0, · where it holds 0.",
               lambda r: camps.both_camps(_g(r, "paired")), camps.reading),
    FigureSpec("h_axis", "One axis through both camps", "new", ("paired",),
               "Per swept value (c: A ← (1 + c(1 − π_old))A, c < 0 Reweight, c > 0 Δlog p reweight; Lopti's η) and "
               "interval: correct ratios, Δπ, update share, entropy change and KL to the base update, 95 % bands; the "
               "guidance's value and interval marked.",
               lambda r: axis.sweep_curves(_g(r, "paired")), axis.reading),
    FigureSpec("i_training", "Training curves", "Fig. 3", ("metrics",),
               "Training reward and held-out accuracy per puzzle size, per run.",
               lambda r: training.training_curves(_g(r, "metrics")), readings.training),
)  # fmt: skip


def hint(kinds: Iterable[str]) -> str:
    """How to get the missing record kinds."""
    kinds = list(kinds)
    if "metrics" in kinds:
        return "metrics.parquet is written by `tokendyn train` (tokendyn.trainers.runner.train)"
    if "token_view" in kinds:
        return "train with --probe_every N and --probe_view_sequences N (default 4; tokendyn probe --view_sequences)"
    if "paired" in kinds:
        return "train with --probe_compare_rules reweight,lopti (or tokendyn probe --compare_rules)"
    if any(k in ANALYSIS_KINDS for k in kinds):
        return "train with --probe_every N and the rebalancing analyses on (--probe_analyses, --probe_sample_sequences)"
    return "train with --probe_every N (or record with tokendyn.hooks)"


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
        "temperature.</p>"
        f"<table><thead><tr><th>run</th><th>directory</th><th>records</th></tr></thead><tbody>{runs}</tbody></table>"
        f"<ul>{toc}</ul>{''.join(body)}</body></html>"
    )


def _has(records: Records, kind: str, label: str) -> bool:
    df = records.get(kind)
    return df is not None and df.filter(pl.col("run") == label).height > 0
