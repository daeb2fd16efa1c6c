"""ONNX Runtime straight from a model folder (optimum's `export=True`).

`Generator.load(MODEL, backend="ort")` / `generate MODEL --backend ort` on a
model folder (or `tiny`) exports its fp32 step graph into the cache folder
(`$CLOVER_EXPORT_CACHE`, default ~/.cache/clover-export) on first use and
reuses it afterwards. The cache entry is keyed by the checkpoint's identity
(name, size and mtime of its config, generation config and weight files) and
the exporter's (package version plus a hash of the exporter, model and plugin
sources), so a changed checkpoint or exporter makes a fresh export. The
export writes a temporary folder and renames it into place (exporter.export),
so an interrupted run leaves no half entry.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from importlib import metadata
from pathlib import Path
from typing import Callable

from clover_export.model.loading import resolve_model_dir

CACHE_SUBDIR = "ort-exports"
_SOURCE_DIRS = ("core", "artifact", "model", "plugins", "exporter")  # the code that decides what an export contains
_CHECKPOINT_SUFFIXES = (".json", ".safetensors")


def exporter_fingerprint() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    try:
        h.update(metadata.version("clover-export").encode())
    except metadata.PackageNotFoundError:
        pass
    for d in _SOURCE_DIRS:
        for f in sorted((root / d).rglob("*")):
            if f.suffix in (".py", ".csv") and f.is_file():
                h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def checkpoint_identity(model_dir: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(model_dir.iterdir()):
        if f.suffix in _CHECKPOINT_SUFFIXES and f.is_file():
            st = f.stat()
            h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    h.update(str(model_dir.resolve()).encode())
    return h.hexdigest()


def cache_entry(model_dir: Path) -> Path:
    from clover_export.tiny import cache_root

    key = hashlib.sha256((checkpoint_identity(model_dir) + exporter_fingerprint()).encode()).hexdigest()[:20]
    return cache_root() / CACHE_SUBDIR / f"{model_dir.name}-fp32-{key}"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def exported_artifact(model: str | Path | None, log: Callable[[str], None] = _stderr) -> Path:
    """The cached fp32 export of MODEL (a model folder or `tiny`), made now if missing."""
    from clover_export.artifact.manifest import is_artifact
    from clover_export.core.atomic import exclusive

    model_dir = resolve_model_dir(model)
    entry = cache_entry(model_dir)
    if is_artifact(entry):
        log(f"ort: using the cached fp32 export of {model_dir} ({entry})")
        return entry
    # processes starting together (servers, test workers) export once: the others wait, then use that export
    with exclusive(entry.with_name(f".{entry.name}.lock")):
        if is_artifact(entry):
            log(f"ort: using the cached fp32 export of {model_dir} ({entry}), made meanwhile by another process")
            return entry
        return _export_into(model_dir, entry, log)


def _export_into(model_dir: Path, entry: Path, log: Callable[[str], None]) -> Path:
    from clover_export.exporter.export import export

    log(f"ort: exporting {model_dir} to an fp32 ONNX graph in the cache ({entry}); once, reused afterwards")
    # the line above announces the export; its progress lines would land on `generate`'s stdout (the text)
    progress = logging.getLogger("clover_export.exporter.export")
    level = progress.level
    progress.setLevel(logging.WARNING)
    try:
        export(model_dir, entry, dtype="fp32", weights="copy")
    finally:
        progress.setLevel(level)
    return entry
