"""Figures and report from the records of real short runs: GRPO, +Reweight and +Lopti on the tiny Qwen2 through the
real TRL trainer with the probe and the rebalancing analyses on (probe_every=1), the real metrics log and held-out
evaluation. No hand-typed numbers."""

from __future__ import annotations

import argparse
import io
import re
import shutil
from html import escape as html_escape
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402
from test_trainer import _config, _trainer  # noqa: E402

from tokendyn import figures as F  # noqa: E402
from tokendyn.analysis import analyze_run, load  # noqa: E402
from tokendyn.common import write_json  # noqa: E402
from tokendyn.figures import cli, readings, tables  # noqa: E402
from tokendyn.figures.data import load_runs  # noqa: E402
from tokendyn.figures.report import FIGURES, build_report  # noqa: E402
from tokendyn.figures.tables import TABLES  # noqa: E402
from tokendyn.trainers.callbacks import HeldoutEvalCallback, ParquetLogCallback  # noqa: E402
from tokendyn.trainers.runner import method_name  # noqa: E402

torch.set_num_threads(1)

METHODS = {"grpo": {}, "reweight": dict(advantage_reweight_alpha=0.3), "lopti": dict(lopti_eta=0.5)}


@pytest.fixture(scope="session")
def run_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Three real runs (4 optimizer steps each) with run.json, metrics.parquet and every record kind."""
    root = tmp_path_factory.mktemp("figure_runs")
    out = {}
    for name, extra in METHODS.items():
        compare = dict(probe_compare_rules=["reweight", "lopti", "logp_reweight"], probe_compare_modes=["equal_norm"],
                       probe_compare_c_sweep=[-0.3, 0.2], probe_compare_eta_sweep=[0.3])  # fmt: skip
        cfg = _config(root / name, max_steps=4, probe_every=1, probe_lr_sweep=[1e-3, 1.0], **compare, **extra)
        trainer = _trainer(tiny_model_dir, cfg)
        run_dir = Path(cfg.output_dir)
        trainer.add_callback(ParquetLogCallback(run_dir / "metrics.parquet", method=method_name(cfg)))
        trainer.add_callback(HeldoutEvalCallback(trainer, [3, 4], 2, 2, cfg.temperature, "qwen-instruct"))
        trainer.train()
        meta = {
            "method": method_name(cfg),
            "config": cfg.to_dict(),
            "run": {"eval_n": 2},
        }  # as tokendyn train
        write_json(run_dir / "run.json", meta)
        out[name] = run_dir
    return out


@pytest.fixture(scope="session")
def records(run_dirs):
    return load_runs(run_dirs.values())


def _texts(fig: Figure) -> set[str]:
    return {t.get_text() for t in fig.findobj(Text) if t.get_text()}


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def test_runs_hold_every_record_kind(records):
    assert records.labels == ["GRPO", "GRPO + Reweight(a=0.3)", "GRPO + Lopti(eta=0.5)"]
    assert set(records.kinds()) == {
        "binstats", "hist", "bound", "checks", "tokens", "shares", "token_shares", "prob_change", "influence",
        "paired", "precision_check", "token_view", "token_view_rules", "floor", "metrics",
    }  # fmt: skip


# every figure (the sampler's from these runs' `floor` records; with a vLLM sampler's too in tests/test_vllm.py)
DRAWN_HERE = list(FIGURES)


@pytest.mark.parametrize("spec", DRAWN_HERE, ids=[s.name for s in DRAWN_HERE])
def test_every_figure_renders_all_runs_named_by_method(records, spec):
    fig = spec.draw(records)
    try:
        png = _png(fig)
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
        texts = _texts(fig)
        for label in records.labels:  # legends / row titles name every run by its method
            assert any(label in t for t in texts), (spec.name, label, texts)
        drawn = [a for a in fig.axes if a.has_data()]
        assert drawn, spec.name
        for ax in drawn:  # labelled axes (heatmap colorbars aside)
            if ax.get_label() != "<colorbar>":
                assert ax.get_xlabel() or ax.get_ylabel() or ax.get_title(), spec.name
    finally:
        matplotlib.pyplot.close(fig)


@pytest.mark.parametrize(
    "fn, args",
    [
        (F.token_share, (None,)),
        (F.advantage_by_bin, (None,)),
        (F.prob_change_by_bin, (None,)),
        (F.gradient_norm_by_bin, (None, None)),
        (F.layer_bin_heatmap, (None, None)),
        (F.isolation, (None,)),
        (F.influence_matrix, (None,)),
        (F.bound, (None,)),
        (F.correct_ratio, (None,)),
        (F.update_shares, (None,)),
        (F.paired_differences, (None,)),
        (F.training_curves, (None,)),
        (F.accuracy_table, (None,)),
    ],
)
def test_missing_kind_raises_missing_records(fn, args):
    with pytest.raises(F.MissingRecords, match="needs"):
        fn(*args)
    with pytest.raises(F.MissingRecords):
        fn(*(pl.DataFrame() for _ in args))


def test_token_share_matches_the_probe_tables(records, run_dirs):
    """The bars are the exact token counts of the probe (one point, each token once)."""
    from tokendyn.figures.tokens import token_counts

    counts = token_counts(records.get("binstats")).filter(pl.col("run") == "GRPO").sort("bin")
    bins = analyze_run(run_dirs["grpo"], write=False)["bins"]
    ref = bins.filter(pl.col("point") == "final_norm.out").sort("bin")
    assert counts["tokens"].to_list() == ref["tokens"].to_list()
    assert counts["share"].sum() == pytest.approx(1.0)
    # one run's lazy frames straight from tokendyn.analysis.load (no run column) draw too
    fig = F.token_share(load(run_dirs["grpo"], "binstats"), load(run_dirs["grpo"], "tokens"))
    assert "density (right axis)" in _texts(fig)
    heights = [p.get_height() for p in fig.axes[0].patches]
    assert heights == pytest.approx(counts["share"].to_list())
    matplotlib.pyplot.close(fig)


def test_lopti_tokens_keep_their_own_stage(records):
    tk = records.get("tokens").filter(pl.col("run") == "GRPO + Lopti(eta=0.5)")
    inside = tk.filter(pl.col("in_stage"))
    assert set(inside.filter(pl.col("stage") == "low")["bin"].unique()) <= {0, 1}
    assert set(inside.filter(pl.col("stage") == "high")["bin"].unique()) <= {2, 3}
    # outside its stage a token's advantage is masked to 0 in the records
    assert (tk.filter(~pl.col("in_stage"))["advantage"] == 0).all()


def test_readings_state_the_table_numbers(records):
    shares = tables.shares_table(records)
    text = readings.update_shares(records)
    lopti = "GRPO + Lopti(eta=0.5)"
    for run in records.labels:
        low = shares.filter(
            (pl.col("run") == run) & (pl.col("interval") == "[0, 0.25)") & (pl.col("stage") == "train")
        ).row(0, named=True)
        of = "the full loss's gradient" if run == lopti else "the update"
        assert f"{run}: tokens below π = 0.25 are {100 * low['token_share']:.0f}% of tokens and carry " \
               f"{100 * low['share_b']:.0f}% of {of}" in text  # fmt: skip
    # Lopti's stages, each decomposed on its own, in the table and the reading (the bin carrying most of the stage)
    staged = shares.filter((pl.col("run") == lopti) & (pl.col("stage") != "train"))
    assert set(staged["stage"].unique()) == {"low", "high"}
    for stage in ("low", "high"):
        top = staged.filter(pl.col("stage") == stage).sort("share_b", descending=True).row(0, named=True)
        assert f"{lopti}, stage {stage}: {top['interval']} holds {100 * top['token_share']:.0f}% of the stage's " \
               f"tokens and carries {100 * top['share_b']:.0f}% of its update" in text  # fmt: skip
    assert text.index(f"{lopti}, stage low:") < text.index(f"{lopti}, stage high:")  # stage 1 first
    acc = tables.accuracy(records)
    assert acc["evaluations"].min() >= 1 and set(acc.columns) >= {"run", "3 people", "4 people", "mean"}


def test_update_shares_draw_lopti_stages_apart(records):
    fig = F.update_shares(records.get("shares"))
    texts = _texts(fig)
    assert any("Lopti stage 1: low-probability tokens" in t for t in texts)
    assert any("Lopti stage 2: high-probability tokens" in t for t in texts)
    matplotlib.pyplot.close(fig)


def test_pooled_correct_ratio_skips_steps_without_signed_tokens(records):
    """A (step, bin) with no token of non-zero advantage records NaN ratios; pooling over steps must weigh it 0,
    not turn the run's pooled ratio into NaN (which once dropped GRPO from the pooled panel of (g))."""
    from tokendyn.figures.dynamics import pooled_change

    pc = records.get("prob_change").filter(pl.col("update") == "counterfactual")
    row = pc.filter((pl.col("run") == "GRPO") & (pl.col("bin") == 0)).head(1)
    silent = row.with_columns(
        pl.lit(10_000).cast(pl.Int64).alias("step"), pl.lit(0).cast(pl.Int64).alias("n_pos"), pl.lit(0).cast(pl.Int64).alias("n_neg"),
        *[pl.lit(float("nan")).alias(c) for c in ("correct_pos", "correct_neg", "correct_pooled")],
    )  # fmt: skip
    pooled = pooled_change(pl.concat([pc, silent])).filter((pl.col("run") == "GRPO") & (pl.col("bin") == 0))
    want = pc.filter((pl.col("run") == "GRPO") & (pl.col("bin") == 0) & (pl.col("update_stage") == "train"))
    n = want["n_pos"] + want["n_neg"]
    ok = n > 0
    expected = float((want["correct_pooled"].filter(ok) * n.filter(ok)).sum() / n.filter(ok).sum())
    assert pooled["correct_pooled"][0] == pytest.approx(expected, rel=1e-12)


