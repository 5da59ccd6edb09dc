"""The token view: each recorded completion as text, every token coloured by a quantity the reader picks.

`view_page(records)` is a standalone HTML page (`tokendyn view RUN_DIR`); `view_fragment(records)` the same view
as a section of the report. Both read the `token_view` (and `token_view_rules`, `spikes`) records only, and are
self-contained: the data is JSON inside the page, the script and styles are inline, nothing is fetched. The
records' text is data, never markup: the JSON is escaped for a <script> element and the script writes text with
``textContent`` only (the spikes' list is written here, its text HTML-escaped).

Quantities (`quantities`): π_old by its bin (the figures' bin colours), the advantage A, the update share s_t,
Δπ after the counterfactual and after the real update, the direction of each (correct: Δπ has A's sign; wrong; tie:
Δπ = 0 in float64), Lopti's group, the own-gradient ratio ||∂log π/∂h|| / (1 − π) at the LM head, and per compared
rule its Δπ and the paired difference Δπ(rule) − Δπ(base) at equal ||Δθ||. Signed quantities use one diverging
scale (blue below 0, vermillion above, Okabe-Ito) whose ends are the 99th percentile of |x| over the run's tokens.

With `spikes` records the view lists each spike's tokens above it, each linked to its place (`view_spikes`), and
opens at a spike's top token (the first spike, or the step given as ``spike``).
"""

from __future__ import annotations

import html
import json
import math

import polars as pl

from tokendyn.figures.data import MissingRecords, Records
from tokendyn.figures.style import OKABE_ITO, bin_colors
from tokendyn.figures.view_assets import CONTROLS, CSS, SCRIPT
from tokendyn.figures.view_spikes import check_spike, open_at, run_spikes, spikes_html

VIEW = "view.html"
KINDS = ("token_view", "token_view_rules")
SCALE_QUANTILE = 0.99
COLUMNS = (
    "token_id",
    "text",
    "special",
    "bin",
    "pi_old",
    "advantage",
    "group",
    "share",
    "dpi_cf",
    "dpi_real",
    "head_ratio",
    "log_rho",
    "is_weight",
)
BASE_QUANTITIES = (  # key, label, kind; a key is shown where the run has a value for it
    ("pi_old", "π_old (its bin)", "bins"),
    ("advantage", "advantage A", "signed"),
    ("share", "update share s_t", "signed"),
    ("dpi_cf", "Δπ, counterfactual update", "signed"),
    ("dpi_real", "Δπ, real update", "signed"),
    ("dir_cf", "direction of the counterfactual Δπ", "direction"),
    ("dir_real", "direction of the real Δπ", "direction"),
    ("group", "Lopti group", "group"),
    ("head_ratio", "own gradient ||∂log π/∂h|| / (1 − π)", "sequential"),
    ("log_rho", "sampler mismatch log ρ = log π_old − log μ", "signed"),
    ("is_weight", "importance weight the loss applied", "sequential"),
)


# significant digits kept in the page, which are the digits the hover shows: each number is rounded once, from the
# record's value (rounding to 6 here and to 4 in the hover showed 0.30424954 as 0.3043)
DIGITS = 4


def _clean(values: list) -> list:
    """Floats to DIGITS significant digits, the hover's (its `fmt` prints such a number exactly: no second
    rounding); JSON has no NaN or infinity: those become null (shown as "–")."""
    return [
        (float(f"{v:.{DIGITS}g}") if math.isfinite(v) else None) if isinstance(v, float) else v
        for v in values
    ]


def _scale(values: list) -> float | None:
    xs = sorted(abs(v) for v in values if v is not None and math.isfinite(v))
    if not xs:
        return None
    top = xs[min(len(xs) - 1, int(SCALE_QUANTILE * (len(xs) - 1) + 0.5))]
    return top if top > 0 else xs[-1] or 1.0


