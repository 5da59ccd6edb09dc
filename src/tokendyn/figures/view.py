"""The token view: each recorded completion as text, every token coloured by a quantity the reader picks.

`view_page(records)` is a standalone HTML page (`tokendyn view RUN_DIR`); `view_fragment(records)` the same view
as a section of the report. Both read the `token_view` (and `token_view_rules`) records only, and are
self-contained: the data is JSON inside the page, the script and styles are inline, nothing is fetched. The
records' text is data, never markup: the JSON is escaped for a <script> element and the script writes text with
``textContent`` only.

Quantities (`quantities`): π_old by its bin (the figures' bin colours), the advantage A, the update share s_t,
Δπ after the counterfactual and after the real update, the direction of each (correct: Δπ has A's sign; wrong; tie:
Δπ = 0 in float64), Lopti's group, the own-gradient ratio ||∂log π/∂h|| / (1 − π) at the LM head, and per compared
rule its Δπ and the paired difference Δπ(rule) − Δπ(base) at equal ||Δθ||. Signed quantities use one diverging
scale (blue below 0, vermillion above, Okabe-Ito) whose ends are the 99th percentile of |x| over the run's tokens.
"""

from __future__ import annotations

import html
import json
import math

import polars as pl

from tokendyn.figures.data import MissingRecords, Records
from tokendyn.figures.style import OKABE_ITO, bin_colors

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


def view_data(records: Records, max_tokens: int | None = None) -> dict:
    """Everything the page shows, as JSON values: per run, its quantities and scales, and per probed step its
    sequences with one array per column (and per compared rule). ``max_tokens``: at most that many tokens over all
    runs, each run keeping its latest probed steps within its equal part (``trimmed``: run -> (steps kept, steps))."""
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
        runs.append({"label": label, "quantities": qs, "steps": steps, "bins": bins})
    return {
        "runs": runs,
        "trimmed": trimmed,
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


def view_fragment(records: Records, max_tokens: int | None = None) -> str:
    """The view as an HTML section (its data, styles and script inline); ``max_tokens``: as in `view_data`, with a
    note of the steps left out."""
    data = view_data(records, max_tokens)
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
        f"<style>{CSS}</style><section id='token-view' class='tv' aria-label='token view'>{note}{CONTROLS}</section>"
        f"<script type='application/json' id='tv-data'>{_json(data)}</script><script>{SCRIPT}</script>"
    )


def view_page(records: Records) -> str:
    """The standalone page of `tokendyn view`."""
    title = html.escape("tokendyn token view: " + " vs ".join(records.labels))
    return (
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{title}</title>"
        "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; style-src 'unsafe-inline'; "
        "script-src 'unsafe-inline'; img-src data:\">"
        f"<style>body{{font-family:system-ui,sans-serif;max-width:1250px;margin:1.5em auto;padding:0 1em;color:#222}}"
        f"</style></head><body><h1>Which tokens drive the update?</h1>{view_fragment(records)}</body></html>"
    )


CONTROLS = """
<p class='tv-meta'>Each recorded completion of the analysis sample, token by token. Pick what colours the tokens;
hover a token (or focus it and move with the arrow keys) for every number of it. Tokens outside the filters are
dimmed.</p>
<div class='tv-controls'>
<label>run <select id='tv-run'></select></label>
<label>step <select id='tv-step'></select></label>
<label>colour by <select id='tv-quantity'></select></label>
<label>sign of A <select id='tv-sign'><option value='all'>all</option><option value='pos'>A &gt; 0</option>
<option value='neg'>A &lt; 0</option></select></label>
<fieldset id='tv-bins'><legend>bins of π_old</legend></fieldset>
</div>
<div id='tv-legend' class='tv-legend' aria-label='colour scale'></div>
<div id='tv-seqs'></div>
<div id='tv-details' class='tv-details' aria-live='polite'>Hover or focus a token.</div>
<div id='tv-tip' class='tv-tip' role='tooltip' hidden></div>
"""

