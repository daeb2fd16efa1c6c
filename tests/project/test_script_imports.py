"""Scripts outside the package (bench/, gpu_checks/, tools/) run where the test suite does not: on the lent GPU,
or by hand. Every `clover_export` import they make, the lazy ones inside functions too, names a module and a
name that exist, so a moved module fails here rather than on the device."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for d in ("bench", "gpu_checks", "tools") for p in (REPO / d).rglob("*.py"))


def clover_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) of each clover_export import in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("clover_export"):
            out += [(node.lineno, node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names if a.name.startswith("clover_export")]
    return out


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_clover_export_import_of_a_script_resolves(path):
    missing = []
    for line, module, name in clover_imports(path):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            missing.append(f"{path.name}:{line}: {module} ({e})")
            continue
        if name is not None and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{path.name}:{line}: {module} has no {name}")
    assert not missing, "\n".join(missing)


def test_the_scripts_are_found():
    names = {p.name for p in SCRIPTS}
    assert {"gpu_check.py", "moe_trt_chain_gpu.py", "e2e_gpu.py", "soak.py"} <= names