def quantities(tokens: pl.DataFrame, rules: pl.DataFrame | None) -> list[dict]:
    """The quantities one run's records allow, each with its colour scale."""
    out = []
    for key, label, kind in BASE_QUANTITIES:
        source = {"dir_cf": "dpi_cf", "dir_real": "dpi_real"}.get(key, key)
        col = tokens[source]
        if col.null_count() == col.len():
            continue
        q = {"key": key, "label": label, "kind": kind}
        if kind in ("signed", "sequential"):
            q["scale"] = _scale(col.to_list())
        out.append(q)
    if rules is not None and rules.height:
        for rule, mode in rules.select("rule", "mode").unique(maintain_order=True).iter_rows():
            tag = "equal ||Δθ||" if mode == "equal_norm" else "run optimizer"
            key = f"rule:{rule}:{mode}"
            out.append({"key": key, "label": f"Δπ, rule {rule} ({tag})", "kind": "signed", "rule": key})
            if rule != "base":
                out.append(
                    {"key": f"diff:{rule}:{mode}", "label": f"Δπ({rule}) − Δπ(base) ({tag})", "kind": "signed",
                     "rule": key, "base": f"rule:base:{mode}"}
                )  # fmt: skip
    return out


def latest_steps(tokens: pl.DataFrame, budget: int) -> pl.DataFrame:
    """One run's tokens of its latest probed steps that fit in ``budget`` tokens (at least the last step)."""
    sizes = tokens.group_by("step").len().sort("step", descending=True)
    keep, total = [], 0
    for step, n in sizes.iter_rows():
        if keep and total + n > budget:
            break
        keep.append(step)
        total += n
    return tokens.filter(pl.col("step").is_in(keep))


