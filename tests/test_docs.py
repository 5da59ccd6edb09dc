"""The docs stay true. Every code block of README.md and docs/ runs as written or is an excerpt of a tested example:
a Python block is an excerpt of an example (which tests/test_examples.py runs; a line `...` marks elided lines) or
is run here; every `tokendyn` command line of a shell block names a command and only options and values the
command's own parser accepts (parsed by the real CLI parsers, nothing run), and so does every `--flag` the reading
pages name. docs/records.md documents every record kind and column of `tokendyn.records.SCHEMAS`. The repository
stands alone: no page, source, test or bench file refers to a path outside it, and the docs speak of the tool, not of
how it was made. The README stays a ten-minute read (at most 1,200 words outside code blocks, its parts in order) and
its links point into the repository; the links and anchors of docs/ and the changelog are checked by the site's
strict build (tests/test_site.py, `make docs`)."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

from tokendyn.records import SCHEMAS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = {  # every document whose code blocks are checked: README.md and docs/**/*.md
    p.relative_to(ROOT).as_posix(): p.read_text()
    for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
}
LINKED = {"README.md": README}  # whose links and anchors are checked here (docs/: the strict site build)
EXAMPLES = {
    p.name: [line.strip() for line in p.read_text().splitlines()] for p in (ROOT / "examples").glob("*.py")
}
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
ELIDED = re.compile(r"^\.\.\.(\s*#.*)?$")  # `...` or `...  # what was left out`: lines of the example skipped
SHELL = ("bash", "sh", "shell", "console")


def fenced(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return [(m.group(1).lower(), m.group(2)) for m in FENCE.finditer(text)]


def indented(text: str) -> list[str]:
    """The bodies of the indented (4-space) code blocks outside fences and lists: after a blank line."""
    out, body, prev_blank = [], None, True
    for line in FENCE.sub("", text).splitlines():
        if body is not None and (line.startswith("    ") or not line.strip()):
            body.append(line[4:])
            continue
        if body is not None:
            out.append("\n".join(body))
            body = None
        if line.startswith("    ") and prev_blank:
            body = [line[4:]]
        prev_blank = not line.strip()
    if body is not None:
        out.append("\n".join(body))
    return out


PY_BLOCKS = [
    (doc, k, body)
    for doc, text in DOCS.items()
    for k, body in enumerate(body for lang, body in fenced(text) if lang in ("python", "py"))
]


def _excerpt_of(block: str) -> str | None:
    """The example whose lines contain the block's lines in order (None: no example does)."""
    want = [line.strip() for line in block.splitlines() if line.strip() and not ELIDED.match(line.strip())]
    if not want:
        return None
    for name, lines in EXAMPLES.items():
        it = iter(lines)
        if all(any(w == line for line in it) for w in want):
            return name
    return None


def _verl_batch(tmp_path: Path):
    """docs/verl_dataproto.md saves `data`, a verl `DataProto` after the advantages: a real one of two rows (a
    left-padded prompt, a right-padded response); afterwards tokendyn reads back exactly these rows."""
    import numpy as np
    import torch

    DataProto = pytest.importorskip("verl").DataProto
    data = DataProto.from_dict(
        tensors={
            "prompts": torch.tensor([[0, 5, 6], [7, 8, 9]]),
            "responses": torch.tensor([[10, 11], [12, 0]]),
            "attention_mask": torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]),
            "advantages": torch.tensor([[0.5, 0.5], [-0.5, 9.0]]),
        },
        non_tensors={"uid": np.array(["a", "a"], dtype=object)},
        meta_info={"temperature": 0.7},
    )

    def check():
        from tokendyn.hooks.rollouts import read_rollouts

        got = read_rollouts(tmp_path / "rollouts.td")
        assert [r.tolist() for r in got.prompt_ids] == [[5, 6], [7, 8, 9]]
        assert [r.tolist() for r in got.completion_ids] == [[10, 11], [12]]
        assert [r.tolist() for r in got.advantages] == [[0.5, 0.5], [-0.5]] and got.temperature == 0.7

    return {"data": data}, check


