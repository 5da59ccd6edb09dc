"""The token view's page assets (`tokendyn.figures.view`): its controls, its styles and its script, all inline
(nothing is fetched). The script writes the records' text with ``textContent`` only."""

from __future__ import annotations

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
.tv-spikes{border:1px solid #e3e3e3;border-left:4px solid #d55e00;padding:.3em .8em;margin:.6em 0;font-size:.88em}
.tv-spikes h3{font-size:.95em;margin:.4em 0 .2em 0}
.tv-spikes ol{margin:.2em 0 .4em 0;padding-left:1.6em}
.tv-spike-missing span{font-family:ui-monospace,monospace}
.tv-spike-link{font-family:ui-monospace,monospace}
.tv-tok.tv-spiked{outline:3px solid #d55e00;outline-offset:1px}
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
  const state = { run: 0, step: 0, quantity: null, sign: "all", bins: new Set(data.runs[0].bins.map((_, i) => i)),
    mark: null };  // mark: [run, step index, seq, token index] of the spike token highlighted
  const open = data.open;
  if (open && open.step !== null) {
    state.run = open.run; state.step = open.step;
    state.bins = new Set(data.runs[open.run].bins.map((_, i) => i));
    if (open.at) state.mark = [open.run, ...open.at];
  }

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
        s.dataset.seq = seq.seq; s.dataset.k = k; s.id = "tv-t-" + seq.seq + "-" + k;
        const m = state.mark;
        if (m && m[0] === state.run && m[1] === state.step && m[2] === seq.seq && m[3] === k) s.classList.add("tv-spiked");
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
  function goTo(mark, focus) {  // a spike token: its run and step shown, the token highlighted, scrolled to
    const [r, step, seq, k] = mark;
    if (r !== state.run) { state.run = r; state.bins = new Set(run().bins.map((_, i) => i)); }
    state.step = step; state.mark = mark;
    controls(); bins(); draw();
    const s = $("tv-t-" + seq + "-" + k);
    if (!s) return;
    s.scrollIntoView({ block: "center" });
    if (focus) {
      document.querySelectorAll("#tv-seqs .tv-tok").forEach((t) => { t.tabIndex = -1; });
      s.tabIndex = 0; s.focus({ preventScroll: true });
    }
  }
  document.querySelectorAll(".tv-spike-link").forEach((a) => a.addEventListener("click", (e) => {
    e.preventDefault();
    goTo([+a.dataset.run, +a.dataset.step, +a.dataset.seq, +a.dataset.k], true);
  }));
  controls(); bins(); draw();
  if (state.mark && data.scroll) goTo(state.mark, true);
})();
"""
