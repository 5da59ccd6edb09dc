"""The rooms of the package import one way (the order below, `ORDER`): every ``import`` in src/tokendyn, nested ones
included, read with ``ast``. Two checks: the room graph has no arrow up the room order (`ORDER`), and the module
graph has no cycle at all (so no import inside a function is there to break one). A new upward import fails here.
And no file under src/ is over `MAX_LINES` lines, but those of the shrinking list `OVER_MAX_LINES`."""

from __future__ import annotations

import ast
from pathlib import Path

import tokendyn

SRC = Path(tokendyn.__file__).parent

# the room order, bottom up: a room may import only rooms of a lower rank (cli -> hooks/trainers ->
# effects -> probe -> (torch); figures -> analysis -> records on disk). "__init__" is the package root: it re-exports the entry
# points, so it sits on top and no room imports it.
ORDER = {
    "version": 0,
    "vocab": 0,
    "common": 0,
    "packaged": 0,  # pretrained models from packages / GGUF files, converted to model directories
    "binspec": 0,  # bin specs parsed without torch (the configuration checks run before torch is imported)
    "schemas": 0,  # the record kinds' schemas (polars only); `records` writes and reads the files
    "config": 1,
    "records": 1,
    "remedies": 1,
    "policy": 1,
    "tasks": 1,
    "probe": 2,  # the recorder, and the objective and its rules (which the trainers' loss reads too)
    "analysis": 2,
    "effects": 3,  # what an update does to each token: the model-based analyses, above the recorder
    "hooks": 4,
    "figures": 4,
    "integrations": 5,  # glue for other stacks (verl, vLLM's CPU engine): remedies, probe and hooks below it
    "trainers": 6,  # TRL's trainer: its colocated vLLM engine is built through integrations.vllm_cpu
    "commands": 7,
    "cli": 8,  # commands are found by name (importlib), not imported
    "__main__": 9,
    "__init__": 10,
}


def module_of(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_of(p): p for p in SRC.rglob("*.py")}


def imports(module: str) -> set[str]:
    """The tokendyn modules ``module`` imports, nested imports included; relative imports resolved, and
    ``from package import name`` read as the submodule package.name where that is a module."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "tokendyn"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.split(".")[0] != "tokendyn":
                continue
            subs = {f"{name}.{a.name}" for a in node.names} & set(MODULES)
            found |= subs or {name}
            if len(subs) < len(node.names):
                found.add(name)
    return found - {module}


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def room_graph() -> dict[str, set[str]]:
    """room -> rooms it imports (itself left out)."""
    out: dict[str, set[str]] = {}
    for module in MODULES:
        room = room_of(module)
        out.setdefault(room, set()).update({room_of(m) for m in imports(module)} - {room})
    return out


def module_cycle() -> list[str] | None:
    """One import cycle between modules (as a path), or None. A package's __init__ imported by its own submodule is
    a cycle too: importing the submodule runs the __init__ first."""
    graph = {m: {t for t in imports(m) if t in MODULES} for m in MODULES}
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return stack[stack.index(t) :] + [t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_every_room_has_a_rank():
    assert set(room_graph()) <= set(ORDER), f"rooms without a rank: {set(room_graph()) - set(ORDER)}"


def test_no_arrow_points_up_the_room_order():
    up = {
        room: sorted(t for t in targets if ORDER[t] >= ORDER[room])
        for room, targets in room_graph().items()
        if any(ORDER[t] >= ORDER[room] for t in targets)
    }
    assert not up, f"imports up (or across) the room order: {up}"


def test_no_module_import_cycle():
    cycle = module_cycle()
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_nobody_imports_the_package_root():
    assert not {room for room, targets in room_graph().items() if "__init__" in targets}


def test_the_checker_sees_nested_relative_and_submodule_imports():
    assert "tokendyn.remedies" in imports("tokendyn.effects.influence")  # inside a function
    assert "tokendyn.vocab" in imports("tokendyn")  # `from tokendyn import vocab`: the submodule
    assert "tokendyn.probe.parallel" in imports(
        "tokendyn.probe.probe"
    )  # `from tokendyn.probe import parallel`
    assert "trainers" in room_graph()["__init__"]  # the root's TYPE_CHECKING imports count


def test_the_cycle_finder_can_fail(monkeypatch):
    real = imports
    fake = {"tokendyn.vocab": {"tokendyn.config"}, "tokendyn.config": {"tokendyn.vocab"}}
    monkeypatch.setitem(globals(), "imports", lambda m: fake.get(m, real(m)))
    cycle = module_cycle()
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"tokendyn.config", "tokendyn.vocab"}


# files of one job: no file under src/ over MAX_LINES lines. The files still over it, each to be split by whoever
# owns it (a file leaves this list when it is split; the list only shrinks)
MAX_LINES = 400
OVER_MAX_LINES: set[str] = set()


def line_counts() -> dict[str, int]:
    """src/tokendyn file (relative path) -> its number of lines."""
    return {p.relative_to(SRC).as_posix(): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}


def test_no_file_over_max_lines_but_the_listed():
    over = {f: n for f, n in line_counts().items() if n > MAX_LINES}
    new = {f: n for f, n in over.items() if f not in OVER_MAX_LINES}
    assert not new, f"files over {MAX_LINES} lines (split them along their seams): {new}"


def test_the_list_of_long_files_only_shrinks():
    counts = line_counts()
    done = sorted(f for f in OVER_MAX_LINES if counts.get(f, 0) <= MAX_LINES)
    assert not done, f"at or under {MAX_LINES} lines now (or gone): take them off OVER_MAX_LINES: {done}"