CSS = """
.tv-controls{display:flex;flex-wrap:wrap;gap:.6em 1.2em;align-items:center;margin:.5em 0}
.tv-controls fieldset{border:1px solid #ddd;padding:.1em .6em;margin:0}
.tv-legend{display:flex;flex-wrap:wrap;gap:.4em 1em;align-items:center;font-size:.85em;margin:.4em 0 .8em 0}
.tv-swatch{display:inline-block;width:1.1em;height:1.1em;border:1px solid #999;vertical-align:middle;margin-right:.3em}
.tv-bar{display:inline-block;width:12em;height:1em;border:1px solid #999;vertical-align:middle;margin:0 .4em}
.tv-seq{border:1px solid #e3e3e3;border-radius:4px;padding:.5em .7em;margin:.6em 0;font-family:ui-monospace,
SFMono-Regular,Menlo,Consolas,monospace;font-size:.88em;line-height:1.9;white-space:pre-wrap;word-break:break-word}
.tv-seq h3{font-family:system-ui,sans-serif;font-size:.85em;margin:0 0 .3em 0;color:#555;font-weight:600}
.tv-tok{border-radius:2px;padding:1px 0;outline-offset:1px;cursor:default}
.tv-tok.tv-dim{opacity:.25}
.tv-tok:focus{outline:2px solid #000}
.tv-tok.tv-special{font-style:italic;border:1px dashed #777}
.tv-ws{color:#888}
.tv-details{font-size:.85em;background:#f7f7f7;border:1px solid #e3e3e3;padding:.4em .7em;min-height:2.4em}
.tv-tip{position:fixed;z-index:10;background:#fff;border:1px solid #888;box-shadow:0 2px 6px rgba(0,0,0,.2);
padding:.4em .6em;font-size:.82em;pointer-events:none;max-width:28em}
.tv-tip table,.tv-details table{border-collapse:collapse;margin:0;display:table}
.tv-tip td,.tv-details td{border:none;padding:0 .6em 0 0;text-align:left;white-space:nowrap}
.tv-meta{color:#666;font-size:.9em}
"""

