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
    assert "clover_export.tiny" in graph["clover_export.model.loading"]  # resolve_model_dir("tiny")
    for mod in ("clover_export.model.loading", "clover_export.tiny"):
        assert reaches(graph, mod, mod) is None, " -> ".join(reaches(graph, mod, mod))


# The packages as the pipeline, lowest first (docs/architecture.md): each may import only from itself and
# the layers before it. `tiny` (the embedded default model) sits with `model`; `testing` (fixtures of tests
# and benchmarks) at the top with `train`.
LAYERS = (("core",), ("artifact",), ("model", "tiny"), ("plugins",), ("exporter",), ("quantize",), ("engines",),
          ("backends",), ("verify",), ("pipeline",), ("constraints",),
          ("runtime",), ("serve",), ("cli",), ("train", "testing"))


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return len(LAYERS)  # the package's own __init__: the public surface, above everything
    for i, names in enumerate(LAYERS):
        if parts[1] in names:
            return i
    raise AssertionError(f"{module}: in no layer of LAYERS (add its package there)")


def backward_edges(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps if layer_of(b) > layer_of(a))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_every_package_imports_only_from_earlier_layers():
    assert backward_edges(import_graph()) == []


def test_no_import_cycle_in_function_imports_included():
    assert cycles(import_graph()) == []


def test_the_layer_and_cycle_checks_catch_what_they_guard():
    graph = import_graph()
    late = dict(
        graph, **{"clover_export.core.config": graph["clover_export.core.config"] | {"clover_export.runtime.loop"}}
    )
    assert backward_edges(late) == ["clover_export.core.config -> clover_export.runtime.loop"]
    loop = dict(graph, **{"clover_export.model.gdn": graph["clover_export.model.gdn"] | {"clover_export.model.model"}})
    assert any({"clover_export.model.gdn", "clover_export.model.model"} <= set(c) for c in cycles(loop))


def test_the_design_card_s_names_in_the_architecture_page_are_packages():
    """docs/architecture.md maps the design card's names (exporter/, plugins/, runtime/, engines/) to packages:
    every folder that section names is a package of clover_export, and every card name is one of them."""
    import re

    page = (ROOT.parent / "docs" / "architecture.md").read_text()
    section = page.split("## The design card's names", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(\w+)/`", section)) - {"clover_export"}
    assert {"exporter", "plugins", "runtime", "engines"} <= named
    assert sorted(n for n in named if not (ROOT / n / "__init__.py").is_file()) == []


TORCH_FREE = ("clover_export.serve.app", "clover_export.serve.engine_process", "clover_export.runtime.frontend",
              "clover_export.constraints", "clover_export.core.config")


def test_what_a_servers_http_process_imports_needs_no_torch():
    """The HTTP process of `serve --engine process` loads no model; these modules (its imports at start and on
    each request) import without torch. tests/serve/test_serve_engine_process.py checks the running server."""
    import subprocess
    import sys

    code = f"import sys\nfor m in {TORCH_FREE!r}: __import__(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
