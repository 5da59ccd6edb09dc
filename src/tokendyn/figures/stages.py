"""Which of a Lopti run's stages a figure draws, said in its title: read from the rows the figure draws, never
assumed. A Lopti run is one whose records carry stage "low" or "high"; its live records hold both stages of each
probed rollout, while a run recorded before that held its first stage only, and some figures draw one stage by
design (each sampled token counted once) or the whole loss (the analyses' "train" rows)."""

from __future__ import annotations

import textwrap

import polars as pl

from tokendyn.figures.data import LOPTI_STAGES, run_order

# what a drawn stage value is called in the note ("lopti": the analyses' full update, both stages in turn)
WRAP = 64  # characters a line of the note
_NAMES = {"train": "the whole loss", "lopti": "both stages in turn (the full update)"}


def stage_note(drawn: pl.DataFrame | None, source: pl.DataFrame | None = None, column: str = "stage") -> str:
    """ "Lopti stages drawn: RUN: low + high; ..." for each run whose rows in ``source`` (default ``drawn``) carry a
    Lopti stage, naming the values of ``column`` in the rows the figure draws (``drawn``): "low + high", "low
    only", "the whole loss", ...; "" when no run is a Lopti run or a frame lacks the column."""
    source = drawn if source is None else source
    if drawn is None or source is None or column not in drawn.columns or column not in source.columns:
        return ""
    lopti = set(source.filter(pl.col(column).is_in(LOPTI_STAGES)).get_column("run").unique().to_list())
    parts = []
    for run in [r for r in run_order(source) if r in lopti]:
        have = set(drawn.filter(pl.col("run") == run).get_column(column).unique().to_list())
        named = [s for s in LOPTI_STAGES if s in have]
        words = [" + ".join(named) + (" only" if len(named) == 1 else "")] if named else []
        words += [_NAMES.get(s, s) for s in sorted(have - set(LOPTI_STAGES))]
        parts.append(f"{run}: {', '.join(words) or 'none'}")
    return "Lopti stages drawn: " + "; ".join(parts) if parts else ""


def titled(title: str, drawn: pl.DataFrame | None, source: pl.DataFrame | None = None, *, column: str = "stage",
           why: str = "") -> str:  # fmt: skip
    """``title`` with the `stage_note` of the rows it draws below it (and ``why``, when there is a note), wrapped at
    ``WRAP`` characters so that it fits a one-panel figure."""
    note = stage_note(drawn, source, column)
    return f"{title}\n{textwrap.fill(note + (f' ({why})' if why else ''), WRAP)}" if note else title
