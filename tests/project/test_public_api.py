"""`from clover_export import Generator, build, export, BuildOptions, ...`: one public surface, loaded lazily."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import clover_export

ROOT = Path(clover_export.__file__).parent


def test_the_public_names_are_the_objects_the_subpackages_define():
    from clover_export import (
        Artifact,
        BuildOptions,
        BuildResult,
        CloverError,
        ExportOptions,
        ExportResult,
        GenerationSettings,
        Generator,
        Result,
        ServeOptions,
        StreamChunk,
        build,
        build_app,
        export,
        load_artifact,
    )
    from clover_export.artifact import manifest
    from clover_export.core import errors, generation
    from clover_export.exporter import export as export_module
    from clover_export.pipeline import build as build_module
    from clover_export.runtime import Generator as RuntimeGenerator  # users' existing entry point
    from clover_export.runtime import output
    from clover_export.serve import app

    assert Generator is RuntimeGenerator
    assert (Result, StreamChunk) == (output.Result, output.StreamChunk)
    assert build is build_module.build and callable(build)
    assert (BuildOptions, BuildResult) == (build_module.BuildOptions, build_module.BuildResult)
    assert export is export_module.export and callable(export)
    assert (ExportOptions, ExportResult) == (export_module.ExportOptions, export_module.ExportResult)
    assert (Artifact, load_artifact) == (manifest.Artifact, manifest.load_artifact)
    assert GenerationSettings is generation.GenerationSettings
    assert (ServeOptions, build_app) == (app.ServeOptions, app.build_app)
    assert CloverError is errors.CloverError
    assert sorted(clover_export.__all__) == sorted([
        "Artifact", "BuildOptions", "BuildResult", "CloverError", "ExportOptions", "ExportResult", "GenerationSettings",
        "Generator", "Result", "ServeOptions", "StreamChunk", "build", "build_app", "export", "load_artifact"])
    assert set(clover_export.__all__) <= set(dir(clover_export))


def test_importing_the_package_loads_nothing_else():
    code = ("import sys, clover_export; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch', 'onnx', 'numpy', 'clover_export.'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent, check=True)
    assert r.stdout.strip() == "[]", r.stdout


def test_unknown_names_fail_and_subpackages_still_import():
    with pytest.raises(AttributeError, match="no attribute 'Generater'"):
        getattr(clover_export, "Generater")
    with pytest.raises(ImportError):
        from clover_export import Generater  # noqa: F401
    from clover_export import pipeline  # a subpackage, not a public name: the import system finds it
    assert pipeline.__name__ == "clover_export.pipeline"


def test_no_module_of_the_package_imports_the_public_surface():
    """The surface sits above every layer (tests/project/test_imports.py); a module reaching it through
    `from clover_export import build` would hide a cycle behind the lazy lookup."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "clover_export" and node.level == 0:
                public = [a.name for a in node.names if a.name in clover_export.__all__]
                if public:
                    offenders.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {', '.join(public)}")
    assert not offenders, offenders
