"""The package's import graph (every import statement, the lazy ones inside functions too)."""

from __future__ import annotations

import ast
from pathlib import Path

import clover_export

ROOT = Path(clover_export.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the clover_export modules it imports anywhere in its text."""
    mods = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in mods and t != name}
        graph[name] = deps
    return graph


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """An import path start -> ... -> goal, or None."""
    stack, seen = [[start]], {start}
    while stack:
        path = stack.pop()
        for nxt in sorted(graph[path[-1]]):
            if nxt == goal:
                return path + [nxt]
            if nxt not in seen:
                seen.add(nxt)
                stack.append(path + [nxt])
    return None


def test_models_and_the_embedded_default_import_each_other_one_way_only():
    graph = import_graph()
    assert "clover_export.tiny" in graph["clover_export.models"]  # resolve_model_dir("tiny")
    for mod in ("clover_export.models", "clover_export.tiny"):
        assert reaches(graph, mod, mod) is None, " -> ".join(reaches(graph, mod, mod))
