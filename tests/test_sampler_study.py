"""The sampler study (`tokendyn study --policy smollm2-135m --use_vllm`, docs/study/llm-vllm, committed run by
run): its study.md and tables regenerate from the committed result folders alone (and the generate-sampled reference
study's), every committed run says which engine and dtype sampled it, and the report's options fail in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_llm_study import assert_same_table

from tokendyn.cli import main
from tokendyn.commands import llm_study as L
from tokendyn.commands.sampler_study_report import write_sampler_study
from tokendyn.commands.study_engine import DONE, finished_runs, identity

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "docs" / "study" / "llm-vllm"
REFERENCE = "docs/study/llm"  # as the report's command names it (study.md quotes it)
DTYPE = {"grpo_vllm_fp32": "float32", "grpo_vllm_fp16": "float16"}


def test_committed_sampler_study_is_what_its_result_files_give(tmp_path, monkeypatch):
    import polars as pl

    runs = finished_runs(COMMITTED)
    assert runs, f"no finished run committed under {COMMITTED}"
    out = tmp_path / "llm-vllm"
    shutil.copytree(COMMITTED / "runs", out / "runs")
    shutil.copytree(COMMITTED / "start", out / "start")
    monkeypatch.chdir(ROOT)
    write_sampler_study(out, L.SAMPLER_FULL, REFERENCE)
    assert (out / "study.md").read_text() == (COMMITTED / "study.md").read_text()
    tables = sorted((COMMITTED / "tables").glob("*.parquet"))
    assert {t.name for t in tables} == {t.name for t in (out / "tables").glob("*.parquet")}
    for table in tables:
        assert_same_table(pl.read_parquet(out / "tables" / table.name), pl.read_parquet(table), table.name)
    for (method, _), d in runs.items():
        assert method in L.SAMPLER_ORDER
        done = json.loads((d / DONE).read_text())
        assert done["study"] == identity(L.SAMPLER, L.SAMPLER_FULL, "smollm2-135m") and done["threads"] == 1
        sampler = json.loads((d / "run.json").read_text())["sampler"]
        assert sampler["engine"] == "vllm" and sampler["dtype"] == DTYPE.get(method, "bfloat16")
        assert list((d / "records").glob("sampler-*.parquet"))


@pytest.mark.parametrize(
    "flags, field",
    [(["--reference", "docs/study/llm"], "--reference"), (["--use_vllm"], "--use_vllm")],
)
def test_the_sampler_options_fail_in_one_line(flags, field, capsys):
    assert main(["study", *flags, "--quick", "--report-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and field in err
