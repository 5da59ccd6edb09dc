"""Digests of the official K&K test sets (``{3..7}ppl/test.parquet`` of the paper's release), stored in
tests/data/kk_official_test.json so that a clone without the data still checks the generator field by field.

A digest is the first 32 hex digits of the SHA-256 of a value's canonical JSON (keys sorted, UTF-8): one per field
(the whole column of 100 puzzles) and one per puzzle (every field of the row). Rewrite the file from the official
files with ``python tests/_kk_digests.py DATA_DIR`` (DATA_DIR holds 3ppl/test.parquet ... 7ppl/test.parquet).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import polars as pl

DIGESTS = Path(__file__).resolve().parent / "data" / "kk_official_test.json"
SIZES = (3, 4, 5, 6, 7)


def digest(value) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def describe(rows: list[dict], schema: dict[str, str]) -> dict:
    """The digests of one test set given as row dicts (the official file's, or the generator's)."""
    fields = list(schema)
    return {
        "rows": len(rows),
        "schema": schema,
        "fields": {f: digest([r[f] for r in rows]) for f in fields},
        "puzzles": [digest({f: r[f] for f in fields}) for r in rows],
    }


def stored() -> dict:
    return json.loads(DIGESTS.read_text())


def write(data_dir: Path) -> None:
    sets = {}
    for n in SIZES:
        df = pl.read_parquet(data_dir / f"{n}ppl" / "test.parquet")
        sets[str(n)] = describe(df.to_dicts(), {k: str(v) for k, v in df.schema.items()})
    DIGESTS.parent.mkdir(parents=True, exist_ok=True)
    DIGESTS.write_text(json.dumps({"about": __doc__.split("\n\n")[0], "sets": sets}, indent=1) + "\n")


if __name__ == "__main__":
    write(Path(sys.argv[1]))