def test_report_has_every_figure_and_table(records, tmp_path):
    result = build_report(records, tmp_path / "out", strict=True)
    html = result.path.read_text()
    # every section: none absent (the sampler's shows these runs' floor)
    assert not result.notes and "<details class='absent'" not in html
    for spec in DRAWN_HERE:
        section = html.split(f"<h2 id='{spec.name}'>", 1)[1].split("<h2", 1)[0]
        assert "data:image/png;base64," in section, spec.name
        assert "<div class='reading'>" in section, spec.name
        assert (tmp_path / "out" / f"{spec.name}.png").is_file()
    for name in TABLES:
        section = html.split(f"<h3 id='table-{name}'>", 1)[1].split("<h3", 1)[0]
        assert "<table>" in section and "class='note'" not in section, name
        assert pl.read_csv(result.tables[name]).height > 0
    # self-contained: nothing is loaded from elsewhere; the only scripts are the token view's, inline
    assert not re.search(r"""(src|href)=['"]?(https?:)?//""", html)
    assert html.count("<script") == 2 and not re.search(r"<script[^>]*\ssrc=", html)
    assert "id='token-view'" in html
    # the header links the glossary, which the report carries: every term of the docs' glossary page
    header = html.split("<table>", 1)[0]
    assert "href='#glossary'" in header and html.count("id='glossary'") == 1
    terms = re.findall(
        r"^\*\*(.+)\*\*$", (Path(__file__).resolve().parents[1] / "docs" / "glossary.md").read_text(), re.M
    )
    assert len(terms) > 30 and html.count("<dt id='glossary-") == len(terms)
    assert re.search(r"tokens below π = 0.25 are \d+% of tokens and carry \d+% of the update", html)


