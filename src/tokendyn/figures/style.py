"""One look for every figure: seaborn theme, a colour per method (the paper's Fig. 3 colours), bin colours."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import matplotlib

matplotlib.use("Agg", force=False)  # figures are files: no display needed

import matplotlib.pyplot as plt  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

# the paper's Fig. 3: GRPO grey, +Reweight orange, +Lopti blue, both green
METHOD_COLORS = {"both": "#2ca02c", "reweight": "#ff7f0e", "lopti": "#1f77b4", "grpo": "#7f7f7f"}
_EXTRA = ["#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#d62728"]
PANEL_W, PANEL_H = 4.6, 3.6  # inches per panel; 100 dpi -> readable at 100 %
DPI = 110


@contextlib.contextmanager
def themed() -> Iterator[None]:
    """Seaborn's whitegrid theme for the figures made inside, without touching global state."""
    with sns.axes_style("whitegrid"), sns.plotting_context("notebook", font_scale=0.95):
        with plt.rc_context({"figure.dpi": DPI, "savefig.dpi": DPI, "axes.titleweight": "bold"}):
            yield


def new_figure(nrows: int = 1, ncols: int = 1, *, w: float = PANEL_W, h: float = PANEL_H, **kw):
    """A figure with nrows x ncols panels of about w x h inches each (axes always a 2-D array)."""
    kw.setdefault("squeeze", False)
    kw.setdefault("layout", "constrained")
    return plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), **kw)


def run_rows(runs: Sequence[str], ncols: int, *, w: float = PANEL_W, h: float = PANEL_H):
    """One row of ncols panels per run, the run's label above its row (one run: a plain grid, no row label).
    Returns (figure, axes [len(runs), ncols])."""
    import numpy as np

    if len(runs) <= 1:
        return new_figure(1, ncols, w=w, h=h)
    fig = plt.figure(figsize=(w * ncols, (h + 0.3) * len(runs)), layout="constrained")
    subs = fig.subfigures(len(runs), 1)
    axes = []
    for sub, run in zip(np.atleast_1d(subs), runs, strict=True):
        row = sub.subplots(1, ncols, squeeze=False)[0]
        sub.suptitle(run, fontweight="bold", fontsize=11, x=0.01, ha="left")
        axes.append(row)
    return fig, np.array(axes)


def method_kind(label: str) -> str:
    low = label.lower()
    rw, lo = "reweight" in low, "lopti" in low
    return "both" if rw and lo else "reweight" if rw else "lopti" if lo else "grpo"


def run_colors(labels: Sequence[str]) -> dict[str, str]:
    """A colour per run: by method (as the paper), further runs of the same method in other colours."""
    used: set[str] = set()
    extra = iter(_EXTRA * 4)
    out = {}
    for lab in labels:
        c = METHOD_COLORS[method_kind(lab)]
        if c in used:
            c = next(extra)
        used.add(c)
        out[lab] = c
    return out


def run_markers(labels: Sequence[str]) -> dict[str, str]:
    """A marker per run, so overlapping lines stay apart (and in grey print)."""
    marks = "osD^vP*X"
    return {lab: marks[i % len(marks)] for i, lab in enumerate(labels)}


# Okabe & Ito's colour-blind-safe set (Color Universal Design): the paper's four bins, low pi to high pi, as
# vermillion, reddish purple, bluish green and blue, apart in hue and lightness for every common colour-vision type
OKABE_ITO = ("#D55E00", "#CC79A7", "#009E73", "#0072B2", "#E69F00", "#56B4E9", "#F0E442", "#000000")


def bin_colors(n: int) -> list:
    """One colour per probability bin, the same in every figure: four bins get four clearly different colour-blind-
    safe colours (Okabe-Ito); up to 8 bins continue that set, more fall back to seaborn's "colorblind" palette."""
    n = max(n, 1)
    if n <= len(OKABE_ITO):
        return list(OKABE_ITO[:n])
    return sns.color_palette("colorblind", n_colors=n)


def offsets(n: int, width: float) -> list[float]:
    """x offsets of n side-by-side items in a group of total ``width``, centred on 0."""
    if n <= 1:
        return [0.0]
    step = width / n
    return [(i - (n - 1) / 2) * step for i in range(n)]


def shade_bins(ax, edge_sets: Sequence[Sequence[float]], alpha: float = 0.5) -> None:
    """Dashed separators at the inner bin edges (the paper's probability-interval grid), drawn only when every run
    has the same edges (one set per run; runs binned differently get no grid rather than a wrong one)."""
    sets = {tuple(round(float(e), 6) for e in sorted(set(es))) for es in edge_sets if len(es)}
    if len(sets) != 1:
        return
    edges = next(iter(sets))
    for e in edges[1:-1]:
        ax.axvline(e, color="0.6", ls="--", lw=0.9, alpha=alpha, zorder=0)


def finish(fig: Figure, title: str | None = None) -> Figure:
    if title:
        fig.suptitle(title, fontsize=13, fontweight="bold")
    return fig


def short_point(point: str) -> str:
    """`layers.3.out` -> `layer 3 output`, `final_norm.out` -> `final norm (LM-head input)`."""
    if point == "final_norm.out":
        return "final norm (LM-head input)"
    if point.startswith("layers.") and point.endswith(".out"):
        return f"layer {point.split('.')[1]} output"
    return point
