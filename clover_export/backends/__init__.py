"""One backend contract, four implementations: torch, ort, trt, triton (STEP_GRAPH.md 1; Polygraphy's runners).

A backend runs one step: named step inputs (`clover_export.core.names`) and the
cache pools in, `(logits [B, N, V] fp32, coreset_size [B, layers] int32,
pools)` out, all torch tensors on `backend.device`. The caller may
overwrite the logits; they stay valid until the next step. The returned pools are the ones
to pass next time (the same tensors when the backend updates them in
place). The loop never knows which backend it drives.
"""

from __future__ import annotations

import torch

from clover_export.artifact.manifest import is_artifact
from clover_export.backends.base import BACKENDS, Backend, StepShape
from clover_export.core.errors import CloverError

__all__ = ["BACKENDS", "Backend", "StepShape", "default_backend", "is_artifact", "open_backend"]


def default_backend(model_or_artifact=None, device: str | None = None) -> str:
    """ort for an artifact; else triton on a CUDA GPU without TensorRT (the compiled path); else torch."""
    import importlib.util

    if is_artifact(model_or_artifact):
        return "ort"
    on_cuda = str(device).startswith("cuda") if device else torch.cuda.is_available()
    if on_cuda and importlib.util.find_spec("triton") and not importlib.util.find_spec("tensorrt"):
        return "triton"
    return "torch"


def open_backend(name: str, model_or_artifact=None, **options) -> Backend:
    """`torch` and `triton` take a model folder (or None = the embedded default); `ort` an exported
    artifact; `trt` a TensorRT engine (file or folder)."""
    if name == "torch":
        from clover_export.backends.torch_backend import TorchBackend

        if is_artifact(model_or_artifact):
            raise CloverError(
                "runtime",
                f"{model_or_artifact}: is an exported artifact; the torch backend runs a model folder",
                "pass --backend ort for an artifact, or the model folder it was exported from",
            )
        return TorchBackend.load(model_or_artifact, **options)
    if name == "ort":
        from clover_export.backends.ort_backend import OrtBackend

        return OrtBackend.load(model_or_artifact, **options)
    if name == "triton":
        from clover_export.backends.triton_backend import TritonBackend

        return TritonBackend.load(model_or_artifact, **options)
    if name == "trt":
        from clover_export.backends.trt_backend import TrtBackend

        return TrtBackend.load(model_or_artifact, **options)
    raise CloverError("runtime", f"unknown backend {name!r}", f"expected one of {', '.join(BACKENDS)}")
