"""The generator reproduces the official K&K test files field by field (KK.md §1, §2)."""

from pathlib import Path

import polars as pl
import pytest

from tokendyn.cli import main
from tokendyn.tasks.kk.datasets import official_record, official_split

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "kk"


def _official(n: int) -> pl.DataFrame:
    path = SHARED / f"{n}ppl" / "test.parquet"
    if not path.is_file():
        pytest.skip(f"official K&K data not found at {path} (CI always has ../shared)")
    return pl.read_parquet(path)


@pytest.mark.parametrize("n", [3, 4, 5, 6, 7])
def test_every_field_of_the_official_test_split(n):
    official = _official(n).to_dicts()
    ours = [official_record(p, "test", k) for k, p in enumerate(official_split(n, "test"))]
    assert len(ours) == len(official) == 100
    for a, b in zip(ours, official, strict=True):
        for field in b:
            if field == "data_source":
                assert a[field] == "kk_logic" == b[field]
            else:
                assert a[field] == b[field], (n, b["index"], field)


@pytest.mark.parametrize("n", [3, 7])
def test_cli_generate_equals_official_file(n, tmp_path):
    official = _official(n)
    out = tmp_path / f"{n}.parquet"
    assert (
        main(
            [
                "kk",
                "generate",
                "--people",
                str(n),
                "--seed",
                "1234",
                "--start",
                "1000",
                "--count",
                "100",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    ours = pl.read_parquet(out)
    assert ours.schema == official.schema
    for col in (
        "quiz",
        "names",
        "solution",
        "solution_text_format",
        "statements",
        "prompt",
        "cot_repeat_steps",
    ):
        assert ours[col].to_list() == official[col].to_list(), col


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--people", "9", "--count", "1"], "people: must be an integer in 2..8"),
        (["--people", "1", "--count", "1"], "people: must be an integer in 2..8"),
        (["--people", "3", "--count", "0"], "count: must be > 0"),
        (["--people", "3", "--count", "2", "--start", "-1"], "start: must be >= 0"),
        (["--people", "3", "--count", "2", "--template", "llama"], "template: must be one of"),
    ],
)
def test_generate_rejects_bad_input_before_work(argv, message, tmp_path, capsys):
    out = tmp_path / "x.parquet"
    assert main(["kk", "generate", *argv, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_generate_rejects_unwritable_output(capsys):
    assert main(["kk", "generate", "--people", "3", "--count", "1", "--out", "/proc/none/x.parquet"]) == 2
    assert "out: cannot write" in capsys.readouterr().err
