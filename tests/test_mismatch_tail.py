"""The histogram of log rho per pi_old bin and the ratio's tail at the correction's thresholds
(`tokendyn.analysis.mismatch_tail`) against plain Python loops over synthetic tokens whose cells are known, edge
tokens included; `tokendyn analyze` on a committed vLLM run lists both tables."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
import pytest  # noqa: E402

from tokendyn.analysis.mismatch_tail import (  # noqa: E402
    LOG_RHO_EDGES,
    N_CELLS,
    cell_of,
    correction_thresholds,
    mismatch_hist,
    mismatch_tail,
)
from tokendyn.common import UsageError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VLLM_RUNS = ROOT / "docs" / "study" / "llm-vllm" / "runs"
PI_EDGES = (0.0, 0.25, 0.5, 0.75, 1.0)
# the edges written out by hand (not imported): the reference does not share the module's constants
HAND_EDGES = [-3, -1, -0.3, -0.1, -0.03, -0.01, -0.003, -0.001, -3e-4, -1e-4,
              1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1, 3]  # fmt: skip
TRL = {
    "use_vllm": True,
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "token_mask",
}


def ref_bin(p: float) -> int:
    """[0, .25), [.25, .5), [.5, .75), [.75, 1]: a loop over the edges, the last closed."""
    for b in range(4):
        if p < PI_EDGES[b + 1]:
            return b
    return 3


def ref_cell(x: float) -> int | None:
    """The first hand edge above x, else the last cell; None for NaN."""
    if math.isnan(x):
        return None
    for k, e in enumerate(HAND_EDGES):
        if x < e:
            return k
    return len(HAND_EDGES)


def sampler(pi: list[float], log_rho: list[float]) -> pl.DataFrame:
    n = len(pi)
    logp_old = [math.log(p) for p in pi]
    return pl.DataFrame(
        {"step": [0] * n, "stage": ["train"] * n, "rank": [0] * n, "micro": [0] * n, "row": list(range(n)),
         "pos": [0] * n, "logp_old": logp_old, "logp_sampler": [o - r for o, r in zip(logp_old, log_rho, strict=True)],
         "log_rho": log_rho, "is_weight": [1.0] * n, "seq_masked": [False] * n},
        schema_overrides={"row": pl.Int32, "pos": pl.Int32, "rank": pl.Int32, "micro": pl.Int32},
    )  # fmt: skip


# tokens on every kind of edge: on a log-rho edge (it belongs to the cell above), 0, the outer edges, +-inf, NaN;
# pi_old = 1 (the last bin, closed); no token in [0.5, 0.75) (an empty bin)
EDGE_TOKENS = [
    (0.1, 1e-4), (0.1, -1e-4), (0.1, 0.0), (0.1, -3.0), (0.1, 3.0), (0.1, -math.inf), (0.3, math.inf),
    (0.3, 2.9999), (0.3, -3.0001), (0.3, float("nan")), (1.0, 0.0), (1.0, -0.1), (0.9, 0.1), (0.9, math.log(1.1)),
    (0.9, -math.log(1.1)), (0.9, 0.0954), (0.8, -0.0954),
]  # fmt: skip


def test_the_edges_are_the_stated_ones():
    assert list(LOG_RHO_EDGES) == HAND_EDGES and N_CELLS == 21
    assert [cell_of(x) for x in (-math.inf, -3.0, 1e-4, 0.0, 3.0, math.inf)] == [0, 1, 11, 10, 20, 20]
    assert cell_of(float("nan")) is None and cell_of(None) is None


def _check_hist(pi, rho):
    table = mismatch_hist(sampler(pi, rho))
    bins = [ref_bin(math.exp(math.log(p))) for p in pi]
    for b in range(-1, 4):
        mine = [r for r, k in zip(rho, bins, strict=True) if b < 0 or k == b]
        rows = table.filter(pl.col("bin") == b)
        assert rows["count"].sum() == len(mine), b  # no token dropped
        expect = {}
        for x in mine:
            expect[ref_cell(x)] = expect.get(ref_cell(x), 0) + 1
        for r in rows.iter_rows(named=True):
            assert r["count"] == expect.get(r["cell"], 0), (b, r["cell"])
            assert r["share"] == (pytest.approx(r["count"] / len(mine)) if mine else None)
        assert rows.filter(pl.col("cell").is_not_null()).height == 21
        assert (rows["cell"].null_count() == 1) == (None in expect)
    return table


def test_histogram_edge_tokens_against_a_plain_loop():
    pi, rho = zip(*EDGE_TOKENS, strict=True)
    table = _check_hist(list(pi), list(rho))
    cells = table.filter(pl.col("bin") == 0).filter(pl.col("count") > 0)
    got = {(r["edge_lo"], r["edge_hi"]): r["count"] for r in cells.iter_rows(named=True)}
    assert got == {
        (1e-4, 3e-4): 1,
        (-1e-4, 1e-4): 2,
        (-math.inf, -3.0): 1,
        (-3.0, -1.0): 1,
        (3.0, math.inf): 1,
    }
    empty = table.filter(pl.col("bin") == 2)
    assert empty["count"].sum() == 0 and empty["share"].null_count() == empty.height  # no tokens: no share
    undefined = table.filter((pl.col("bin") == 1) & pl.col("cell").is_null())
    assert undefined["count"].to_list() == [1] and undefined["edge_lo"].to_list() == [None]


@pytest.mark.parametrize("seed", [0, 1])
def test_histogram_random_tokens_against_a_plain_loop(seed):
    rng = np.random.default_rng(seed)
    pi = rng.uniform(0.01, 1.0, 800).tolist()
    rho = (rng.standard_normal(800) * 10.0 ** rng.uniform(-5, 0.7, 800)).tolist()
    _check_hist(pi, rho)


def ref_tail(rho: list[float], hi: float | None, lo: float | None) -> tuple[int, float | None, float | None]:
    """(n, share with log rho > hi, share with log rho < lo) in log space; a side without its bound None."""
    xs = [x for x in rho if not math.isnan(x)]
    above = sum(1 for x in xs if x > hi) / len(xs) if hi is not None else None
    return len(xs), above, (sum(1 for x in xs if x < lo) / len(xs) if lo is not None else None)


def test_tail_against_a_plain_loop_at_every_threshold():
    rng = np.random.default_rng(3)
    pi = [p for p, _ in EDGE_TOKENS] + rng.uniform(0.01, 1.0, 500).tolist()
    rho = [r for _, r in EDGE_TOKENS] + (rng.standard_normal(500) * 0.8).tolist()
    config = {**TRL, "vllm_importance_sampling_clip_max": 3.0, "vllm_importance_sampling_clip_min": 0.5}
    table = mismatch_tail(sampler(pi, rho), config)
    assert table["source"].unique(maintain_order=True).to_list() == ["fixed", "clip_max", "clip_min"]
    assert table.filter(pl.col("source") == "clip_min")["tau"].unique().to_list() == [0.5]  # never folded
    assert table["mode"].drop_nulls().unique().to_list() == ["token_mask"]
    bins = [ref_bin(math.exp(math.log(p))) for p in pi]
    for r in table.iter_rows(named=True):
        mine = [x for x, k in zip(rho, bins, strict=True) if r["bin"] < 0 or k == r["bin"]]
        if not mine:
            continue
        t = math.log(1.1)
        hi, lo = {"fixed": (t, -t), "clip_max": (math.log(3.0), None), "clip_min": (None, math.log(0.5))}[
            r["source"]
        ]
        n, above, below = ref_tail(mine, hi, lo)
        assert (r["count"], r["above"], r["below"]) == (n, pytest.approx(above), pytest.approx(below))
        assert r["outside"] == pytest.approx(sum(v for v in (above, below) if v is not None))


def test_a_token_exactly_on_the_band_is_inside():
    t = math.log(1.1)
    table = mismatch_tail(sampler([0.9, 0.9, 0.9, 0.9], [t, -t, math.nextafter(t, 1), -math.nextafter(t, 1)]))
    row = table.filter((pl.col("bin") == 3) & (pl.col("source") == "fixed")).row(0, named=True)
    assert (row["above"], row["below"]) == (0.25, 0.25)  # strict: rho > tau, rho < 1/tau


@pytest.mark.parametrize(
    "config, note",
    [
        (None, "no correction threshold recorded"),
        ({"lr": 1e-3}, "no correction threshold recorded"),
        ({**TRL, "vllm_importance_sampling_correction": False}, "the correction is off"),
        ({**TRL, "use_vllm": False}, "the correction is off"),
        ({**TRL, "vllm_importance_sampling_clip_max": None}, "clip_max and clip_min unset"),
    ],
)
def test_no_recorded_threshold_is_null_and_says_so(config, note):
    table = mismatch_tail(sampler([0.1, 0.9], [0.5, -0.01]), config)
    corr = table.filter(pl.col("source") == "correction")
    assert corr.height == 5 and corr["tau"].null_count() == 5 and corr["above"].null_count() == 5
    assert all(note in n for n in corr["note"])
    fixed = table.filter(pl.col("source") == "fixed")
    # the bins with tokens have the fixed band, the empty bins no share
    assert fixed.filter(pl.col("count") > 0)["above"].null_count() == 0
    assert fixed.filter(pl.col("count") == 0)["above"].null_count() == 2


def test_the_deprecated_cap_is_read_and_bad_values_name_the_field():
    rows = correction_thresholds(
        {**TRL, "vllm_importance_sampling_clip_max": None, "vllm_importance_sampling_cap": 2.5}
    )
    assert [(r["source"], r["tau"]) for r in rows] == [("fixed", 1.1), ("clip_max", 2.5)]
    for bad in ("3", -1.0, 0.0, math.inf, True):
        with pytest.raises(UsageError, match="vllm_importance_sampling_clip_max") as err:
            correction_thresholds({**TRL, "vllm_importance_sampling_clip_max": bad})
        assert "\n" not in str(err.value)
    with pytest.raises(UsageError, match="vllm_importance_sampling_mode"):
        correction_thresholds({**TRL, "vllm_importance_sampling_mode": 3})


def test_no_records_no_tables():
    assert mismatch_hist(pl.DataFrame()).height == 0 and mismatch_tail(pl.DataFrame()).height == 0


def test_analyze_on_a_committed_vllm_run_lists_the_new_tables(tmp_path, capsys):
    """`tokendyn analyze` on a copy of a committed vLLM run: the histogram's counts are the `mismatch` table's per
    bin, the tail has the run's recorded clip_max (3, sequence_mask), and the four tables are written and named."""
    from tokendyn.cli import main

    run = tmp_path / "run"
    shutil.copytree(VLLM_RUNS / "grpo_vllm_bf16-s0", run, ignore=shutil.ignore_patterns("analysis"))
    assert main(["analyze", str(run)]) == 0
    out = capsys.readouterr().out
    for name in ("mismatch_hist", "mismatch_tail", "mismatch_sign"):
        assert f"{name}.parquet" in out and (run / "analysis" / f"{name}.parquet").is_file()
    assert "Histogram of log rho per pi_old bin" in out and "The ratio's tail" in out
    hist, mismatch = (
        pl.read_parquet(run / "analysis" / f"{n}.parquet") for n in ("mismatch_hist", "mismatch")
    )
    per_bin = hist.group_by("bin").agg(pl.col("count").sum()).sort("bin")
    ref = mismatch.filter(pl.col("side") == "pi_old").select("bin", "count").sort("bin")
    assert (
        per_bin.join(ref, on="bin", suffix="_ref")
        .select((pl.col("count") == pl.col("count_ref")).all())
        .item()
    )
    tail = pl.read_parquet(run / "analysis" / "mismatch_tail.parquet")
    clip = tail.filter(pl.col("source") == "clip_max")
    assert clip["tau"].unique().to_list() == [3.0] and clip["mode"].unique().to_list() == ["sequence_mask"]


