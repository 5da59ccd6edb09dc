"""The report's glossary: the package's glossary.md (the docs site's page is the same file) parsed by its small
grammar, every term once with its anchor; a malformed file fails in one line naming the term or the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokendyn.figures.glossary import glossary_html, glossary_text, parse_glossary, term_anchor

ROOT = Path(__file__).resolve().parents[1]

SMALL = """# Glossary

Intro text with a [link](definitions.md).

## One

**π_old bin (interval)**
: A group of tokens by `old_logp`, see [the paper](paper.md);
  **four** of them.

**floor**
: The trainer against itself.

## Two

**<tag>**
: Escaped & kept.
"""


def test_a_small_glossary_parses_to_its_sections_terms_and_joined_definitions():
    assert parse_glossary(SMALL) == [
        ("One", [
            ("π_old bin (interval)", "A group of tokens by `old_logp`, see [the paper](paper.md); **four** of them."),
            ("floor", "The trainer against itself."),
        ]),
        ("Two", [("<tag>", "Escaped & kept.")]),
    ]  # fmt: skip


def test_the_html_escapes_turns_links_into_text_and_anchors_each_term():
    out = glossary_html(SMALL)
    assert "<dt id='glossary-π_old-bin-interval'>π_old bin (interval)</dt>" in out
    assert "<code>old_logp</code>, see the paper; <b>four</b> of them." in out
    assert "<dt id='glossary-tag'>&lt;tag&gt;</dt><dd>Escaped &amp; kept.</dd>" in out
    assert "Intro text" not in out and "definitions.md" not in out


@pytest.mark.parametrize(
    "text, message",
    [
        ("## A\n\n**x**\n\n**y**\n: why\n", "term 'x' has no definition"),
        ("## A\n\n**x**\n", "term 'x' has no definition"),
        ("## A\n\nloose words\n", "unexpected line 'loose words'"),
    ],
)
def test_a_malformed_glossary_fails_in_one_line(text, message):
    with pytest.raises(ValueError, match=message):
        parse_glossary(text)


def test_the_packaged_glossary_is_the_docs_page_and_parses_whole():
    """docs/glossary.md is the package's file (a link), so the site and the report cannot drift apart."""
    page = (ROOT / "docs" / "glossary.md").read_text(encoding="utf-8")
    assert glossary_text() == page
    terms = [line for line in page.splitlines() if line.startswith("**") and line.endswith("**")]
    parsed = [t for _, entries in parse_glossary(page) for t, _ in entries]
    assert parsed == [t[2:-2] for t in terms] and len(parsed) > 30
    anchors = [term_anchor(t) for t in parsed]
    assert len(set(anchors)) == len(anchors)  # every term its own anchor
