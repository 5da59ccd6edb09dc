"""The spikes in the token view: each recorded spike (`spikes` records, `tokendyn.effects.spike`) as a list of its
top tokens, each placed in the view (its step, sequence and token index) or said not to be there, and the token the
page opens at.

A spike's token is at (step, seq, pos) of the probed step's analysis sample; the view holds the first
``probe_view_sequences`` sequences of the same sample (`tokendyn.effects.token_view`), so the token is in the view iff
that step is on the page, its sequence is among the view's, and its position is one of that sequence's scored tokens.
The page opens at the chosen spike (default: the first, by step, of the first run that has one) at its top token
found in the view (rank 1 where it is there).
"""

from __future__ import annotations

import html
import math

import polars as pl

TOKEN_COLUMNS = ("rank", "text", "pi_old", "advantage", "log_rho", "bin", "seq", "pos", "share")


class SpikeChoiceError(ValueError):
    """``--spike`` names no recorded spike."""


def spiking_steps(spikes: pl.DataFrame | None) -> list[int]:
    """The steps of the recorded spikes, sorted (each once)."""
    if spikes is None or not spikes.height:
        return []
    return sorted(set(spikes["step"].to_list()))


def check_spike(spikes: pl.DataFrame | None, step: int | None) -> None:
    """A one-line error (`SpikeChoiceError`) when ``step`` is not a spiking step of the runs (None: no choice)."""
    if step is None:
        return
    steps = spiking_steps(spikes)
    allowed = ", ".join(map(str, steps)) if steps else "none (the runs have no `spikes` records)"
    if step not in steps:
        raise SpikeChoiceError(f"--spike must be a spiking step of the runs ({allowed}), got {step}")


def place(
    steps: list[dict], step: int, seq: int, pos: int, trimmed: bool
) -> tuple[list[int] | None, str | None]:
    """Where token (step, seq, pos) is in one run's view data (`view.view_data`'s ``steps``): ([step index, seq,
    token index], None), or (None, why it is not there)."""
    at = next((i for i, s in enumerate(steps) if s["step"] == step), None)
    if at is None:
        why = (
            "left out of this page (only the latest steps are shown)" if trimmed else "no token view recorded"
        )
        return None, f"not in the view: step {step} has {why}"
    seqs = {s["seq"]: s for s in steps[at]["seqs"]}
    if seq not in seqs:
        kept = ", ".join(map(str, sorted(seqs))) or "none"
        return None, f"not in the view: sequence {seq} is not among the view's sampled sequences ({kept})"
    if pos not in seqs[seq]["pos"]:
        return None, f"not in the view: position {pos} is not a recorded token of sequence {seq}"
    return [at, seq, seqs[seq]["pos"].index(pos)], None


def _value(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x


def run_spikes(spikes: pl.DataFrame | None, label: str, steps: list[dict], trimmed: bool) -> list[dict]:
    """Run ``label``'s spikes, first step first: trigger, ratio, k, and its tokens by rank, each with ``at`` (its
    place, `place`) or ``missing`` (why it is not in the view)."""
    if spikes is None or not spikes.height:
        return []
    mine = spikes.filter(pl.col("run") == label) if "run" in spikes.columns else spikes
    out = []
    for (step, stage), g in mine.sort("step", "rank").group_by(["step", "stage"], maintain_order=True):
        first = g.row(0, named=True)
        tokens = []
        for row in g.select(TOKEN_COLUMNS).iter_rows(named=True):
            at, why = place(steps, int(step), int(row["seq"]), int(row["pos"]), trimmed)
            tokens.append({**{k: _value(v) for k, v in row.items()}, "at": at, "missing": why})
        out.append({"step": int(step), "stage": stage, "trigger": first["trigger"],
                    "ratio": _value(first["trigger_ratio"]), "k": _value(first["k"]), "tokens": tokens})  # fmt: skip
    return out


def open_at(runs: list[dict], step: int | None = None) -> dict | None:
    """The token the page opens at: {run, spike, step, at} of spike ``step`` (default: the first spike) in the first
    run that has it, at its first token found in the view (``at`` None where none is: the page then opens at that
    step if it is shown, else as without spikes). None without spikes."""
    for r, run in enumerate(runs):
        for s, spike in enumerate(run.get("spikes", [])):
            if step is not None and spike["step"] != step:
                continue
            at = next((t["at"] for t in spike["tokens"] if t["at"] is not None), None)
            shown = next((i for i, x in enumerate(run["steps"]) if x["step"] == spike["step"]), None)
            return {"run": r, "spike": s, "step": at[0] if at else shown, "at": at}
    return None


def _num(x) -> str:
    if x is None:
        return "–"
    if isinstance(x, int):
        return str(x)
    return "0" if x == 0 else (f"{x:.1e}" if abs(x) < 1e-2 or abs(x) >= 1e5 else f"{x:.3g}")


def token_item(r: int, token: dict, opened: bool) -> str:
    """One token of a spike as an <li>: a link to its place in the view, or its text and why it is not there."""
    t = html.escape(repr(token["text"]))
    numbers = (
        f" π_old {_num(token['pi_old'])} · A {_num(token['advantage'])} · log ρ {_num(token['log_rho'])} · "
        f"bin {_num(token['bin'])} · share {_num(token['share'])} · sequence {token['seq']}, position {token['pos']}"
    )
    if token["at"] is None:
        return f"<li class='tv-spike-missing'><span>{t}</span>{numbers}: {html.escape(token['missing'])}</li>"
    i, seq, k = token["at"]
    cls = "tv-spike-link tv-spike-open" if opened else "tv-spike-link"
    return (
        f"<li><a class='{cls}' href='#tv-t-{seq}-{k}' data-run='{r}' data-step='{i}' data-seq='{seq}' "
        f"data-k='{k}'>{t}</a>{numbers}</li>"
    )


def spikes_html(runs: list[dict], opened: dict | None) -> str:
    """The list of every run's spikes (empty without any): per spike its trigger and its tokens by rank."""
    parts = []
    for r, run in enumerate(runs):
        for s, spike in enumerate(run.get("spikes", [])):
            how = (
                f"{spike['trigger']} {_num(spike['ratio'])}× its running median (k = {_num(spike['k'])})"
                if spike["trigger"]
                else "no trigger recorded"
            )
            who = f"{html.escape(run['label'])}, " if len(runs) > 1 else ""
            first = opened is not None and (opened["run"], opened["spike"]) == (r, s)
            items = "".join(
                token_item(r, t, first and t["at"] is not None and t["at"] == opened["at"])
                for t in spike["tokens"]
            )
            parts.append(
                f"<div class='tv-spike' data-run='{r}' data-step-value='{spike['step']}'><h3>{who}spike at step "
                f"{spike['step']}: {html.escape(how)}; its top tokens by update share</h3><ol>{items}</ol></div>"
            )
    if not parts:
        return ""
    return "<nav id='tv-spikes' class='tv-spikes' aria-label='spikes'>" + "".join(parts) + "</nav>"
