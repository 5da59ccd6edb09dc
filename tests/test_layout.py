"""The rooms of the package import one way (DESIGN.md "Layout"): every ``import`` in src/tokendyn, nested ones
included, read with ``ast`` and checked against the allowed arrows. A new upward import fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import tokendyn

SRC = Path(tokendyn.__file__).parent

# room -> the rooms it may import (leaves: common, records, remedies, policy; "__init__" is the package root,
# imported for its version)
ALLOWED = {
    "common": set(),
    "records": {"common"},
    "remedies": set(),
    "policy": {"common"},
    "tasks": {"common"},
    "probe": {"common", "records", "remedies"},
    "hooks": {"common", "records", "remedies", "policy", "probe", "tasks"},
    "trainers": {"__init__", "common", "records", "remedies", "policy", "probe", "hooks", "tasks"},
    "analysis": {"common", "records"},
    "figures": {"common", "records", "analysis"},
    "commands": {"common", "records", "policy", "trainers", "figures", "analysis"},
    "cli": {"__init__", "common"},  # commands are found by name (importlib), not imported
    "__init__": {"analysis"},  # load_run, imported on first use
    "__main__": {"cli"},
}


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path) -> set[str]:
    """The tokendyn modules ``path`` imports (relative imports resolved)."""
    rel = path.relative_to(SRC.parent).with_suffix("")
    package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
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
            if name.split(".")[0] == "tokendyn":
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    """room -> rooms it imports (itself left out)."""
    out: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        room = rel.parts[0].removesuffix(".py")
        targets = {room_of(m) for m in imports(path)} - {room}
        out.setdefault(room, set()).update(targets)
    return out


def test_rooms_import_one_way():
    g = graph()
    assert set(g) <= set(ALLOWED), f"rooms without a rule: {set(g) - set(ALLOWED)}"
    wrong = {room: sorted(targets - ALLOWED[room]) for room, targets in g.items() if targets - ALLOWED[room]}
    assert not wrong, f"imports against the layout: {wrong}"


def test_the_checker_sees_nested_and_relative_imports():
    # probe/influence.py imports the remedies inside a function; trainers/ imports hooks/ with a relative import
    assert "remedies" in graph()["probe"]
    assert "hooks" in graph()["trainers"]
