"""Reading a JSON object from a file, with errors that name the file (no tensor libraries)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clover_export.core.errors import CloverError


def read_json(path: Path, component: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CloverError(component, f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CloverError(component, f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CloverError(component, f"{path}: expected a JSON object")
    return data