def test_missing_kinds_give_notes_not_a_crash(run_dirs, tmp_path):
    run = tmp_path / "grpo"
    shutil.copytree(run_dirs["grpo"], run)
    for f in (run / "records").glob("*.parquet"):
        if f.name.split("-rank")[0] in ("influence", "shares", "token_shares"):
            f.unlink()
    bare = tmp_path / "bare"  # only the training log
    bare.mkdir()
    shutil.copy(run_dirs["reweight"] / "metrics.parquet", bare / "metrics.parquet")
    result = build_report([run, bare], tmp_path / "out", strict=True)
    html = result.path.read_text()
    for name in ("e_isolation", "e_influence_matrix"):
        assert "`influence` records" in result.notes[name]
    assert "`shares` records" in result.notes["h_update_shares"]
    assert "d_gradient_norm" not in result.notes  # falls back to the activation-gradient norms
    assert "i_training" in result.figures and "f_bound" in result.figures
    assert "No `binstats` records in: bare" in html  # the run without records is named
    assert (
        "<details class='absent' id='e_isolation'><summary>Isolation: updating one interval only (Fig. 1e/f): not in "
        "these runs (needs `influence` records; train with --probe_every N and the rebalancing analyses on"
    ) in html
    assert "<h2 id='e_isolation'>" not in html and "Skipped:" not in html
    assert "table:shares" in result.notes and "table:accuracy" not in result.notes