def test_analyze_of_a_run_without_the_correction_says_so():
    from tokendyn.analysis.report import analyze_run

    tables = analyze_run(VLLM_RUNS / "grpo_vllm_bf16_raw-s0", write=False)
    corr = tables["mismatch_tail"].filter(pl.col("source") == "correction")
    assert corr.height and corr["tau"].null_count() == corr.height
    assert corr["note"].str.starts_with("the correction is off").all()


def test_the_histogram_figure_draws_a_sampler_and_a_floor_alone():
    from tokendyn.figures.data import MissingRecords
    from tokendyn.figures.sampler_hist import log_rho_histograms, position, reading

    rng = np.random.default_rng(5)
    s = sampler(rng.uniform(0.01, 1, 300).tolist(), (rng.standard_normal(300) * 0.05).tolist())
    floor = s.with_columns(pl.col("log_rho") * 1e-6).with_columns(pl.lit("B").alias("run"))
    fig = log_rho_histograms(s.with_columns(pl.lit("A").alias("run")), floor)
    assert len(fig.axes) == 4 and all(ax.get_yscale() == "log" for ax in fig.axes)
    matplotlib.pyplot.close(fig)
    fig = log_rho_histograms(None, floor)  # a run sampled by generate: its floor alone
    matplotlib.pyplot.close(fig)
    with pytest.raises(MissingRecords):
        log_rho_histograms(None, None)
    assert position(1e-4) == 11 and position(-3.0) == 1 and position(0.0) == pytest.approx(10.5)
    assert "outside [1/1.1, 1.1]" in reading({"sampler": s.with_columns(pl.lit("A").alias("run"))})


