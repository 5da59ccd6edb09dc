"""The docs stay true: every Python block of the README is an excerpt of an example (which tests/test_examples.py
runs) or is run here; docs/records.md documents every record kind and column of `tokendyn.records.SCHEMAS`; every
relative link of README.md and docs/ points into the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tokendyn.records import SCHEMAS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
EXAMPLES = {
    p.name: [line.strip() for line in p.read_text().splitlines()] for p in (ROOT / "examples").glob("*.py")
}
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def _excerpt_of(block: str) -> str | None:
    """The example whose lines contain the block's lines in order (None: no example does)."""
    want = [line.strip() for line in block.splitlines() if line.strip()]
    for name, lines in EXAMPLES.items():
        it = iter(lines)
        if all(any(w == line for line in it) for w in want):
            return name
    return None


def test_the_readme_has_python_blocks_and_examples():
    assert len(BLOCKS) >= 5 and set(EXAMPLES) >= {"custom_loop.py", "trl_script.py", "verl_rollouts.py"}


@pytest.mark.parametrize("k", range(len(BLOCKS)))
def test_every_readme_python_block_is_an_example_excerpt_or_runs(k):
    block = BLOCKS[k]
    if _excerpt_of(block) is not None:
        return
    exec(compile(block, f"README.md block {k}", "exec"), {"__name__": "readme_block"})  # noqa: S102


def test_the_excerpt_check_can_fail():
    assert _excerpt_of("optimizer.step()\noptimizer.zero_grad()") == "custom_loop.py"
    assert _excerpt_of("optimizer.zero_grad()\noptimizer.step()") is None  # the order matters


def test_records_doc_has_every_kind_and_column():
    doc = (ROOT / "docs" / "records.md").read_text()
    missing = []
    for kind, schema in SCHEMAS.items():
        if f"## `{kind}`" not in doc:
            missing.append(kind)
        section = doc.split(f"## `{kind}`", 1)[-1].split("\n## ", 1)[0]
        for col in schema:
            if col in ("step", "stage", "rank", "micro"):
                continue  # the shared keys, documented once above the kinds
            if f"`{col}`" not in section:
                missing.append(f"{kind}.{col}")
    assert not missing, f"docs/records.md does not document: {missing}"


def test_relative_links_point_into_the_repository():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for f in files:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", f.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            assert not target.startswith("../"), f"{f.name} links outside the repository: {target}"
            assert (f.parent / target).exists(), f"{f.name}: broken link {target}"
    assert "docs/definitions.md" in README and "docs/records.md" in README


def test_the_readme_study_table_is_the_generated_one():
    """The README's *what reproduces* table (between the study markers) is docs/study/study.md's, unedited: the
    verdicts are the report's, not typed by hand."""
    block = README[
        README.index("<!-- study -->") + len("<!-- study -->") : README.index("<!-- /study -->")
    ].strip()
    study = (ROOT / "docs" / "study" / "study.md").read_text()
    assert block.startswith("Each claim is a statistic") and "| phenomenon |" in block
    assert block in study
    assert study.index(block) > study.index("## What reproduces")
