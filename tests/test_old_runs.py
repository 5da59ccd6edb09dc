"""Run directories written before the vocabulary was fixed still load, analyse and draw: a `shares` file whose
parameter-group column is still called ``layer`` (written here by hand, as the old writer did) is read as ``group``,
beside files already in today's names."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import polars as pl  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from _models import make_batch, tiny_qwen2  # noqa: E402

from tokendyn import ProbeBatch, instrument, load_run  # noqa: E402
from tokendyn.analysis.report import analyze_run  # noqa: E402
from tokendyn.figures import gradient_norm_by_bin, layer_bin_heatmap, load_runs, update_shares  # noqa: E402
from tokendyn.records import SCHEMAS, shard_files, write_parquet  # noqa: E402
from tokendyn.vocab import RETIRED  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Two probed steps with the shares analysis; step 0's shares file then rewritten in the old format."""
    out = tmp_path_factory.mktemp("old") / "run"
    model = tiny_qwen2(sharpen=4.0)
    batch = make_batch(model, n=4, sample=False)
    probe_batch = ProbeBatch(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        completion_mask=batch.completion_mask,
        advantages=batch.advantages,
        temperature=1.0,
    )
    with instrument(model, out, rank=0, recorder=True, analyses="shares", method="old run") as rec:
        for step in range(2):
            rec.analyze(probe_batch, step=step)
            out_ = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
            z = out_.logits[:, -batch.c - 1 : -1].float()
            logps = torch.log_softmax(z, -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
            rec.begin_step(step=step, completion_mask=batch.completion_mask, advantages=batch.advantages,
                           completion_ids=batch.completion_ids, logps=logps)  # fmt: skip
            (-(logps * batch.advantages.unsqueeze(1) * batch.completion_mask).sum()).backward()
            rec.end_step()
    first = shard_files(out, "shares")[0]
    old = pl.read_parquet(first).rename({"group": "layer"})  # the old writer's column name
    write_parquet(old, first)
    return out


def test_the_old_file_is_in_the_old_format(run_dir):
    files = shard_files(run_dir, "shares")
    assert len(files) == 2
    assert "layer" in pl.read_parquet(files[0]).columns and "group" in pl.read_parquet(files[1]).columns
    assert RETIRED["shares"]["columns"] == {"layer": "group"}


def test_old_and_new_shares_load_in_todays_names(run_dir):
    shares = load_run(run_dir)["shares"].collect()
    assert shares.columns == list(SCHEMAS["shares"])
    assert sorted(shares["step"].unique().to_list()) == [0, 1]
    groups = shares.group_by("step").agg(pl.col("group").n_unique())["group"].to_list()
    assert groups[0] == groups[1] > 1 and shares["group"].null_count() == 0
    # the bin shares still sum to 1 over the bins, in both files
    total = (
        shares.filter((pl.col("group") == "all") & (pl.col("bin") >= 0))
        .group_by("step")
        .agg(pl.col("share").sum())
    )
    assert total["share"].to_list() == pytest.approx([1.0, 1.0], abs=1e-6)


def test_the_old_run_analyses_and_draws(run_dir):
    tables = analyze_run(run_dir, write=False)
    assert tables["bins"].height > 0
    records = load_runs([run_dir])
    for figure in (gradient_norm_by_bin(records.get("shares")), layer_bin_heatmap(records.get("shares")),
                   update_shares(records.get("shares"))):  # fmt: skip
        assert figure.axes


@pytest.mark.parametrize(
    ("order", "first", "second"), [("low_first", "low", "high"), ("high_first", "high", "low")]
)
def test_old_update_stage_names_load_by_the_runs_lopti_order(tmp_path, order, first, second):
    """prob_change rows written with the positional names all / stage1 / stage2 / total (by hand, as the old writer
    named them) read as train / the run's first and second stage / lopti."""
    import json

    (tmp_path / "run.json").write_text(json.dumps({"method": "old", "config": {"lopti_order": order}}))
    old = ["all", "stage1", "stage2", "total"]
    schema = SCHEMAS["prob_change"]
    row = {c: [None] * len(old) for c in schema}
    row.update(step=[0] * 4, stage=["train"] * 4, update=["counterfactual"] * 4, update_stage=old,
               source_bin=[-1] * 4, bin=[0] * 4, count=[3] * 4)  # fmt: skip
    write_parquet(
        pl.DataFrame(row, schema=schema), tmp_path / "records" / "prob_change-rank000-000000.parquet"
    )
    got = load_run(tmp_path)["prob_change"].collect()["update_stage"].to_list()
    assert got == ["train", first, second, "lopti"]
