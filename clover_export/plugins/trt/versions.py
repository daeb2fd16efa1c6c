"""Which TensorRT the engine path needs: each feature used -> the first version that has it (STEP_GRAPH.md 2, 4).

Checked against NVIDIA/TensorRT's Python sources and samples at the release
tags (python/src/infer/pyCore.cpp, python/packaging/bindings_wheel/
tensorrt/plugin, samples/python/quickly_deployable_plugins) and
onnx-tensorrt's importer. `doctor` and `build` refuse an older TensorRT,
naming the features it lacks; `check` reports the floor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from clover_export.core.errors import CloverError


@dataclass(frozen=True)
class Feature:
    name: str
    since: tuple[int, int]
    why: str


FEATURES = (
    Feature("strongly typed networks, STRIP_PLAN / REFIT_IDENTICAL, OnnxParserRefitter, IProgressMonitor",
            (10, 0), "BF16/FP8 engines from the graph's types; weight-stripped plans refit from the ONNX"),
    Feature("PreviewFeature.ALIASED_PLUGIN_IO_10_03", (10, 3),
            "plugin outputs aliased to the cache-pool inputs (updated in place, nothing copied)"),
    Feature("tensorrt.plugin (register, autotune, TensorDesc.aliased)", (10, 6),
            "the clover plugins are quickly deployable Python plugins"),
    Feature("ONNX parser prefers a registered plugin over a model-local function", (10, 7),
            "older parsers import the function body instead of the plugin"),
    Feature("tensorrt.plugin.aot_impl, KernelLaunchParams, SymIntExprs", (10, 9),
            "every clover plugin is an AOT Triton kernel: no Python runs per step"),
    Feature("NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS and the ONNX node attribute aot", (10, 9),
            "select the AOT implementation of each plugin"),
)
MIN_TENSORRT = max(f.since for f in FEATURES)


def parse_version(version: str) -> tuple[int, int]:
    m = re.match(r"^\s*(\d+)\.(\d+)", str(version))
    if not m:
        raise ValueError(f"not a TensorRT version: {version!r}")
    return int(m.group(1)), int(m.group(2))


def version_text(v: tuple[int, int] = MIN_TENSORRT) -> str:
    return f"{v[0]}.{v[1]}"


def missing_features(version: str) -> list[Feature]:
    """The features this TensorRT version lacks (empty: it is new enough)."""
    v = parse_version(version)
    return [f for f in FEATURES if v < f.since]


def too_old_reason(version: str) -> str | None:
    """One line saying why `version` cannot build clover engines, or None."""
    missing = missing_features(version)
    if not missing:
        return None
    return (f"TensorRT {version} is older than {version_text()}, which the clover engines need; it lacks: "
            + "; ".join(f"{f.name} ({version_text(f.since)}: {f.why})" for f in missing))


def require_tensorrt(version: str, component: str = "tensorrt") -> None:
    reason = too_old_reason(version)
    if reason:
        raise CloverError(component, reason, f"install TensorRT {version_text()} or newer (pip install 'tensorrt>="
                          f"{version_text()}')")