def view_data(records: Records, max_tokens: int | None = None, spike: int | None = None) -> dict:
    """Everything the page shows, as JSON values: per run, its quantities and scales, and per probed step its
    sequences with one array per column (and per compared rule), and its spikes (`view_spikes.run_spikes`).
    ``max_tokens``: at most that many tokens over all runs, each run keeping its latest probed steps within its equal
    part (``trimmed``: run -> (steps kept, steps)). ``open``: the spike token the page opens at (``spike``: that
    spiking step, checked by `view_spikes.check_spike`; default the first), or None without spikes."""
    check_spike(records.get("spikes"), spike)
    tokens = records.get("token_view")
    if tokens is None:
        raise MissingRecords("token view", ["token_view"], "train with --probe_view_sequences N (default 4)")
    # a frame from before a column was added (the sampler's) reads it as nulls, as `scan_records` does
    tokens = tokens.with_columns(
        [pl.lit(None, dtype=pl.Float64).alias(c) for c in COLUMNS if c not in tokens.columns]
    )
    all_rules = records.get("token_view_rules")
    runs, trimmed = [], {}
    for label in records.labels:
        t = tokens.filter(pl.col("run") == label).sort("step", "seq", "pos")
        if not t.height:
            continue
        if max_tokens is not None and t.height > max_tokens // len(records.labels):
            n_steps = t["step"].n_unique()
            t = latest_steps(t, max_tokens // len(records.labels))
            trimmed[label] = (t["step"].n_unique(), n_steps)
        n_bins = int(t["bin"].max()) + 1 if t["bin"].max() is not None else 1
        edges = _edges(records, n_bins, label)
        bins = [
            {"lo": lo, "hi": hi, "color": c}
            for (lo, hi), c in zip(edges, _hex(bin_colors(n_bins)), strict=True)
        ]
        r = all_rules.filter(pl.col("run") == label) if all_rules is not None else None
        qs = quantities(t, r)
        rule_cols = {}
        if r is not None and r.height:
            wide = r.with_columns(key=pl.concat_str(pl.lit("rule:"), "rule", pl.lit(":"), "mode"))
            wide = wide.pivot(on="key", index=["step", "seq", "pos"], values="delta_pi")
            t = t.join(wide, on=["step", "seq", "pos"], how="left")
            # the paired differences at full precision (not from the page's rounded values: they cancel)
            t = t.with_columns(
                [(pl.col(q["rule"]) - pl.col(q["base"])).alias(q["key"]) for q in qs if "base" in q]
            )
            rule_cols = [q["key"] for q in qs if "rule" in q]
        for q in qs:  # the scales of the rules' quantities, now that their columns are here
            if "rule" in q:
                q["scale"] = _scale(t[q["key"]].to_list())
        steps = []
        for (step,), s in t.group_by("step", maintain_order=True):
            seqs = []
            for (seq,), q in s.group_by("seq", maintain_order=True):
                cols = {c: _clean(q[c].to_list()) for c in (*COLUMNS, *rule_cols)}
                seqs.append({"seq": int(seq), "pos": q["pos"].to_list(), **cols})
            steps.append({"step": int(step), "seqs": seqs})
        spikes = run_spikes(records.get("spikes"), label, steps, label in trimmed)
        runs.append({"label": label, "quantities": qs, "steps": steps, "bins": bins, "spikes": spikes})
    return {
        "runs": runs,
        "trimmed": trimmed,
        "open": open_at(runs, spike),
        "colors": {"neg": OKABE_ITO[3], "pos": OKABE_ITO[0], "correct": OKABE_ITO[2], "wrong": OKABE_ITO[0],
                   "tie": "#bdbdbd", "low": OKABE_ITO[0], "high": OKABE_ITO[3]},
    }  # fmt: skip


def _hex(colors) -> list[str]:
    from matplotlib.colors import to_hex

    return [to_hex(c) for c in colors]


def _edges(records: Records, n: int, label: str) -> list[tuple[float, float]]:
    """The bins' edges of run ``label``, from its binned records (`prob_change`, `shares` or `token_shares`), else
    n equal ones (runs may bin differently)."""
    for kind in ("prob_change", "shares", "token_shares"):
        df = records.get(kind)
        if df is not None and "bin_lo" in df.columns:
            e = (
                df.filter((pl.col("bin") >= 0) & (pl.col("run") == label))
                .group_by("bin")
                .agg(pl.col("bin_lo").first(), pl.col("bin_hi").first())
            )
            e = {int(b): (float(lo), float(hi)) for b, lo, hi in e.iter_rows()}
            if set(e) >= set(range(n)):
                return [e[b] for b in range(n)]
    return [(b / n, (b + 1) / n) for b in range(n)]


def _json(data: dict) -> str:
    """JSON safe inside <script type="application/json">: "<", ">" and "&" escaped, so no text can close it."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def view_fragment(
    records: Records, max_tokens: int | None = None, spike: int | None = None, scroll: bool = False
) -> str:
    """The view as an HTML section (its data, styles and script inline), the list of the runs' spikes above it;
    ``max_tokens``, ``spike``: as in `view_data`, with a note of the steps left out; ``scroll``: the page scrolls
    to the spike token it opens at and focuses it (the standalone page; a report stays at its top)."""
    data = {**view_data(records, max_tokens, spike), "scroll": scroll}
    note = ""
    if data["trimmed"]:
        kept = "; ".join(
            f"{html.escape(r)}: the last {k} of {n} probed steps" for r, (k, n) in data["trimmed"].items()
        )
        note = (
            f"<p class='tv-meta'>Shown: {kept} (at most {max_tokens:,} tokens here); every step: "
            "<code>tokendyn view RUN_DIR</code>.</p>"
        )
    return (
        f"<style>{CSS}</style><section id='token-view' class='tv' aria-label='token view'>{note}"
        f"{spikes_html(data['runs'], data['open'])}{CONTROLS}</section>"
        f"<script type='application/json' id='tv-data'>{_json(data)}</script><script>{SCRIPT}</script>"
    )


def view_page(records: Records, spike: int | None = None) -> str:
    """The standalone page of `tokendyn view` (``spike``: the spiking step it opens at, default the first)."""
    title = html.escape("tokendyn token view: " + " vs ".join(records.labels))
    return (
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{title}</title>"
        "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; style-src 'unsafe-inline'; "
        "script-src 'unsafe-inline'; img-src data:\">"
        f"<style>body{{font-family:system-ui,sans-serif;max-width:1250px;margin:1.5em auto;padding:0 1em;color:#222}}"
        f"</style></head><body><h1>Which tokens drive the update?</h1>"
        f"{view_fragment(records, spike=spike, scroll=True)}</body></html>"
    )
