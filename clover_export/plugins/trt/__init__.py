"""TensorRT plugin registration of the `clover::` plugin ops (STEP_GRAPH.md 2, 4), import-guarded.

Importing this package registers the plugins of `model.trt.onnx`
(`contracts.TRT_CONTRACTS`, all AOT) when `tensorrt.plugin` is importable:
`AVAILABLE` says whether it was, `REGISTERED` lists the plugin ids and
`IMPORT_ERROR` says why not (empty when TensorRT is simply absent). Without
TensorRT it imports cleanly and only the plain decisions in `plan.py` are
there. The engine build checks `REGISTERED` against the graph's clover ops
before parsing, and enables the preview features in `plan.PREVIEW_FEATURES`
so that the cache outputs may alias the cache inputs.
"""

from __future__ import annotations

from clover_export.plugins.trt import plan  # noqa: F401  (plain decisions, always importable)

AVAILABLE = False
REGISTERED: tuple[str, ...] = ()
IMPORT_ERROR = ""
try:
    import tensorrt.plugin  # noqa: F401
except ModuleNotFoundError as e:  # no TensorRT on this machine (or a part of it missing: say which)
    IMPORT_ERROR = "" if e.name == "tensorrt" else f"{type(e).__name__}: {e}"
except Exception as e:  # a broken install (missing libnvinfer, ...): keep the reason for the build's error
    IMPORT_ERROR = f"{type(e).__name__}: {e}"
else:
    from clover_export.plugins.trt.register import register_all

    AVAILABLE = True
    REGISTERED = register_all()
