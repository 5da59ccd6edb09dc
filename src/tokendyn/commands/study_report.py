"""What every study's report shares: its files (tables as parquet, figures, study.md written last and atomically),
its markdown sections, the "what ran and what it cost" block read off the runs' done markers, accuracy with its
interval in one cell, and the both-camps comparison and guidance from the GRPO runs' own states. The reports
themselves: `tokendyn.commands.study.write_study` (K&K), `llm_study_report.write_llm_study` (the real LLM),
`sampler_study_report.write_sampler_study` (the real LLM under vLLM)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np


def save_report(
    out: Path, tables: dict, draw: Callable[[Path], list[Path]], text: Callable[[list[Path]], str]
) -> Path:
    """OUT/tables/{name}.parquet for every table with rows, the figures ``draw`` makes in OUT/figures, then
    OUT/study.md from ``text`` given the figures' paths relative to OUT; returns the path of study.md."""
    from tokendyn.common import atomic_write
    from tokendyn.records import write_parquet

    (out / "tables").mkdir(parents=True, exist_ok=True)
    for name, df in tables.items():
        if df.height:
            write_parquet(df, out / "tables" / f"{name}.parquet")
    figs = out / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    body = text([p.relative_to(out) for p in draw(figs)])
    path = out / "study.md"
    atomic_write(path, lambda tmp: Path(tmp).write_text(body))
    return path


def section(title: str, *paragraphs: str, table=None, empty: str | None = None) -> list[str]:
    """A section's markdown lines: its heading, its paragraphs, then the table (or ``empty`` where the table has no
    rows), each followed by a blank line."""
    from tokendyn.analysis.study import markdown

    lines = [f"## {title}", ""]
    for p in paragraphs:
        lines += [p, ""]
    if table is not None and table.height:
        lines += [markdown(table), ""]
    elif empty is not None:
        lines += [empty, ""]
    return lines


def document(lines: list[str], figures: list[Path]) -> str:
    """study.md's text: the lines, then every figure."""
    return "\n".join([*lines, *(f"![{f.stem}]({f.as_posix()})" for f in figures)]) + "\n"


def with_interval(alias: str, value: str = "accuracy"):
    """A polars expression: "estimate [lo, hi]" in one cell, to three decimals."""
    import polars as pl

    return pl.format(
        "{} [{}, {}]", pl.col(value).round(3), pl.col("lo").round(3), pl.col("hi").round(3)
    ).alias(alias)


def cost_section(
    markers: dict[tuple[str, int], dict],
    order,
    what: dict[str, str],
    column: str = "camp",
    note: str = "",
) -> list[str]:
    """ "What ran and what it cost": the finished runs (``markers``: (method, seed) -> its done marker), their wall
    time in all, the threads per run and how many ran at a time (as the markers recorded them: "not recorded"
    where none did), then per method (in ``order``) what it is, its finished seeds and its mean wall time per run."""
    per_method: dict[str, list] = {}
    for (m, s), w in markers.items():
        per_method.setdefault(m, []).append((s, w))
    total = sum(w.get("wall_time_s", 0.0) for w in markers.values())
    threads = sorted({w.get("threads") for w in markers.values() if w.get("threads")})
    at_once = sorted({w.get("runs_at_once") for w in markers.values() if w.get("runs_at_once")})
    lines = [
        "## What ran and what it cost",
        "",
        f"{len(markers)} finished runs, {total:,.0f} s of wall time in all; threads per run: "
        + (", ".join(map(str, threads)) if threads else NOT_RECORDED)
        + "; runs at a time: "
        + (", ".join(map(str, at_once)) if at_once else NOT_RECORDED)
        + f".{note}",
        "",
        f"| method | {column} | seeds | wall s / run |",
        "|---|---|---|---|",
    ]
    for m in [m for m in order if m in per_method]:
        ss = sorted(per_method[m])
        wall = np.mean([w.get("wall_time_s", 0.0) for _, w in ss])
        lines.append(f"| {m} | {what[m]} | {', '.join(str(s) for s, _ in ss)} | {wall:,.0f} |")
    return [*lines, ""]


def guidance_section(guide) -> list[str]:
    """The guidance along the axis through both camps, where the sweep ran."""
    from tokendyn.analysis.sweep import GUIDANCE_RULE

    if guide is None or not guide.height:
        return []
    return section("Guidance along the axis through both camps", GUIDANCE_RULE, table=guide.drop("run"))


