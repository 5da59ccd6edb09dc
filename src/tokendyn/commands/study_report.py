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
    at_once: str = "",
    note: str = "",
) -> list[str]:
    """ "What ran and what it cost": the finished runs (``markers``: (method, seed) -> its done marker), their wall
    time in all and the threads per run, then per method (in ``order``) what it is, its finished seeds and its mean
    wall time per run."""
    per_method: dict[str, list] = {}
    for (m, s), w in markers.items():
        per_method.setdefault(m, []).append((s, w))
    total = sum(w.get("wall_time_s", 0.0) for w in markers.values())
    threads = sorted({w.get("threads") for w in markers.values() if w.get("threads")})
    lines = [
        "## What ran and what it cost",
        "",
        f"{len(markers)} finished runs, {total:,.0f} s of wall time in all"
        + (f" ({', '.join(map(str, threads))} thread(s) per run{at_once})" if threads else "")
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
