"""The generator reproduces the official K&K test files field by field (docs/kk.md §1, §2), checked against
digests of those files stored in the repository (tests/_kk_digests.py). Where a copy of the released files is
given (``TOKENDYN_KK_OFFICIAL``: a folder of ``<n>ppl/test.parquet``), the stored digests are checked against it too;
without it that check is skipped with its reason, the digest checks still run."""

import os
from pathlib import Path

import polars as pl
import pytest
from _kk_digests import SIZES, describe, digest, stored

from tokendyn.cli import main
from tokendyn.tasks.kk.datasets import official_record, official_split

OFFICIAL = os.environ.get("TOKENDYN_KK_OFFICIAL")


@pytest.mark.parametrize("n", SIZES)
def test_every_field_of_the_official_test_split(n):
    want = stored()["sets"][str(n)]
    ours = [official_record(p, "test", k) for k, p in enumerate(official_split(n, "test"))]
    assert len(ours) == want["rows"] == 100
    assert [list(r) for r in ours] == [list(want["schema"])] * len(ours)  # every field, in the official order
    got = describe(ours, want["schema"])
    wrong_fields = [f for f in want["fields"] if got["fields"][f] != want["fields"][f]]
    wrong_puzzles = [
        k for k, (a, b) in enumerate(zip(got["puzzles"], want["puzzles"], strict=True)) if a != b
    ]
    assert not wrong_fields and not wrong_puzzles, (n, wrong_fields, wrong_puzzles[:5])


@pytest.mark.parametrize("n", SIZES)
def test_the_stored_digests_are_the_released_files(n):
    if not OFFICIAL:
        pytest.skip("TOKENDYN_KK_OFFICIAL (a folder of the released <n>ppl/test.parquet files) is not set")
    official = Path(OFFICIAL) / f"{n}ppl" / "test.parquet"
    assert official.is_file(), f"TOKENDYN_KK_OFFICIAL has no {official}"
    df = pl.read_parquet(official)
    assert describe(df.to_dicts(), {k: str(v) for k, v in df.schema.items()}) == stored()["sets"][str(n)]


def test_a_changed_field_changes_its_digest():
    row = official_record(official_split(3, "test")[0], "test", 0)
    other = {**row, "solution": [not v for v in row["solution"]]}
    assert digest(row["solution"]) != digest(other["solution"]) and digest(row["quiz"]) == digest(
        other["quiz"]
    )


@pytest.mark.parametrize("n", [3, 7])
def test_cli_generate_equals_official_file(n, tmp_path):
    want = stored()["sets"][str(n)]
    out = tmp_path / f"{n}.parquet"
    argv = ["kk", "generate", "--people", str(n), "--seed", "1234", "--start", "1000", "--count", "100"]
    assert main([*argv, "--out", str(out)]) == 0
    ours = pl.read_parquet(out)
    assert {k: str(v) for k, v in ours.schema.items()} == want["schema"]
    for col in (
        "quiz",
        "names",
        "solution",
        "solution_text_format",
        "statements",
        "prompt",
        "cot_repeat_steps",
    ):
        assert digest(ours[col].to_list()) == want["fields"][col], col


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