def test_the_per_bin_figure_draws_from_the_same_records_and_refuses_none():
    from tokendyn.figures.data import MissingRecords
    from tokendyn.figures.sampler import mismatch_by_bin

    rng = np.random.default_rng(6)
    s = sampler(rng.uniform(0.01, 1, 300).tolist(), (rng.standard_normal(300) * 0.05).tolist())
    floor = s.with_columns(pl.col("log_rho") * 1e-6)
    for pair in ((s, floor), (None, floor), (s, None)):
        matplotlib.pyplot.close(mismatch_by_bin(*pair))
    with pytest.raises(MissingRecords):
        mismatch_by_bin(None, None)
    with pytest.raises(MissingRecords):
        mismatch_by_bin(s.head(0), None)  # an empty frame is no records


def test_a_tick_on_an_edge_sits_on_that_edge_and_the_reading_says_what_it_counts():
    """`position` maps edge k (0-based, the hand list) to k + 1 (cell k + 1 starts there), the last edge to
    len(edges) like the first to 1; the reading counts log rho < -1 or >= 1 and says so."""
    from tokendyn.figures.sampler_hist import position, reading

    for k, e in enumerate(HAND_EDGES):
        assert position(float(e)) == pytest.approx(k + 1), e
    assert position(-10.0) == 0.5 and position(10.0) == 20.5  # inside the open outer cells
    rho = [-1.0, math.nextafter(-1.0, 0), 1.0, math.nextafter(1.0, 0), 5.0, -5.0]
    text = reading({"sampler": sampler([0.5] * len(rho), rho).with_columns(pl.lit("A").alias("run"))})
    assert "3 token(s) with log ρ < −1 or ≥ 1" in text and "|log ρ| ≥ 1" not in text


