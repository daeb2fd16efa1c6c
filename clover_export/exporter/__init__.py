"""The exporter: step graph to ONNX with plugin ops, weights as external data (STEP_GRAPH.md 1-3).

Runtime-facing API (light imports; onnxruntime is imported on use):
    load_artifact(dir) -> Artifact           the export folder's manifest as a dataclass
    ort_session(artifact, providers=None)    an onnxruntime.InferenceSession (handles --weights map)
Export / check / validate: `export.export`, `check.check_folder`, `validate.validate` (also the CLI).
"""

from clover_export.artifact.manifest import Artifact, IOSpec, load_artifact
from clover_export.exporter.session import ort_session

__all__ = ["Artifact", "IOSpec", "load_artifact", "ort_session"]
