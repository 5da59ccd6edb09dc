"""The docs stay true. Every code block of README.md and docs/ runs as written or is an excerpt of a tested example:
a Python block is an excerpt of an example (which tests/test_examples.py runs; a line `...` marks elided lines) or
is run here; every `tokendyn` command line of a shell block names a command and only options and values the
command's own parser accepts (parsed by the real CLI parsers, nothing run). docs/records.md documents every record
kind and column of `tokendyn.records.SCHEMAS`; every relative link of README.md, CHANGELOG.md and docs/ points into
the repository, and every anchor to a heading there; the marker blocks (`<!-- study -->`, `<!-- memory-model -->`)
are where the generators' output is pasted, once each."""

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
LINKED = {**DOCS, "CHANGELOG.md": (ROOT / "CHANGELOG.md").read_text()}  # whose links and anchors are checked
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
                    t == "tokendyn"
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
    """The study table is pasted into the README, the memory model (`bench/probe_memory.py`) into docs/results.md,
    each once, opened before it is closed."""
    where = {}
    for doc, text in DOCS.items():
        for name in re.findall(r"<!-- ([\w-]+) -->", text):
            assert text.count(f"<!-- {name} -->") == 1 and text.count(f"<!-- /{name} -->") == 1, (doc, name)
            assert text.index(f"<!-- {name} -->") < text.index(f"<!-- /{name} -->"), (doc, name)
            assert name not in where, f"<!-- {name} --> in {where.get(name)} and {doc}"
            where[name] = doc
    assert where.get("study") == "README.md" and where.get("memory-model") == "docs/results.md", where
    assert _block(DOCS["docs/results.md"], "memory-model")  # bench/probe_memory.py prints what goes there


def test_the_readme_study_table_is_the_generated_one():
    """The README's *what reproduces* table (between the study markers) is docs/study/study.md's, unedited: the
    verdicts are the report's, not typed by hand."""
    block = _block(README, "study")
    study = (ROOT / "docs" / "study" / "study.md").read_text()
    assert block.startswith("Each claim is a statistic") and "| phenomenon |" in block
    assert block in study
    assert study.index(block) > study.index("## What reproduces")


def test_the_readme_is_short_and_starts_with_the_two_commands():
    lines = README.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250: the manuals live in docs/)"
    first_screen = "\n".join(lines[:40])
    assert "make demo" in first_screen and "make test" in first_screen


def test_the_readme_real_llm_table_is_the_demos():
    """The README's real-LLM *what reproduces* rows (between the real-llm markers) are the real LLM's demo table
    (docs/real_llm/demo/reproduces.md, the demo's figures/reproduces.md copied unedited), row for row."""
    block = _block(README, "real-llm")
    demo = (ROOT / "docs" / "real_llm" / "demo" / "reproduces.md").read_text()
    assert block.startswith("| phenomenon |") and block.count("\n") >= 10
    assert block in demo
    assert demo[demo.index(block) :].startswith("| phenomenon |")


def test_the_readmes_demo_time_is_the_measured_one():
    """The README's `make demo` time is the one measured on a fresh clone, as that run's own log says it
    (docs/demo_log.txt: the demo's console lines, its `demo finished in N s` last): within 10 %, and each run's time
    as the log gives it."""
    log = (ROOT / "docs" / "demo_log.txt").read_text()
    finished = [int(m) for m in re.findall(r"^demo finished in (\d+) s$", log, flags=re.M)]
    assert len(finished) == 1, "docs/demo_log.txt: one 'demo finished in N s' line"
    stated = re.search(r"`make demo` took\s+(\d+)\s+min\s+(\d+)\s+s", README)
    assert stated, "README.md: '`make demo` took M min S s'"
    seconds = 60 * int(stated[1]) + int(stated[2])
    assert abs(seconds - finished[0]) <= 0.1 * finished[0], (seconds, finished[0])
    runs = [int(m) for m in re.findall(r"^\s+done in (\d+) s;", log, flags=re.M)]
    said = re.search(r"three runs of\s+\d+\s+rollouts,\s+(\d+)\s+/\s+(\d+)\s+/\s+(\d+)\s+s", README)
    assert said and [int(x) for x in said.groups()] == runs, (said and said.groups(), runs)