def test_a_section_the_runs_lack_is_one_collapsed_line(run_dirs, tmp_path):
    """A run without `paired` records: each section that reads them is one collapsed line in the report, a
    <details> whose summary says "<section>: not in these runs (needs <records>; <how to get them>)", not a heading
    and a paragraph of instructions; the sections the run has are drawn as before, and the console notes keep the
    full text."""
    run = tmp_path / "grpo"
    shutil.copytree(run_dirs["grpo"], run)
    for f in (run / "records").glob("paired-*.parquet"):
        f.unlink()
    result = build_report([run], tmp_path / "out", strict=True)
    html = result.path.read_text()
    how = "train with --probe_compare_rules reweight,lopti (or tokendyn probe --compare_rules)"
    lacking = [spec for spec in FIGURES if spec.kinds == ("paired",)]
    assert [spec.name for spec in lacking] == ["h_paired", "h_both_camps", "h_axis"]
    summaries = {}
    for spec in lacking:
        assert f"<h2 id='{spec.name}'>" not in html
        block = re.search(rf"<details class='absent' id='{spec.name}'>(.*?)</details>", html)
        assert block, spec.name
        # one line of summary, and inside (collapsed) only what the section would show
        inner = re.fullmatch(r"<summary>([^<\n]+)</summary><p>([^<]*)</p>", block.group(1))
        assert inner and inner.group(2) == html_escape(f"{spec.shows} Records: paired."), block.group(1)
        summary = inner.group(1)
        assert summary.startswith(f"{spec.title} ({spec.paper}): not in these runs (") and summary.endswith(
            f"; {how})"
        ), summary
        summaries[spec.name] = summary
    assert summaries["h_paired"] == (
        f"Paired comparison of update rules (new): not in these runs (needs `paired` records; {how})"
    )
    for name in ("both_camps", "guidance"):  # the paired tables too
        assert re.search(
            rf"<details class='absent' id='table-{name}'><summary>[^<\n]+; {re.escape(how)}\)</summary>", html
        )
    assert "Skipped:" not in html and "class='note'" not in html
    assert result.notes["h_paired"].startswith(
        "Skipped: paired comparison: needs `paired` records, none found."
    )
    assert "<h2 id='a_token_share'>" in html and "a_token_share" in result.figures


def test_runs_recorded_before_a_schema_grew_still_load(run_dirs, tmp_path):
    """Influence shards written before the records kept the delta-pi quantiles: the run loads (new columns read as
    null), the influence matrix is drawn from what is there, and the isolation boxes become a note, not zeros."""
    run = tmp_path / "old"
    shutil.copytree(run_dirs["grpo"], run)
    dropped = ("std", "min", "q01", "q05", "q25", "q50", "q75", "q95", "q99", "max")
    shards = list((run / "records").glob("influence-*.parquet"))
    assert shards
    for f in shards:
        pl.read_parquet(f).drop(dropped).write_parquet(f)
    records = load_runs([run])
    assert records.get("influence")["q50"].null_count() == records.get("influence").height
    result = build_report(records, tmp_path / "out", strict=True)
    assert "no Δπ quantiles" in result.notes["e_isolation"]
    assert "e_influence_matrix" in result.figures and "e_influence_matrix" not in result.notes


def _args(*argv):
    parser = argparse.ArgumentParser(prog="tokendyn")
    cli.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["figures", *argv])


