"""One artifact folder, written whole or not at all (STEP_GRAPH.md 1-3; the layout: `artifact/manifest.py`).

`export` and the FP8 rewrite both write through `ArtifactWriter`:

    dest = ArtifactWriter(out, "export", command="export", what="the export", model_dirs=[model_dir])
    ...                                   # OUT is claimed above: a refusal costs no work
    with dest:                            # a temporary folder beside OUT: dest.dir
        ...                               # weights into dest.dir/weights/
        dest.write(proto, manifest, weight_map, companions_from=model_dir, tensorrt_pool_len=...)
        dest.commit()                     # OUT re-checked, then the folder renamed into place

Leaving the block without `commit` (an exception, a failed check) removes the temporary folder, so an
earlier artifact at OUT stays as it was; an OSError on the way becomes one CloverError line naming the file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

import onnx

from clover_export.artifact.manifest import COMPANION_FILES, GRAPH, MANIFEST, WEIGHT_MAP, Manifest
from clover_export.artifact.outdir import claim_dir, commit_dir
from clover_export.core.errors import CloverError
from clover_export.exporter.trt_graph import TRT_GRAPH, write_trt_graph


class ArtifactWriter:
    """Claims OUT (`artifact.outdir`: kind "export" or "fp8"), fills a temporary sibling, commits it atomically.

    command: the CloverError component ("export", "quantize"); what: the artifact in errors ("the export")."""

    def __init__(self, out: str | Path, kind: str, *, command: str, what: str, force: bool = False,
                 model_dirs: Iterable[Path] = ()):
        self.kind, self.command, self.what, self.force = kind, command, what, force
        self.model_dirs = [Path(m) for m in model_dirs]
        self.out = claim_dir(out, kind, command=command, force=force, model_dirs=self.model_dirs)
        self.dir: Path | None = None  # the temporary folder, inside `with`
        self._committed = False

    def __enter__(self) -> ArtifactWriter:
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.dir = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", dir=self.out.parent))
        except OSError as e:
            raise CloverError(self.command, f"cannot create a folder beside {self.out} ({e.strerror or e})") from None
        _chmod_like_umask(self.dir)
        self._committed = False
        return self

    def write(self, graph: onnx.ModelProto, manifest: Manifest, weight_map: dict, companions_from: Path,
              tensorrt_pool_len: int | None = None) -> int:
        """model.onnx, manifest.json, weights.json and the companion files found in `companions_from`; with
        `tensorrt_pool_len` also model.trt.onnx (`trt_graph`), recorded as the manifest's "tensorrt" entry
        (else that entry is left out). `graph`'s initializers already point at files in `self.dir`.
        Returns the bytes of the graph and JSON files written."""
        onnx.save_model(graph, str(self.dir / GRAPH))
        written = [GRAPH, WEIGHT_MAP, MANIFEST]
        trt = None
        if tensorrt_pool_len is not None:  # what TensorRT parses: no clover functions, MoE as AOT sub-ops
            trt = write_trt_graph(self.dir, graph, manifest.config.num_experts, tensorrt_pool_len)
            written.append(TRT_GRAPH)
        (self.dir / WEIGHT_MAP).write_text(json.dumps(weight_map))
        manifest.replace(tensorrt=trt).write(self.dir)
        for fname in COMPANION_FILES:  # the runtime needs them; the model folder may move
            if (Path(companions_from) / fname).is_file():
                shutil.copyfile(Path(companions_from) / fname, self.dir / fname)
        return sum((self.dir / f).stat().st_size for f in written)

    def commit(self) -> None:
        """Re-check OUT (it may have changed during the work), then rename the folder into place."""
        commit_dir(self.dir, self.out, self.kind, command=self.command, force=self.force, model_dirs=self.model_dirs)
        self._committed = True

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self._committed:
            shutil.rmtree(self.dir, ignore_errors=True)
        if isinstance(exc, OSError):
            where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
            raise CloverError(self.command, f"writing {self.what} failed: {exc.strerror or exc}{where}",
                              f"nothing was written; {self.out} is as it was before") from None
        return False


def _chmod_like_umask(path: Path) -> None:
    """mkdtemp makes 0700 folders; an artifact gets the usual permissions."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o777 & ~mask)