# a block that runs on objects the prose names but does not build: (document, a line of the block) -> its context
CONTEXTS = {("docs/verl_dataproto.md", 'data.batch.memmap("rollouts.td")'): _verl_batch}


def test_the_docs_have_python_blocks_and_examples():
    assert set(EXAMPLES) >= {"custom_loop.py", "trl_script.py", "verl_rollouts.py", "verl_actor.py"}
    assert sum(doc == "README.md" for doc, _, _ in PY_BLOCKS) >= 2 and len(PY_BLOCKS) >= 8


@pytest.mark.parametrize(("doc", "k", "block"), PY_BLOCKS, ids=[f"{d}:{k}" for d, k, _ in PY_BLOCKS])
def test_every_python_block_is_an_example_excerpt_or_runs(doc, k, block, tmp_path, monkeypatch):
    if _excerpt_of(block) is not None:
        return
    assert not any(ELIDED.match(line.strip()) for line in block.splitlines()), (
        f"{doc} block {k} elides lines (`...`) but is no excerpt of an example"
    )
    monkeypatch.chdir(tmp_path)  # whatever the block writes lands here
    context = next((make for (d, line), make in CONTEXTS.items() if d == doc and line in block), None)
    namespace, check = context(tmp_path) if context else ({}, None)
    exec(compile(block, f"{doc} block {k}", "exec"), {"__name__": "doc_block", **namespace})  # noqa: S102
    if check is not None:
        check()


def test_the_excerpt_check_can_fail():
    assert _excerpt_of("optimizer.step()\noptimizer.zero_grad()") == "custom_loop.py"
    assert _excerpt_of("optimizer.step()\n...  # more\noptimizer.zero_grad()") == "custom_loop.py"
    assert _excerpt_of("optimizer.zero_grad()\noptimizer.step()") is None  # the order matters
    assert _excerpt_of("...\n...  # only elisions") is None


# ---- shell blocks: every `tokendyn ...` line parses with the command's own parser ------------------------------------


def shell_commands(text: str) -> list[str]:
    """The command lines of a document's shell blocks (continuations joined, a quote spanning lines kept whole),
    and of its plain and indented blocks the lines that start with `tokendyn ` (not a printed `tokendyn CMD: error`)."""
    out = []
    for lang, body in fenced(text):
        if lang in SHELL:
            pending = ""
            for line in body.replace("\\\n", " ").splitlines():
                pending = f"{pending}\n{line}" if pending else line
                try:
                    shlex.split(pending, comments=True)
                except ValueError:  # an open quote: the command goes on on the next line
                    continue
                out.append(pending)
                pending = ""
            assert not pending, f"unbalanced quotes in a shell block: {pending!r}"
    plain = [body for lang, body in fenced(text) if lang == ""] + indented(text)
    for body in plain:
        for line in body.replace("\\\n", " ").splitlines():
            if re.match(r"tokendyn \S+(\s|$)", line) and not re.match(r"tokendyn \S+:", line):
                out.append(line)
    return out


def tokendyn_argvs(line: str) -> list[list[str]]:
    """The argument lists of every `tokendyn` invocation in a command line: `tokendyn ARGS`, `python -m tokendyn
    ARGS`, `... -m tokendyn.cli ARGS`, each up to the next `|`, `&&`, `;` or redirection."""
    tokens = shlex.split(line, comments=True)
    out, cmd = [], []
    for tok in [*tokens, ";"]:
        if tok in ("|", "||", "&&", ";", "&"):
            for i, t in enumerate(cmd):
                if (
                    (t == "tokendyn" or t.endswith("/bin/tokendyn"))
                    and (i == 0 or cmd[i - 1] == "-m")
                    or t == "tokendyn.cli"
                    and cmd[i - 1] == "-m"
                ):
                    args = cmd[i + 1 :]
                    if ">" in args:
                        args = args[: args.index(">")]
                    out.append(args)
                    break
            cmd = []
        else:
            cmd.append(tok)
    return out


