"""TensorRT plugin registration of the `clover::` ops (STEP_GRAPH.md 2, 4), import-guarded.

Importing this package registers the plugins when `tensorrt.plugin` is
importable (`AVAILABLE` says whether it was); without TensorRT it imports
cleanly and only the plain decisions in `plan.py` are there. The engine
build must enable the preview features in `plan.PREVIEW_FEATURES` so that
the cache outputs may alias the cache inputs.
"""

from __future__ import annotations

from clover_export.plugins.trt import plan  # noqa: F401  (plain decisions, always importable)

try:
    import tensorrt.plugin  # noqa: F401
except ImportError:  # no TensorRT on this machine
    AVAILABLE = False
    REGISTERED: tuple[str, ...] = ()
else:
    from clover_export.plugins.trt.register import register_all

    AVAILABLE = True
    REGISTERED = register_all()
