"""MkDocs hooks of tokendyn's docs site (mkdocs.yml `hooks:`), all generated at build time, nothing written to docs/:

- `reference/cli.md`: every command's `--help`, from the CLI's own argparse parsers (and `train`'s TRL parser), so
  the reference cannot drift from the code;
- `reference/api.md`: one mkdocstrings block per public name of `tokendyn.EXPORTS` (rendered from the docstrings);
- `changelog.md`: the repository's CHANGELOG.md, its `docs/` links made relative to the site;
- a link from a page to a repository file outside docs/ (`../examples/custom_loop.py`) is copied into the site under
  `_repo/` and the link rewritten to it; a link to a file that does not exist is left as it is, so the strict build
  reports it.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]  # the repository: mkdocs.yml's folder (set again by on_config)
LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\))")
REPO_PREFIX = "_repo"


def _help(parser) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        parser.print_help()
    return out.getvalue().rstrip()


def cli_reference() -> str:
    """`tokendyn --help`, then each command's help, in the order of `tokendyn --help`."""
    from tokendyn.cli import build_parser

    parser = build_parser()
    parts = [
        "# Command-line reference",
        "",
        "Generated from the parsers' own help at build time. Guides to the commands: [commands](../commands.md).",
        "",
        "## `tokendyn`",
        "",
        "```text",
        _help(parser),
        "```",
    ]
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, sub in subparsers.choices.items():
        if name == "train":
            sub = train_parser()
        parts += ["", f"## `tokendyn {name}`", "", "```text", _help(sub), "```"]
        nested = [a for a in sub._actions if a.__class__.__name__ == "_SubParsersAction"]
        for action in nested:
            for child, child_parser in action.choices.items():
                parts += ["", f"### `tokendyn {name} {child}`", "", "```text", _help(child_parser), "```"]
    return "\n".join(parts) + "\n"


def train_parser():
    """`tokendyn train`'s own parser: every field of RunArguments and TokendynGRPOConfig."""
    from trl import TrlParser

    from tokendyn.trainers.config import TokendynGRPOConfig
    from tokendyn.trainers.runner import RunArguments

    return TrlParser((RunArguments, TokendynGRPOConfig), prog="tokendyn train")


def api_reference() -> str:
    """One mkdocstrings block per public name, grouped by the module that defines it."""
    import tokendyn

    parts = [
        "# Python API",
        "",
        "Every name importable from `tokendyn`, rendered from its docstring at build time. How they fit together:",
        "[your own loop](../own_loop.md); the records they write: [records](../records.md).",
    ]
    for name, module in tokendyn.EXPORTS.items():
        if module.rsplit(".", 1)[-1] == name:
            continue
        parts += ["", f"## `{name}`", "", f"::: {module}.{name}"]
    return "\n".join(parts) + "\n"


def changelog() -> str:
    text = (ROOT / "CHANGELOG.md").read_text()
    return re.sub(r"\]\(docs/", "](", text)


def _located(path: Path) -> Path:
    """Where a link points, ``..`` taken out but a linked file not followed: a page of docs/ that is a link to a
    package file (docs/glossary.md) is a page of the site, not a repository file outside it."""
    return Path(os.path.normpath(path.absolute()))


def on_config(config):
    global ROOT
    ROOT = _located(Path(config.config_file_path)).parent
    return config


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "reference/cli.md", content=cli_reference()))
    files.append(File.generated(config, "reference/api.md", content=api_reference()))
    files.append(File.generated(config, "changelog.md", content=changelog()))
    docs = _located(Path(config["docs_dir"]))
    wanted: set[str] = set()
    for f in list(files):
        if not f.src_uri.endswith(".md") or f.abs_src_path is None:
            continue
        here = Path(f.abs_src_path).parent
        for m in LINK.finditer(Path(f.abs_src_path).read_text()):
            target = m.group(2)
            if "://" in target or target.startswith("mailto:"):
                continue
            path = _located(here / target)
            if not path.is_relative_to(docs) and path.is_relative_to(ROOT) and path.is_file():
                if path.suffix == ".md":
                    continue  # a page of the repository outside docs/ (the README): no page of the site
                wanted.add(path.relative_to(ROOT).as_posix())
    for f in files:  # the changelog's links to repository files (examples/...)
        if f.src_uri == "changelog.md":
            for m in LINK.finditer(f.content_string):
                path = (ROOT / m.group(2)).resolve()
                if "://" not in m.group(2) and path.is_file() and not (docs / m.group(2)).exists():
                    if path.suffix == ".md":
                        continue
                    wanted.add(path.relative_to(ROOT).as_posix())
    for rel in sorted(wanted):
        files.append(File.generated(config, f"{REPO_PREFIX}/{rel}", abs_src_path=str(ROOT / rel)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Links to repository files outside docs/ point to their copies under `_repo/`."""
    docs = _located(Path(config["docs_dir"]))
    if page.file.abs_src_path is not None:
        here = Path(page.file.abs_src_path).parent
    else:
        here = ROOT  # the changelog: its links are relative to the repository root
    page_dir = (docs / page.file.src_uri).parent

    def fix(m: re.Match) -> str:
        target = m.group(2)
        if "://" in target or target.startswith("mailto:"):
            return m.group(0)
        path = _located(here / target)
        if here == ROOT and (docs / target).exists():
            return m.group(0)
        if path.is_relative_to(docs) or not path.is_relative_to(ROOT) or not path.is_file():
            return m.group(0)
        new = os.path.relpath(docs / REPO_PREFIX / path.relative_to(ROOT), page_dir)
        return f"{m.group(1)}{Path(new).as_posix()}{m.group(3) or ''}{m.group(4)}"

    return LINK.sub(fix, markdown)