@cache
def cli_parser() -> argparse.ArgumentParser:
    from tokendyn.cli import build_parser

    return build_parser()


@cache
def train_parser() -> argparse.ArgumentParser:
    """`tokendyn train`'s own parser (every field of RunArguments and TokendynGRPOConfig), as `train_cli.parse`
    builds it, before any value is turned into a config."""
    from trl import TrlParser

    from tokendyn.trainers.config import TokendynGRPOConfig
    from tokendyn.trainers.runner import RunArguments

    return TrlParser((RunArguments, TokendynGRPOConfig), prog="tokendyn train")


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """None if the parser accepts argv (help included), else what it said."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            if exc.code:
                said = [line for line in err.getvalue().splitlines() if line.strip()]  # usage, then the error
                return said[-1].strip() if said else f"exit {exc.code}"
    return None


def cli_problem(argv: list[str]) -> str | None:
    """Why `tokendyn ARGV` is not a valid command line (None: it is). Nothing is run: train's flags go through its
    own parser (`--config FILE` and `...`, "and more flags", left out), every other command's through the CLI's."""
    from tokendyn.cli import COMMANDS, PASSTHROUGH

    if argv and argv[0] in PASSTHROUGH:
        rest, skip = [], False
        for a in argv[1:]:
            if skip or a == "...":
                skip = False
                continue
            if a == "--config":
                skip = True
                continue
            rest.append("--help" if a == "--help-all" else a)
        if "--help" in rest:  # prints the flags: only the names must exist
            known = set(train_parser()._option_string_actions)
            bad = [a for a in rest if a.startswith("-") and a.split("=", 1)[0] not in known]
            return f"unknown options {bad}" if bad else None
        return _parse(train_parser(), rest)
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        return f"no command {argv[0]!r} (commands: {', '.join(COMMANDS)})"
    return _parse(cli_parser(), argv)


CLI_LINES = [
    (doc, line) for doc, text in DOCS.items() for line in shell_commands(text) if tokendyn_argvs(line)
]


def test_the_docs_have_tokendyn_command_lines():
    commands = {argv[0] for _, line in CLI_LINES for argv in tokendyn_argvs(line) if argv}
    assert {"kk", "warmstart", "train", "eval", "analyze", "probe", "figures", "study", "view"} <= commands
    assert any("-m tokendyn.cli train" in line for _, line in CLI_LINES)  # the GPU recipe's accelerate launch


def test_every_tokendyn_command_line_parses():
    bad = [
        f"{doc}: {' '.join(line.split())} -> {problem}"
        for doc, line in CLI_LINES
        for argv in tokendyn_argvs(line)
        if (problem := cli_problem(argv)) is not None
    ]
    assert not bad, "\n".join(bad)


def test_the_command_line_check_can_fail():
    assert cli_problem(["analyze", "runs/a", "--steps", "0:10"]) is None
    assert cli_problem(["train", "--lopti_eta", "0.5", "--config", "run.yaml", "..."]) is None
    assert "no command 'trian'" in cli_problem(["trian", "--output_dir", "x"])
    assert "unrecognized arguments" in cli_problem(["analyze", "runs/a", "--no_such_option", "1"])
    assert "invalid" in cli_problem(["eval", "--n", "many"])  # a value of the wrong type
    assert cli_problem(["train", "--lopti_etaa", "0.5"]) is not None
    assert cli_problem(["train", "--help", "--lopti_etaa"]) is not None
    assert tokendyn_argvs("accelerate launch --num_processes 8 -m tokendyn.cli train --bf16 true") == [
        ["train", "--bf16", "true"]
    ]
    assert tokendyn_argvs(".venv/bin/tokendyn demo --quick") == [["demo", "--quick"]]
    assert tokendyn_argvs("tokendyn analyze a && tokendyn figures a > log  # both") == [
        ["analyze", "a"],
        ["figures", "a"],
    ]


# ---- records, links, anchors, marker blocks ----------------------------------------------------------------------


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


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (letters, digits, `_`, `-` and spaces kept),
    spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a markdown text (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", text), re.M):
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_relative_links_and_anchors_point_into_the_repository():
    bad = []
    for doc, text in LINKED.items():
        here = (ROOT / doc).parent
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", text)):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (here / path).resolve() if path else ROOT / doc
            if not file.is_relative_to(ROOT):
                bad.append(f"{doc}: {target} is outside the repository")
            elif not file.exists():
                bad.append(f"{doc}: broken link {target}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
                bad.append(f"{doc}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not bad, "\n".join(bad)
    assert "docs/definitions.md" in README and "docs/records.md" in README


def test_the_anchor_check_can_fail():
    heading = "`tokendyn train` — GRPO, +Reweight, +Lopti on K&K (TRL)"
    assert _slug(heading) == "tokendyn-train--grpo-reweight-lopti-on-kk-trl"
    assert anchors("# A\n\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def _block(text: str, name: str) -> str:
    return text[
        text.index(f"<!-- {name} -->") + len(f"<!-- {name} -->") : text.index(f"<!-- /{name} -->")
    ].strip()


def test_each_marker_block_is_in_one_place():
    """Each generated block (the memory model of `bench/probe_memory.py` in docs/results.md, the slow-tier
    list of docs/development.md) is in one place, once, opened before it is closed."""
    where = {}
    for doc, text in DOCS.items():
        for name in re.findall(r"<!-- ([\w-]+) -->", text):
            assert text.count(f"<!-- {name} -->") == 1 and text.count(f"<!-- /{name} -->") == 1, (doc, name)
            assert text.index(f"<!-- {name} -->") < text.index(f"<!-- /{name} -->"), (doc, name)
            assert name not in where, f"<!-- {name} --> in {where.get(name)} and {doc}"
            where[name] = doc
    assert where.get("memory-model") == "docs/results.md", where
    assert _block(DOCS["docs/results.md"], "memory-model")  # bench/probe_memory.py prints what goes there


def test_the_slow_tier_list_names_every_file_the_makefile_leaves_to_it():
    """The slow-tier list (docs/development.md) names exactly the test files that carry a marker `make test`
    deselects."""
    tier = re.search(r"^SLOW_TIER := (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).split(" or ")
    marked = {
        f"tests/{p.name}"
        for p in (ROOT / "tests").glob("test_*.py")
        if any(f"mark.{m}" in p.read_text() for m in tier)
    }
    listed = set(re.findall(r"`(tests/test_\w+\.py)`", _block(DOCS["docs/development.md"], "slow-tier")))
    assert tier and marked and listed == marked, (sorted(listed - marked), sorted(marked - listed))


# ---- the repository stands alone; the docs speak of the tool ---------------------------------------------------

# the folders scanned, with README.md, CHANGELOG.md and the files below
STANDALONE_SCOPE = ("src", "docs", "examples", "tests", "bench")
STANDALONE_FILES = (
    "README.md",
    "CHANGELOG.md",
    "CITATION.cff",
    "mkdocs.yml",
    "Makefile",
    "pyproject.toml",
    ".ci/run",
)
# this file holds the patterns below and the examples of their can-fail check: it is the one file not scanned
GUARD = Path(__file__).resolve()
TEXT_SUFFIXES = {".md", ".py", ".sh", ".txt", ".yml", ".yaml", ".toml", ".cff", ".cfg"}
# a path outside the repository: the reference notes it was written from, a sibling folder, an absolute work path
OUTSIDE = re.compile(
    r"PAPER\.md|\bKK\.md|REMEDIES(?:_BOTH_CAMPS)?\.md|STACK_NOTES|WARMSTART_NOTES|MISMATCH\.md|DESIGN\.md|STYLE\.md"
    r"|shared/reference|shared/data|\.\./shared|/work/"
)
# words about how the docs were made rather than about the tool
PROCESS = re.compile(
    r"\bissues? #?\d+|\bissue [\"“']|\bthe issue's\b|closing notes?|\blent\b|time box|no GPU was|device (?:tool|calls?)\b"
    r"|\bthis session\b|\bthe session\b"
    r"|measured here|\bcosts? here\b|here on one thread|\btook [^.\n]{0,30} here\b",
    re.I,
)


def standalone_files() -> list[Path]:
    files = [ROOT / f for f in STANDALONE_FILES]
    for top in STANDALONE_SCOPE:
        files += [
            p
            for p in sorted((ROOT / top).rglob("*"))
            if p.is_file() and p.suffix in TEXT_SUFFIXES and ".egg-info" not in p.as_posix() and p != GUARD
        ]
    return files


def offending_lines(pattern: re.Pattern, files: list[Path]) -> list[str]:
    out = []
    for p in files:
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                out.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    return out


def test_no_file_refers_to_a_path_outside_the_repository():
    files = standalone_files()
    assert len(files) > 100
    bad = offending_lines(OUTSIDE, files)
    assert not bad, (
        "paths outside the repository (say it in docs/paper.md, kk.md or remedies.md instead):\n"
        + ("\n".join(bad))
    )


def test_the_docs_speak_of_the_tool_not_of_how_they_were_made():
    bad = offending_lines(PROCESS, standalone_files())
    assert not bad, "words about how the docs were made (name the machine instead of 'here'):\n" + "\n".join(
        bad
    )


def test_the_standalone_checks_can_fail():
    assert OUTSIDE.search("see ../shared/reference/PAPER.md §4") and OUTSIDE.search("(``KK.md`` §1.3)")
    assert not OUTSIDE.search("docs/kk.md §1.3, docs/paper.md") and not OUTSIDE.search(
        "probe_dir=/shared/runs/x"
    )
    assert PROCESS.search("measured in issue 42") and PROCESS.search("when a GPU is lent")
    assert PROCESS.search("`tokendyn demo` took 8 min 4 s here (the runs")
    assert PROCESS.search('cost (issue "Right on every model", item 5)')
    assert PROCESS.search("# the issue's bound") and PROCESS.search("three device calls carry the wheels")
    assert not PROCESS.search("took 8 min on 2 CPU cores; the issues of verl") and not PROCESS.search(
        "where it is"
    )
    # the scan reaches the tests, the benches and CI's script, and leaves out only this file (its patterns)
    scanned = {p.relative_to(ROOT).as_posix() for p in standalone_files()}
    assert {"tests/test_kk_official.py", "tests/conftest.py", "bench/gpu_check.sh", ".ci/run"} <= scanned
    assert "tests/test_docs.py" not in scanned and offending_lines(OUTSIDE, [GUARD])


def test_the_license_and_the_citation_exist():
    import yaml

    assert (
        "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    )
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] and cff["title"].startswith("tokendyn") and cff["license"] == "Apache-2.0"
    paper = cff["preferred-citation"]
    assert "Low-Probability Tokens" in paper["title"] and "2505.12929" in paper["url"]


# ---- the README: a ten-minute read ------------------------------------------------------------------------------

README_WORDS = 1200
README_PARTS = (  # the headings, in order
    "Why",
    "Install",
    "Quickstart",
    "Four ways in",
    "Reading the results",
    "The remedies",
    "What is tested where",
    "What reproduces",
    "Documentation, citation, license",
    "Development",
)


def prose_words(text: str) -> int:
    """Words outside fenced code blocks and HTML comments (a table's cells count: they are read)."""
    prose = re.sub(r"<!--.*?-->", "", FENCE.sub("", text), flags=re.S)
    return len(re.findall(r"\S+", prose))


def test_the_readme_is_a_ten_minute_read():
    words = prose_words(README)
    assert words <= README_WORDS, f"README.md has {words} words outside code blocks (at most {README_WORDS})"
    headings = re.findall(r"^## +(.+?)\s*$", FENCE.sub("", README), re.M)
    found = [next((h for h in headings if h.startswith(part)), None) for part in README_PARTS]
    assert None not in found, dict(zip(README_PARTS, found, strict=True))
    assert [headings.index(h) for h in found] == sorted(headings.index(h) for h in found), headings
    first = README.split("\n## ", 1)[0]
    assert "docs/h_update_shares.png" in first and "arxiv.org/abs/2505.12929" in README
    quick = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert "tokendyn demo --quick" in quick and "report.html" in quick


def test_the_word_count_can_fail():
    assert prose_words("one two\n```bash\nnot counted here\n```\nthree <!-- nor this -->") == 3


def test_the_demos_time_is_stated_once_from_its_log():
    """The full demo's time is stated in one place (docs/results.md, "The demo"), as the run's own log gives it
    (docs/demo_log.txt: each run's `done in N s`, then `demo finished in N s`)."""
    log = (ROOT / "docs" / "demo_log.txt").read_text()
    finished = [int(m) for m in re.findall(r"^demo finished in (\d+) s$", log, flags=re.M)]
    runs = [int(m) for m in re.findall(r"^\s+done in (\d+) s;", log, flags=re.M)]
    assert len(finished) == 1 and len(runs) == 3
    results = DOCS["docs/results.md"]
    section = results.split("## The demo\n", 1)[1].split("\n## ", 1)[0]
    stated = re.search(
        r"(\d+) s on a fresh clone on 2 CPU cores[^(]*\(GRPO (\d+) s,\s+Reweight (\d+) s, Lopti (\d+) s",
        section,
    )
    assert stated, (
        "docs/results.md, The demo: 'N s on a fresh clone on 2 CPU cores ... (GRPO N s, Reweight N s, Lopti N s'"
    )
    assert int(stated[1]) == finished[0] and [int(x) for x in stated.groups()[1:]] == runs
    elsewhere = [
        doc
        for doc, text in {**DOCS, "CHANGELOG.md": (ROOT / "CHANGELOG.md").read_text()}.items()
        if doc != "docs/results.md" and f"{finished[0]} s" in text
    ]
    assert not elsewhere, f"the demo's time is stated again in {elsewhere}"


# ---- every flag a reading page names exists ---------------------------------------------------------------------

FLAG_PAGES = ("README.md", "docs/reading.md", "docs/glossary.md", "docs/faq.md", "docs/index.md", "docs/trl.md",
              "docs/offline.md")  # fmt: skip


@cache
def known_flags() -> set[str]:
    """Every option string of every command's parser, `train`'s own included."""
    flags = set(train_parser()._option_string_actions)
    stack = [cli_parser()]
    while stack:
        parser = stack.pop()
        flags |= set(parser._option_string_actions)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
    return flags


def test_every_flag_the_reading_pages_name_exists():
    bad = []
    for doc in FLAG_PAGES:
        text = FENCE.sub("", DOCS[doc])
        for code in re.findall(r"`([^`\n]+)`", text):
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", code):
                if flag not in known_flags():
                    bad.append(f"{doc}: {flag} (in `{code}`)")
    assert not bad, "\n".join(bad)


def test_the_reading_page_covers_every_section_of_the_report():
    """docs/reading.md has a heading per figure of the report (its title, in the report's order), the token view,
    and a row per table."""
    from tokendyn.figures.sections import FIGURES
    from tokendyn.figures.tables import TABLES

    reading = DOCS["docs/reading.md"]
    headings = re.findall(r"^## +(.+?)\s*$", FENCE.sub("", reading), re.M)
    at = []
    for spec in FIGURES:
        match = [i for i, h in enumerate(headings) if h.startswith(spec.title)]
        assert match, f"docs/reading.md has no section '{spec.title}' ({spec.name})"
        at.append(match[0])
    assert at == sorted(at), "docs/reading.md: the sections are not in the report's order"
    assert "Token view" in headings and "The tables" in headings
    tables = reading.split("## The tables", 1)[1]
    for title, _ in TABLES.values():
        short = " ".join(title.split(":")[0].split()[:2])
        assert f"\n| {short}" in tables, f"docs/reading.md, The tables: no row for '{title}'"