def test_cli_validates_every_run_dir_first(run_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.run(_args(str(run_dirs["grpo"]), str(tmp_path / "nope"), "--out", str(out))) == 2
    assert "nope" in capsys.readouterr().err and not out.exists()
    assert cli.run(_args(str(tmp_path), "--out", str(out))) == 2
    assert "is not a run directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _args(str(run_dirs["grpo"]), "--out", str(out), "--format", "gif")


def test_cli_writes_svg_figures_notes_and_the_report(run_dirs, tmp_path, capsys):
    bare = tmp_path / "bare"  # a run directory with its training log only: one figure, notes for the rest
    bare.mkdir()
    shutil.copy(run_dirs["lopti"] / "metrics.parquet", bare / "metrics.parquet")
    out = tmp_path / "out"
    assert cli.run(_args(str(bare), "--out", str(out), "--format", "svg")) == 0
    printed = capsys.readouterr().out
    assert f"report: {out / 'report.html'}" in printed and "needs `binstats` records" in printed
    assert [f.name for f in out.glob("*.svg")] == ["i_training.svg"]
    assert "<svg" in (out / "i_training.svg").read_text()
    assert (
        "data:image/png;base64," in (out / "report.html").read_text()
    )  # the report embeds PNG whatever --format


def test_analyze_prints_the_rebalancing_tables_side_by_side(run_dirs, capsys):
    from tokendyn.analysis.compare import compare
    from tokendyn.cli import main

    dirs = [str(d) for d in run_dirs.values()]
    assert main(["analyze", *dirs]) == 0
    out = capsys.readouterr().out
    assert "rebalancing, side by side" in out and "update share s_b" in out
    shares = compare(dirs)["update share s_b"]
    assert shares.columns[0] == "pi_old" and shares.width == 1 + len(dirs)
    for col in shares.columns[1:]:  # the projection shares of each run sum to 1 over the bins
        assert abs(shares[col].sum() - 1.0) < 1e-6
    # isolation: a Lopti run's lowest bin is updated in stage 1 and its highest in stage 2, each column says which
    iso = compare(dirs)["isolation: mean |delta pi| (update source: all / low bin / high bin)"]
    lopti = [c.split(": ", 1)[1] for c in iso.columns if c.startswith("lopti")]
    assert lopti == ["all (low stage)", "low (low stage)", "all (high stage)", "high (high stage)"]
    inf = load(run_dirs["lopti"], "influence").collect()
    top = inf.filter((pl.col("update_stage") == "high") & (pl.col("target_bin") == 1) & (pl.col("count") > 0))
    top = top.filter(pl.col("source_bin") == 3)
    want = float((top["mean_abs"] * top["count"]).sum() / top["count"].sum())
    col = next(c for c in iso.columns if c.startswith("lopti") and c.endswith("high (high stage)"))
    assert iso[col][1] == pytest.approx(want)


def test_bound_figure_layer_panels_show_the_direct_gradient_by_default(records):
    """Inner layers: the token's own (direct) gradient by default, whose scatter holds exactly the sampled tokens
    that have one; the total gradient on request; the final norm is the (exact) total in both."""
    tk = records.get("tokens")
    inner = sorted(p for p in tk["point"].unique().to_list() if p.startswith("layers."))[0]
    # what the direct panel draws, direct_ratio (1 - pi), is the token's own ||dl_t/dh|| / |w| wherever w != 0
    weighted = tk.filter(pl.col("direct_norm").is_not_null() & (pl.col("w") != 0))
    assert weighted.height > 0
    drawn = (weighted["direct_ratio"] * (1 - weighted["pi"])).to_numpy()
    assert np.allclose(drawn, (weighted["direct_norm"] / weighted["w"].abs()).to_numpy(), rtol=1e-5, atol=0)
    fig = F.bound(tk, records.get("bound"), records.get("checks"), points=[inner, "final_norm.out"])
    titles = {ax.get_title() for ax in fig.axes}
    assert any(t.endswith("(direct)") for t in titles) and not any(t.endswith("(total)") for t in titles)
    fig_total = F.bound(tk, records.get("bound"), records.get("checks"), points=[inner], gradient="total")
    assert any(ax.get_title().endswith("(total)") for ax in fig_total.axes)
    with pytest.raises(ValueError, match="gradient must be"):
        F.bound(tk, gradient="both")


def test_step_size_sweep_records(records):
    """The sweep's lr = 1e-3 rows are the main counterfactual update (same correct ratios, same ties); one SGD
    step's ||delta theta|| grows exactly with lr (GRPO, one stage); the table has every bin at every lr."""
    pc = records.get("prob_change").filter(pl.col("source_bin") == -1)
    grpo = pc.filter(pl.col("run") == records.labels[0])
    key = ["step", "bin", "update_stage"]
    main = grpo.filter(pl.col("update") == "counterfactual").select(*key, "correct_pos", "tie_pos", "n_pos")
    sw = grpo.filter((pl.col("update") == "sweep") & (pl.col("lr") == 1e-3))
    both = main.join(sw.select(*key, "correct_pos", "tie_pos", "n_pos"), on=key, suffix="_sweep")
    assert both.height == main.height > 0
    assert (both["tie_pos"] == both["tie_pos_sweep"]).all() and (both["n_pos"] == both["n_pos_sweep"]).all()
    a, b = both["correct_pos"].fill_nan(-1), both["correct_pos_sweep"].fill_nan(-1)
    assert (a == b).all()
    steps = grpo.filter((pl.col("update") == "sweep") & (pl.col("bin") == -1)).pivot(
        on="lr", index="step", values="param_step", aggregate_function="first"
    )
    ratio = (steps["1.0"] / steps["0.001"]).to_numpy()
    assert abs(ratio - 1000).max() < 1e-3 * 1000
    table = tables.sweep_correct_table(records)
    assert set(table["lr"].unique().to_list()) == {0.0, 1e-3, 1.0}  # lr 0: the lr -> 0 limit, the first point
    assert table.filter(pl.col("bin") >= 0).group_by("run", "lr").len()["len"].min() == 4


def test_influence_matrix_shares_one_colour_scale_and_leaves_no_empty_cell(records):
    from matplotlib.collections import QuadMesh

    fig = F.influence_matrix(records.get("influence"))
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    panels = [
        ax for ax in fig.axes if ax not in bars and any(isinstance(c, QuadMesh) for c in ax.collections)
    ]
    limits = {next(c for c in ax.collections if isinstance(c, QuadMesh)).get_clim() for ax in panels}
    assert len(panels) == 4 and len(bars) == 1  # GRPO, Reweight, Lopti's two stages; one colour bar
    assert len(limits) == 1 and next(iter(limits))[0] == 0.0
    assert all(ax.axison for ax in panels)  # no panel left blank in the grid
    matplotlib.pyplot.close(fig)


def test_grid_shape_leaves_the_fewest_empty_cells():
    from tokendyn.figures.dynamics import grid_shape

    assert [grid_shape(n) for n in (1, 2, 3, 4, 5, 6)] == [(1, 1), (1, 2), (1, 3), (2, 2), (2, 3), (2, 3)]


def test_four_bins_get_four_colour_blind_safe_colours_everywhere(records):
    from matplotlib.colors import to_hex

    from tokendyn.figures.style import OKABE_ITO, bin_colors

    assert bin_colors(4) == list(OKABE_ITO[:4]) and len(set(bin_colors(4))) == 4
    fig = F.update_shares(records.get("shares"))
    used = {to_hex(p.get_facecolor()) for ax in fig.axes for p in ax.patches if p.get_height() != 0}
    assert {c.lower() for c in OKABE_ITO[:4]} <= used
    matplotlib.pyplot.close(fig)


def test_wilson_interval_matches_the_formula():
    from tokendyn.figures.training import wilson

    lo, hi = wilson(0.5, 100)
    assert lo == pytest.approx(0.40383, abs=1e-5) and hi == pytest.approx(0.59617, abs=1e-5)
    assert wilson(0.0, 20)[0] == 0.0 and 0 < wilson(0.0, 20)[1] < 0.17  # no zero-width interval at 0 / 20


def test_accuracy_table_has_the_starting_policy_and_intervals(records):
    from tokendyn.figures.training import wilson

    acc = tables.accuracy(records)
    assert acc["run"][0] == "starting policy" and acc["evaluations"][0] == 1
    m = records.get("metrics")
    start = m.filter(pl.col("heldout/accuracy_3ppl").is_not_null() & (pl.col("rollout") == 0))
    assert acc["3 people"][0] == pytest.approx(float(start["heldout/accuracy_3ppl"].mean()))
    n = int(m["heldout_n"].max())
    for row in acc.iter_rows(named=True):
        lo, hi = wilson(row["mean"], n * 2 * row["evaluations"])  # two sizes (3 and 4 people)
        assert row["mean 95% CI"] == f"[{lo:.2f}, {hi:.2f}]"


def test_the_provable_head_bound_is_on_scale_or_a_number(records):
    from tokendyn.figures.report import FIGURES

    fig = next(s for s in FIGURES if s.name == "f_bound").draw(records)
    heads = [ax for ax in fig.axes if ax.get_title().startswith("final norm")]
    assert heads
    for ax in heads:
        top = ax.get_ylim()[1]
        drawn = [line for line in ax.get_lines() if line.get_color() == "#2166ac"]
        noted = any("provable: ≤" in t.get_text() for t in ax.texts)
        assert drawn or noted  # the bound is shown one way or the other
        assert all(max(line.get_ydata()) <= top * (1 + 1e-9) for line in drawn)  # never a stroke off the axis
    matplotlib.pyplot.close(fig)