SCRIPT = r"""
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("tv-data").textContent);
  const $ = (id) => document.getElementById(id);
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const FIELDS = [
    ["token", "token"], ["token_id", "id"], ["pi_old", "π_old"], ["bin", "bin"], ["advantage", "A"],
    ["group", "Lopti group"], ["share", "update share"], ["dpi_cf", "Δπ counterfactual"],
    ["dpi_real", "Δπ real"], ["head_ratio", "own gradient / (1 − π)"], ["log_rho", "log ρ (sampler)"],
    ["is_weight", "IS weight"],
  ];
  const state = { run: 0, step: 0, quantity: null, sign: "all", bins: new Set(data.runs[0].bins.map((_, i) => i)) };

  function fmt(x) {
    if (x === null || x === undefined) return "–";
    if (typeof x !== "number") return String(x);
    if (x === 0) return "0";
    const a = Math.abs(x);
    return a >= 1e-3 && a < 1e5 ? x.toPrecision(4) : x.toExponential(3);
  }
  function hexRgb(h) { return [1, 3, 5].map((i) => parseInt(h.slice(i, i + 2), 16)); }
  function mix(hex, t) {  // white -> hex, t in [0, 1]
    const c = hexRgb(hex);
    return "rgb(" + c.map((v) => Math.round(255 + (v - 255) * t)).join(",") + ")";
  }
  function dark(hex, t) {
    const c = hexRgb(hex).map((v) => 255 + (v - 255) * t);
    return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2] < 140;
  }
  function direction(dpi, a) {
    if (dpi === null || a === null || a === 0) return null;
    if (dpi === 0) return "tie";
    return (dpi > 0) === (a > 0) ? "correct" : "wrong";
  }
  function value(seq, k, q) {
    if (q.kind === "direction") return direction(seq[q.key === "dir_cf" ? "dpi_cf" : "dpi_real"][k], seq.advantage[k]);
    return seq[q.key] ? seq[q.key][k] : null;
  }
  function colour(seq, k, q) {  // [background, dark?]
    const v = value(seq, k, q), C = data.colors;
    if (v === null || v === undefined) return ["transparent", false];
    if (q.kind === "bins") { const c = run().bins[seq.bin[k]].color; return [c, dark(c, 1)]; }
    if (q.kind === "direction") return [C[v], v !== "tie" && dark(C[v], 1)];
    if (q.kind === "group") return [mix(C[v], 0.55), false];
    const s = q.scale || 1;
    if (q.kind === "sequential") { const t = Math.min(1, v / s); return [mix(C.neg, t), dark(C.neg, t)]; }
    const t = Math.max(-1, Math.min(1, v / s)), c = t < 0 ? C.neg : C.pos;
    return [mix(c, Math.abs(t)), dark(c, Math.abs(t))];
  }
  function shown(text, special) {  // whitespace made visible, the text itself kept
    if (special) return text;
    return text.replace(/\n/g, "\u21b5\n").replace(/\t/g, "\u2192\t");
  }

  const run = () => data.runs[state.run];
  const quantity = () => run().quantities.find((q) => q.key === state.quantity) || run().quantities[0];

  function fillSelect(sel, items, current) {
    sel.replaceChildren(...items.map(([v, label]) => {
      const o = el("option", null, label); o.value = v; if (String(v) === String(current)) o.selected = true; return o;
    }));
  }
  function controls() {
    fillSelect($("tv-run"), data.runs.map((r, i) => [i, r.label]), state.run);
    if (state.step >= run().steps.length) state.step = 0;
    fillSelect($("tv-step"), run().steps.map((s, i) => [i, "step " + s.step]), state.step);
    if (!run().quantities.some((q) => q.key === state.quantity)) state.quantity = run().quantities[0].key;
    fillSelect($("tv-quantity"), run().quantities.map((q) => [q.key, q.label]), state.quantity);
  }
  function bins() {
    const box = $("tv-bins");
    box.querySelectorAll("label").forEach((l) => l.remove());
    run().bins.forEach((b, i) => {
      const l = el("label"), c = el("input");
      c.type = "checkbox"; c.checked = state.bins.has(i); c.value = i; c.dataset.bin = i;
      c.addEventListener("change", () => { c.checked ? state.bins.add(i) : state.bins.delete(i); paint(); });
      const sw = el("span", "tv-swatch"); sw.style.background = b.color;
      l.append(c, sw, document.createTextNode("[" + b.lo + ", " + b.hi + (i === run().bins.length - 1 ? "]" : ")") + " "));
      box.append(l);
    });
  }
  function legend() {
    const q = quantity(), L = $("tv-legend"), C = data.colors;
    L.replaceChildren();
    const item = (color, text) => { const s = el("span"), w = el("span", "tv-swatch"); w.style.background = color; s.append(w, document.createTextNode(text)); L.append(s); };
    if (q.kind === "bins") run().bins.forEach((b, i) => item(b.color, "π_old in [" + b.lo + ", " + b.hi + (i === run().bins.length - 1 ? "]" : ")")));
    else if (q.kind === "direction") { item(C.correct, "correct (Δπ has the sign of A)"); item(C.wrong, "wrong"); item(C.tie, "tie (Δπ = 0)"); }
    else if (q.kind === "group") { item(mix(C.low, 0.55), "low (π_old < η)"); item(mix(C.high, 0.55), "high"); }
    else {
      const s = q.scale || 1, bar = el("span", "tv-bar");
      if (q.kind === "sequential") {
        bar.style.background = "linear-gradient(to right, #ffffff, " + C.neg + ")";
        L.append(el("span", null, "0"), bar, el("span", null, fmt(s) + "+"));
      } else {
        bar.style.background = "linear-gradient(to right, " + C.neg + ", #ffffff, " + C.pos + ")";
        L.append(el("span", null, "≤ −" + fmt(s)), bar, el("span", null, "≥ " + fmt(s)));
      }
      L.append(el("span", "tv-meta", q.label + "; ends: the 99th percentile of |x| over this run's tokens"));
    }
  }
  function rows(seq, k) {
    const out = FIELDS.map(([key, label]) => {
      let v = key === "token" ? JSON.stringify(seq.text[k]) : seq[key][k];
      if (key === "token_id") v = String(v);
      if (key === "bin" && v !== null) { const b = run().bins[v]; v = v + " [" + b.lo + ", " + b.hi + ")"; }
      return [label, key, v];
    });
    run().quantities.filter((q) => q.rule).forEach((q) => out.push([q.label, q.key, value(seq, k, q)]));
    return out;
  }
  function table(seq, k) {
    const t = el("table");
    rows(seq, k).forEach(([label, key, v]) => {
      const tr = el("tr"); tr.dataset.key = key;
      tr.append(el("td", null, label), el("td", null, typeof v === "number" ? fmt(v) : v === null ? "–" : String(v)));
      t.append(tr);
    });
    return t;
  }
  function show(span, seq, k, tip) {
    $("tv-details").replaceChildren(el("div", null, "sequence " + seq.seq + ", completion token " + seq.pos[k]), table(seq, k));
    if (!tip) return;
    const t = $("tv-tip"), r = span.getBoundingClientRect();
    t.replaceChildren(table(seq, k));
    t.hidden = false;
    t.style.left = Math.min(r.left, window.innerWidth - 360) + "px";
    t.style.top = (r.bottom + 6 + 220 > window.innerHeight ? Math.max(0, r.top - 226) : r.bottom + 6) + "px";
  }
  function draw() {
    const box = $("tv-seqs"), step = run().steps[state.step];
    box.replaceChildren();
    step.seqs.forEach((seq) => {
      const d = el("div", "tv-seq");
      d.append(el("h3", null, "sequence " + seq.seq + ": " + seq.text.length + " tokens, A = " + fmt(seq.advantage[0])));
      seq.text.forEach((text, k) => {
        const s = el("span", "tv-tok" + (seq.special[k] ? " tv-special" : ""), shown(text, seq.special[k]) || "\u00b7");
        s.tabIndex = k === 0 ? 0 : -1;
        s.dataset.seq = seq.seq; s.dataset.k = k;
        s.addEventListener("mouseenter", () => show(s, seq, k, true));
        s.addEventListener("mouseleave", () => { $("tv-tip").hidden = true; });
        s.addEventListener("focus", () => show(s, seq, k, true));
        s.addEventListener("blur", () => { $("tv-tip").hidden = true; });
        s.addEventListener("keydown", (e) => {
          const to = { ArrowRight: k + 1, ArrowLeft: k - 1, Home: 0, End: seq.text.length - 1 }[e.key];
          if (to === undefined || to < 0 || to >= seq.text.length) return;
          e.preventDefault();
          const next = d.querySelectorAll(".tv-tok")[to];
          s.tabIndex = -1; next.tabIndex = 0; next.focus();
        });
        d.append(s);
      });
      box.append(d);
    });
    paint();
  }
  function paint() {
    const q = quantity(), step = run().steps[state.step];
    const bySeq = new Map(step.seqs.map((s) => [String(s.seq), s]));
    document.querySelectorAll("#tv-seqs .tv-tok").forEach((s) => {
      const seq = bySeq.get(s.dataset.seq), k = +s.dataset.k;
      const [bg, isDark] = colour(seq, k, q);
      s.style.background = bg;
      s.style.color = isDark ? "#ffffff" : "#111111";
      const a = seq.advantage[k];
      const keep = state.bins.has(seq.bin[k]) && (state.sign === "all" || (state.sign === "pos" ? a > 0 : a < 0));
      s.classList.toggle("tv-dim", !keep);
    });
    legend();
  }
  $("tv-run").addEventListener("change", (e) => {
    state.run = +e.target.value; state.step = 0; state.bins = new Set(run().bins.map((_, i) => i));
    controls(); bins(); draw();
  });
  $("tv-step").addEventListener("change", (e) => { state.step = +e.target.value; draw(); });
  $("tv-quantity").addEventListener("change", (e) => { state.quantity = e.target.value; paint(); });
  $("tv-sign").addEventListener("change", (e) => { state.sign = e.target.value; paint(); });
  controls(); bins(); draw();
})();
"""
