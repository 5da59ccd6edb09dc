"""The glossary inside the report: the package's ``glossary.md`` (the docs site's glossary page is the same file) as
an HTML section, so a report opened anywhere explains its own terms, and its header links there.

The file's grammar is small and fixed: ``## Section`` headings, a term as a line ``**term**``, its definition as a
line ``: text`` with continuation lines indented two spaces, and inline ``**bold**``, ```code``` and
``[text](page.md)`` (links to other docs pages become their text: the report does not carry those pages).
"""

from __future__ import annotations

import html
import re
from importlib import resources

GLOSSARY_ID = "glossary"  # the report's anchor
_INLINE = (
    (re.compile(r"\[([^\]]+)\]\([^)]+\)"), r"\1"),  # a link to another docs page: its text
    (re.compile(r"\*\*(.+?)\*\*"), r"<b>\1</b>"),
    (re.compile(r"`([^`]+)`"), r"<code>\1</code>"),
)


def glossary_text() -> str:
    """The glossary as the package ships it (``tokendyn/glossary.md``)."""
    return resources.files("tokendyn").joinpath("glossary.md").read_text(encoding="utf-8")


def term_anchor(term: str) -> str:
    """An HTML id for a term: ``glossary-`` + its lower-case words joined by ``-`` (π_old bin -> glossary-π_old-bin)."""
    words = re.findall(r"[\w]+", term.lower())
    return f"{GLOSSARY_ID}-" + "-".join(words)


def parse_glossary(text: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """``[(section, [(term, definition), ...]), ...]`` in the file's order; the text before the first section is
    left out (it introduces the page). A term without a definition is an error naming the term."""
    sections: list[tuple[str, list[tuple[str, str]]]] = []
    term: str | None = None  # the term being defined
    pending: str | None = None  # a term read whose definition has not started
    for line in text.splitlines():
        if line.startswith("## ") or re.fullmatch(r"\*\*.+\*\*", line.strip()):
            if pending is not None:
                raise ValueError(f"glossary: term {pending!r} has no definition")
            if line.startswith("## "):
                sections.append((line[3:].strip(), []))
                term = None
            elif sections:
                term = pending = line.strip()[2:-2]
        elif not sections:
            continue
        elif line.startswith(": ") and pending is not None:
            sections[-1][1].append((pending, line[2:].strip()))
            pending = None
        elif line.startswith("  ") and line.strip() and term is not None and pending is None:
            t, d = sections[-1][1][-1]
            sections[-1][1][-1] = (t, f"{d} {line.strip()}")
        elif line.strip():
            raise ValueError(
                f"glossary: unexpected line {line!r} (a term is **term**, its definition ': text')"
            )
    if pending is not None:
        raise ValueError(f"glossary: term {pending!r} has no definition")
    return sections


def _inline(text: str) -> str:
    out = html.escape(text, quote=False)
    for pattern, repl in _INLINE:
        out = pattern.sub(repl, out)
    return out


def glossary_html(text: str | None = None) -> str:
    """The report's glossary section: one ``<dl>`` per section, each term with its anchor (`term_anchor`)."""
    parts = [f"<h2 id='{GLOSSARY_ID}'>Glossary</h2>"]
    for section, entries in parse_glossary(glossary_text() if text is None else text):
        parts.append(f"<h3>{html.escape(section)}</h3><dl>")
        for term, definition in entries:
            parts.append(
                f"<dt id='{html.escape(term_anchor(term))}'>{_inline(term)}</dt><dd>{_inline(definition)}</dd>"
            )
        parts.append("</dl>")
    return "".join(parts)