def both_camps_section(folders: dict[int, Path]):
    """(both-camps table, guidance table, figure writers) from the `paired` records of the GRPO runs in
    ``folders`` (seed -> run folder: grpo's, or the real-LLM study's grpo_camps), every seed's steps units of their
    own (step + seed * 10**6), the pairing kept: empty when the records hold no rule beyond the paper's (both camps)
    or no sweep (guidance). Set them with overrides, e.g. ``probe_compare_rules``, ``probe_compare_c_sweep``."""
    import polars as pl

    from tokendyn.analysis.load import load
    from tokendyn.figures.axis import axis_tables, sweep_curves
    from tokendyn.figures.camps import both_camps, camps_table
    from tokendyn.figures.data import MissingRecords

    parts = []
    for s, folder in folders.items():
        frame = load(folder, "paired").collect() if folder.is_dir() else pl.DataFrame()
        if frame.height:
            parts.append(frame.with_columns(pl.col("step") + s * 10**6, pl.lit("grpo").alias("run")))
    if not parts:
        return pl.DataFrame(), pl.DataFrame(), []
    paired = pl.concat(parts, how="vertical_relaxed")

    def save(fig, path: Path) -> Path:
        import matplotlib.pyplot as plt

        fig.savefig(path)
        plt.close(fig)
        return path

    camps, guide, figs = pl.DataFrame(), pl.DataFrame(), []
    named = paired.filter(pl.col("sweep").is_null() & ~pl.col("rule").is_in(["base", "reweight", "lopti"]))
    if named.height:
        camps = camps_table(paired)
        figs.append(lambda d: save(both_camps(paired), d / "both_camps.png"))
    try:
        _, guide = axis_tables(paired)
        figs.append(lambda d: save(sweep_curves(paired), d / "axis.png"))
    except MissingRecords:
        pass
    return camps, guide, figs


# ---------------------------------------------------------------- the setup as the runs recorded it
NOT_RECORDED = "not recorded"


def run_records(runs: dict[tuple[str, int], Path]) -> dict[tuple[str, int], dict]:
    """(method, seed) -> the run's run.json ({} where the folder has none: its values read as not recorded)."""
    import json

    return {k: json.loads((d / "run.json").read_text()) if (d / "run.json").is_file() else {}
            for k, d in runs.items()}  # fmt: skip


def recorded(records: dict[tuple[str, int], dict], *path: str, methods=None) -> dict:
    """value -> the methods whose runs recorded it at ``path`` in run.json (e.g. "config", "learning_rate"), over
    the runs of ``methods`` (all if None); a run without the key counts under None."""
    found: dict = {}
    for (m, _), meta in sorted(records.items()):
        if methods is not None and m not in methods:
            continue
        v = meta
        for key in path:
            v = v.get(key) if isinstance(v, dict) else None
        found.setdefault(v if not isinstance(v, list | dict) else str(v), set()).add(m)
    return {v: sorted(ms) for v, ms in found.items()}


def say_recorded(values: dict, fmt=str) -> str:
    """One value's words: the value every run recorded, else the value of most methods followed by each other one
    with its methods ("a; b in m1, m2"); a value no run recorded reads "not recorded"."""

    def word(v):
        return NOT_RECORDED if v is None else fmt(v)

    if not values:
        return NOT_RECORDED
    ranked = sorted(values.items(), key=lambda kv: -len(kv[1]))
    return "; ".join([word(ranked[0][0]), *(f"{word(v)} in {', '.join(ms)}" for v, ms in ranked[1:])])


def trainer_dtype(records: dict[tuple[str, int], dict], methods=None) -> str:
    """The trainer's dtype as its config recorded it: bf16 / fp16 / float32 (neither flag set)."""

    def of(meta: dict):
        c = meta.get("config") or {}
        if "bf16" not in c or "fp16" not in c:
            return None
        return "bf16" if c["bf16"] else "fp16" if c["fp16"] else "float32"

    found: dict = {}
    for (m, _), meta in sorted(records.items()):
        if methods is None or m in methods:
            found.setdefault(of(meta), set()).add(m)
    return say_recorded({v: sorted(ms) for v, ms in found.items()})


def batch_words(records: dict[tuple[str, int], dict]) -> str:
    """ "P prompts x G samples, lr L" from the runs' configs (generation_batch_size / num_generations prompts)."""

    def batch(meta: dict):
        c = meta.get("config") or {}
        g, n = c.get("num_generations"), c.get("generation_batch_size")
        return f"{n // g} prompts x {g} samples" if g and n else None

    found: dict = {}
    for (m, _), meta in sorted(records.items()):
        found.setdefault(batch(meta), set()).add(m)
    sizes = say_recorded({v: sorted(ms) for v, ms in found.items()})
    return f"{sizes}, lr {say_recorded(recorded(records, 'config', 'learning_rate'), lambda v: f'{v:g}')}"


def seed_section(per_seed, final) -> list[str]:
    """Each method's held-out accuracy per training seed at the last rollout (`seeds.seed_accuracy_table`): a low
    baseline seed shows here before it moves every row that subtracts it."""
    if per_seed is None or not per_seed.height:
        return []
    return section(
        f"Accuracy per training seed after {final} rollouts",
        "Each method's held-out accuracy at each seed (– where it has no finished run of that seed) and the mean "
        "over its seeds. Every row below that subtracts a base subtracts these seeds of it; rows pair only the "
        "seeds both methods have.",
        table=per_seed,
    )
