"""docs/architecture.md's request journey and docs/runtime.md's "Inside a step" name the runtime's code: every
class, function, method, field and module they name exists (a rename that forgets the docs fails here)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import clover_export

ROOT = Path(clover_export.__file__).parent
DOCS = ROOT.parent / "docs"
CODE = ("runtime", "backends")  # the step's code and the backend contract it calls


def defined_names() -> set[str]:
    """Module, class, function, method, field and attribute names defined under CODE."""
    names = set()
    for package in CODE:
        for path in (ROOT / package).rglob("*.py"):
            names |= {path.stem, path.parent.name}
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(node.name)
                targets = node.targets if isinstance(node, ast.Assign) else (
                    [node.target] if isinstance(node, ast.AnnAssign) else [])
                for t in targets:
                    if isinstance(t, ast.Name):
                        names.add(t.id)
                    elif isinstance(t, ast.Attribute):
                        names.add(t.attr)
    return names


NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+|\b[A-Z][a-z]\w*[A-Z]\w*\b|\b[a-z_]\w*(?=\()")


def named_in(text: str) -> set[str]:
    """Dotted names (module.attr, Class.method), CamelCase names with an inner capital and called names
    (`name(...)`) in `text`; file names (x.py, X.md) are paths, not code names."""
    return {n for n in NAME.findall(text) if not n.endswith((".py", ".md", ".json"))}


def journey() -> str:
    text = (DOCS / "architecture.md").read_text()
    return text[text.index("runtime/loop.py        Loop.step"):text.index("backends/              torch")]


def inside_a_step() -> str:
    text = (DOCS / "runtime.md").read_text()
    return text[text.index("## Inside a step"):text.index("## Requests: checks")]


def test_the_docs_name_only_code_that_exists():
    names = defined_names()
    missing = {n for n in named_in(journey()) | named_in(inside_a_step())
               if not all(part in names for part in n.split("."))}
    assert not missing, sorted(missing)


def test_the_check_sees_a_name_that_is_not_there():
    names = defined_names()
    assert {"StateMover", "RowOutput", "Strategy", "advance"} <= names
    assert named_in("Runner.run -> StepUndo / x.py, restore(held)") == {"Runner.run", "StepUndo", "restore"}
    assert "snapshot" not in names and "Runner.snapshot" in named_in("then Runner.snapshot(plan)")
