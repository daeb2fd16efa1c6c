"""The tests are grouped as the package is (tests/README.md): every test module sits in a folder named after a
package of clover_export, or in `project/` for the repository as a whole, so a module's tests are found
beside its name."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import clover_export

TESTS = Path(__file__).resolve().parents[1]
PACKAGES = {p.name for p in Path(clover_export.__file__).parent.iterdir() if (p / "__init__.py").is_file()}
GROUPS = PACKAGES | {"project"}


def group_folders() -> list[Path]:
    return sorted(p for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


def test_every_test_module_sits_in_a_folder_named_after_a_package():
    modules = [p.relative_to(TESTS) for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts]
    misplaced = [m.as_posix() for m in modules
                 if m.as_posix() != "conftest.py" and (len(m.parts) != 2 or m.parts[0] not in GROUPS)]
    assert misplaced == [], f"not in tests/<package>/ (packages: {sorted(GROUPS)})"


def test_every_group_folder_is_a_package_or_the_project():
    assert [p.name for p in group_folders() if p.name not in GROUPS] == []


def test_module_names_are_unique_across_folders():
    """Tests import each other by module name (pytest's default import mode): two files of one name would clash."""
    names = Counter(p.name for p in TESTS.glob("*/*.py"))
    assert [n for n, count in names.items() if count > 1] == []


def test_every_group_folder_is_on_the_import_path(pytestconfig):
    """pyproject.toml's `pythonpath` lists each folder, so `from test_loop import LONG, PROMPTS` works
    from any folder and when one file runs alone."""
    on_path = {Path(p).resolve() for p in pytestconfig.getini("pythonpath")}
    assert [p.name for p in group_folders() if p not in on_path] == []


def test_the_readme_names_every_group():
    readme = (TESTS / "README.md").read_text()
    assert [p.name for p in group_folders() if f"`{p.name}/`" not in readme] == []