def _one_sided(rho: list[float], bound: float, side: str) -> float:
    """The share of the tokens with rho > bound (side "above") or rho < bound ("below"), by a plain loop."""
    xs = [math.exp(x) for x in rho if not math.isnan(x)]
    return sum(1 for r in xs if (r > bound if side == "above" else r < bound)) / len(xs)


def test_a_clip_max_below_one_counts_rho_above_it_not_its_inverse():
    rho = [math.log(r) for r in (0.7, 0.79, 0.81, 0.9, 1.0, 1.2, 1.3)]
    table = mismatch_tail(sampler([0.9] * len(rho), rho), {**TRL, "vllm_importance_sampling_clip_max": 0.8})
    row = table.filter((pl.col("source") == "clip_max") & (pl.col("bin") == -1)).row(0, named=True)
    assert row["tau"] == 0.8 and row["above"] == pytest.approx(
        _one_sided(rho, 0.8, "above")
    ) == pytest.approx(5 / 7)
    assert row["below"] is None and row["outside"] == pytest.approx(5 / 7)  # a clip_max row has no lower side


def test_clip_min_zero_is_no_lower_bound_and_each_clip_row_is_one_sided():
    rng = np.random.default_rng(7)
    pi, rho = rng.uniform(0.01, 1.0, 400).tolist(), (rng.standard_normal(400) * 0.6).tolist()
    zero = {**TRL, "vllm_importance_sampling_clip_max": 3.0, "vllm_importance_sampling_clip_min": 0.0}
    assert [r["source"] for r in correction_thresholds(zero)] == [
        "fixed",
        "clip_max",
    ]  # accepted: no lower bound
    assert mismatch_tail(sampler(pi, rho), zero)["source"].unique(maintain_order=True).to_list() == [
        "fixed",
        "clip_max",
    ]
    only_zero = {**TRL, "vllm_importance_sampling_clip_max": None, "vllm_importance_sampling_clip_min": 0}
    corr = mismatch_tail(sampler(pi, rho), only_zero).filter(pl.col("source") == "correction")
    assert corr.height == 5 and corr["tau"].null_count() == 5 and "no lower bound" in corr["note"][0]
    both = {**TRL, "vllm_importance_sampling_clip_max": 2.0, "vllm_importance_sampling_clip_min": 0.6}
    table = mismatch_tail(sampler(pi, rho), both).filter(pl.col("bin") == -1)
    hi, lo = (table.filter(pl.col("source") == s).row(0, named=True) for s in ("clip_max", "clip_min"))
    assert (
        hi["tau"] == 2.0
        and hi["below"] is None
        and hi["above"] == pytest.approx(_one_sided(rho, 2.0, "above"))
    )
    assert (
        lo["tau"] == 0.6
        and lo["above"] is None
        and lo["below"] == pytest.approx(_one_sided(rho, 0.6, "below"))
    )
    fixed = table.filter(pl.col("source") == "fixed").row(0, named=True)  # the fixed band stays symmetric
    assert fixed["above"] == pytest.approx(_one_sided(rho, 1.1, "above"))
    assert fixed["below"] == pytest.approx(_one_sided(rho, 1 / 1.1, "below"))
