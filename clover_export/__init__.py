"""clover-export: ONNX export, TensorRT / ONNX Runtime builds and a block-diffusion runtime for Clover-35B-A3B.

The Python API in one place (the same functions the `clover-export` commands call)::

    from clover_export import BuildOptions, Generator, build, export

    build("tiny", "build/tiny", BuildOptions(precision="bf16"))  # `clover-export build`
    gen = Generator.load("build/tiny/onnx-fp32")  # an export folder: ONNX Runtime
    print(gen.generate("Sort: 7 3 9 1 4").text)

The names load on first use (PEP 562), so `import clover_export` imports neither torch nor any
subpackage; this module is the top of the layer order (docs/architecture.md).
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    # export: a model folder -> an artifact folder (graph, weights, manifest)
    "export": "clover_export.exporter.export",
    "ExportOptions": "clover_export.exporter.export",
    "ExportResult": "clover_export.exporter.export",
    # build: export, FP8, validation and TensorRT engines as one resumable pipeline
    "build": "clover_export.pipeline.build",
    "BuildOptions": "clover_export.pipeline.context",
    "BuildResult": "clover_export.pipeline.context",
    # the artifact folder format
    "Artifact": "clover_export.artifact.manifest",
    "load_artifact": "clover_export.artifact.manifest",
    # generation
    "Generator": "clover_export.runtime.generator",
    "GenerationSettings": "clover_export.core.generation",
    "Result": "clover_export.runtime.output",
    "StreamChunk": "clover_export.runtime.output",
    # the OpenAI-compatible server
    "ServeOptions": "clover_export.serve.app",
    "build_app": "clover_export.serve.app",
    # every user-facing failure
    "CloverError": "clover_export.core.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'clover_export' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
