"""The lint CI runs: `ruff check` over the repository with pyproject.toml's [tool.ruff] rules."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ruff_check(folder: Path) -> subprocess.CompletedProcess:
    cmd = [shutil.which("ruff")] if shutil.which("ruff") else [sys.executable, "-m", "ruff"]
    return subprocess.run([*cmd, "check", "--no-cache", str(folder)], capture_output=True, text=True, cwd=folder)


def test_ruff_finds_nothing():
    r = ruff_check(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_reports_a_finding(tmp_path):
    """The same call fails on a file with an unused import (the lint is really run)."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "bad.py").write_text("import os\n")
    r = ruff_check(tmp_path)
    assert r.returncode == 1 and "F401" in r.stdout
