"""A script that is not part of the package (`bench/`, `tools/`) loaded as a module, for the tests that call
its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str | None = None) -> ModuleType:
    """The script at `path` as a module, registered in sys.modules under `name` (default: its file name with a
    `script_` prefix), since dataclasses look their module up there."""
    name = name or "script_" + path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
