"""The sweep's tables, guidance and figures from `paired` records built here by hand (no model): the numbers are
ratios of the sums written below, the guidance's value is the argmax of a table whose peak is known, and the
figures draw exactly the tables' numbers."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
import pytest  # noqa: E402
from matplotlib.image import AxesImage  # noqa: E402

from tokendyn.analysis.sweep import best_value, guidance, sweep_summary  # noqa: E402
from tokendyn.figures.axis import sweep_curves  # noqa: E402
from tokendyn.figures.camps import both_camps, camps_table  # noqa: E402
from tokendyn.records import SCHEMAS, to_frame  # noqa: E402

EDGES = (0.0, 0.25, 0.5, 0.75, 1.0)
# top-bin A > 0 tokens that rose, out of 40 decided, per c: the peak is at c = -0.3 in every unit
UP_TOP = {-0.6: 22, -0.3: 30, 0.0: 20, 0.2: 15}


def _rows(units: int = 12) -> pl.DataFrame:
    rows = {c: [] for c in SCHEMAS["paired"]}

    def add(rule, sweep, value, step, seq, b, up, diff):
        r = dict(step=step, rule=rule, mode="equal_norm", seq=seq, bin=b, bin_lo=EDGES[b], bin_hi=EDGES[b + 1],
                 count=50, n_pos=40, n_neg=10, up_pos=up, down_neg=6, tie_pos=0, tie_neg=0, sum_dpi=diff + 0.01,
                 sum_dpi_ref=0.01, sum_diff=diff, sum_diff2=diff * diff, sum_share=0.25 / 3, sum_dentropy=-0.5 * b,
                 sum_kl_ref=abs(value or 0.0), lr=1e-3, param_step=1e-4, norm_ratio=1.0, inner_steps=1, diverged=False,
                 sweep=sweep, sweep_value=value, step_norm=1.0, step_dtype="float64", step_rounding=1e-12,
                 step_resolved=True, no_update=False)  # fmt: skip
        for k, v in r.items():
            rows[k].append(v)

    rng = np.random.default_rng(0)
    for u in range(units):
        step, seq = u // 3, u % 3
        for b in range(4):
            add("base", None, None, step, seq, b, 20, 0.0)
            # reweight raises bin 3 (diff > 0 in every unit), lowers bin 0, leaves the others at noise around 0
            noise = float(rng.normal(0, 1e-3))
            add("reweight", None, None, step, seq, b, 20, {0: -0.02, 3: 0.03}.get(b, noise))
            add("dppo_tv", None, None, step, seq, b, 20, {0: 0.02}.get(b, -noise))
            for c, up in UP_TOP.items():
                if c != 0.0:
                    add(f"c={c:g}", "c", c, step, seq, b, up if b == 3 else 20, 0.0)
    return to_frame("paired", rows)


def test_sweep_summary_is_the_ratio_of_the_written_sums():
    table = sweep_summary(_rows(), "c", n_boot=200)
    top = table.filter(pl.col("bin") == 3).sort("value")
    assert top["value"].to_list() == [-0.6, -0.3, 0.0, 0.2]  # the base rule stands for c = 0
    assert top["correct_pos"].to_list() == pytest.approx([UP_TOP[c] / 40 for c in (-0.6, -0.3, 0.0, 0.2)])
    assert top["correct_neg"].to_list() == pytest.approx([0.6] * 4)
    assert top["dentropy"].to_list() == pytest.approx([-1.5 / 50] * 4)
    assert top["kl"].to_list() == pytest.approx([0.6 / 50, 0.3 / 50, 0.0, 0.2 / 50])
    assert top["share"].to_list() == pytest.approx([0.25] * 4)  # 3 sequences of 1/12 per step
    every = table.filter(pl.col("bin") == -1)
    assert every["tokens"].to_list() == [12 * 4 * 50] * 4


def test_guidance_is_the_argmax_with_its_interval():
    assert best_value([-0.6, -0.3, 0.0, 0.2], [0.5, 0.75, 0.5, 0.75]) == -0.3  # ties: the first
    assert best_value([-0.6, -0.3, 0.0, 0.2], [0.5, 0.75, 0.5, 0.75], prefer=0.0) == 0.2  # ... or nearest 0
    assert best_value([-0.6, -0.3, 0.0, 0.2], [0.5] * 4, prefer=0.0) == 0.0  # every c tied: no direction
    assert np.isnan(best_value([0.0, 1.0], [np.nan, np.nan]))
    g = guidance(_rows(), "c", n_boot=200).row(0, named=True)
    assert (g["best"], g["best_lo"], g["best_hi"]) == (-0.3, -0.3, -0.3)  # the peak is in every unit
    assert g["tied"] == 1
    # every c with the same top-bin counts (as on SmolLM2's grpo_camps states): all tie, c* = 0 [0, 0], no direction
    flat = _rows().with_columns(
        pl.when(pl.col("bin") == len(EDGES) - 2).then(30).otherwise(pl.col("up_pos")).alias("up_pos")
    )
    t = guidance(flat, "c", n_boot=200).row(0, named=True)
    assert t["tied"] == 4 and (t["best"], t["best_lo"], t["best_hi"]) == (0.0, 0.0, 0.0)
    assert g["peak"] == pytest.approx(30 / 40) and g["at"] == 0.0 and g["at_value"] == pytest.approx(0.5)
    assert g["values"] == "-0.6,-0.3,0,0.2"
    # moved: the top-bin peak shifted to c = 0.2 in half of the units -> the argmax spreads over both
    frame = _rows()
    shift = (pl.col("rule") == "c=0.2") & (pl.col("bin") == 3) & (pl.col("seq") < 2)
    moved = frame.with_columns(pl.when(shift).then(40).otherwise(pl.col("up_pos")).alias("up_pos"))
    g = guidance(moved, "c", n_boot=400).row(0, named=True)
    assert g["best"] == 0.2 and g["best_lo"] == -0.3 and g["best_hi"] == 0.2


def test_both_camps_figure_draws_the_table_with_the_interval_signs():
    frame = _rows().with_columns(pl.lit("run A").alias("run"))
    table = camps_table(frame)
    assert table["camp"].unique(maintain_order=True).to_list() == ["tames", "protects"]
    rw = table.filter(pl.col("rule") == "reweight").sort("bin")
    assert rw["diff"][0] == pytest.approx(-0.02 / 50) and rw["diff"][3] == pytest.approx(0.03 / 50)
    assert rw["diff_side"].to_list()[0] == "< 0" and rw["diff_side"].to_list()[3] == "> 0"
    fig = both_camps(frame)
    images = [a for a in fig.findobj(AxesImage)]
    grid = np.asarray(images[0].get_array())
    assert grid.shape == (2, 4)  # rows: reweight (tames), dppo_tv (protects)
    want = [table.filter(pl.col("rule") == r).sort("bin")["diff"].to_list() for r in ("reweight", "dppo_tv")]
    assert np.allclose(grid, want, rtol=0, atol=1e-15)
    marks = [t.get_text() for t in fig.axes[0].texts]
    assert marks[0] == "▼" and marks[3] == "▲" and marks[4] == "▲"
    matplotlib.pyplot.close(fig)


def test_sweep_figure_draws_the_summary():
    frame = _rows().with_columns(pl.lit("run A").alias("run"))
    fig = sweep_curves(frame)
    ax = fig.axes[0]  # correct ratio of A > 0, one line per bin
    top = [line for line in ax.get_lines() if line.get_label().startswith("π_old ∈ [0.75")][0]
    assert list(top.get_xdata()) == [-0.6, -0.3, 0.0, 0.2]
    assert np.allclose(top.get_ydata(), [UP_TOP[c] / 40 for c in (-0.6, -0.3, 0.0, 0.2)])
    matplotlib.pyplot.close(fig)


def test_study_reports_both_camps_and_the_guidance_from_the_grpo_runs(tmp_path):
    from tokendyn.commands.study import QUICK, study_markdown
    from tokendyn.commands.study_report import both_camps_section
    from tokendyn.records import write_frames

    for seed in QUICK.seeds:  # two seeds' GRPO runs: the same records, steps kept apart per seed
        write_frames(tmp_path / "runs" / f"grpo-s{seed}", {"paired": _rows(6)}, rank=0)
    camps, guide, figs = both_camps_section({s: tmp_path / "runs" / f"grpo-s{s}" for s in QUICK.seeds})
    assert set(camps["rule"]) == {"reweight", "dppo_tv"} and guide["best"][0] == -0.3
    assert guide["units"][0] == 2 * 6  # every seed's (step, sequence) a unit of its own
    (tmp_path / "figures").mkdir()
    written = [f(tmp_path / "figures") for f in figs]
    assert [p.name for p in written] == ["both_camps.png", "axis.png"] and all(
        p.stat().st_size > 0 for p in written
    )
    empty = pl.DataFrame()
    text = study_markdown(QUICK, empty, empty, empty, [], None, None, camps, guide)
    assert "## Both camps from the same states" in text and "## Guidance along the axis" in text


def test_paired_intervals_do_not_depend_on_the_order_of_the_rows():
    """The both-camps table's intervals are a report's committed numbers: the same records in another order (as
    shards are read, as group_by returns them) give the same resamples, so the same intervals (to the rounding of
    sums taken in another order; before, each (mode, bin) drew from the shared generator in whatever order group_by
    returned them, and a report regenerated from the same files moved its intervals in the third digit)."""
    from tokendyn.analysis.paired import paired_summary

    frame = _rows(6)
    keys = ["rule", "mode", "bin"]
    want = paired_summary(frame, n_boot=200).sort(keys)
    for seed in (1, 2, 3):
        shuffled = frame.sample(fraction=1.0, shuffle=True, seed=seed)
        got = paired_summary(shuffled, n_boot=200).sort(keys)
        assert got.select(keys).equals(want.select(keys))
        for c in want.columns:
            if want[c].dtype.is_float():
                assert np.allclose(
                    got[c].to_numpy(), want[c].to_numpy(), rtol=1e-12, atol=1e-15, equal_nan=True
                ), c
