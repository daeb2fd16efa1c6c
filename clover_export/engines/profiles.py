"""TensorRT build settings, decided without TensorRT (STEP_GRAPH.md 4).

The optimisation profiles themselves come from the artifact's manifest
(`exporter.export.profiles`, one place): each profile lists min/opt/max
shapes per input, which the builder passes to TensorRT as they are.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BuildSettings:
    precision: str  # bf16 | fp8
    workspace_bytes: int
    strip_weights: bool  # weight-stripped plan + refit from the ONNX at load
    timing_cache: str | None
    builder_optimization_level: int = 3

    def flags(self, trt_major: int) -> list[str]:
        """BuilderFlag names to set. TensorRT 11 is strongly typed only (no precision flags);
        on 10.x the network is created STRONGLY_TYPED too, so precision flags are never set."""
        flags = []
        if self.strip_weights:
            flags += ["STRIP_PLAN", "REFIT_IDENTICAL"]
        return flags

    @staticmethod
    def preview_features() -> list[str]:
        """PreviewFeature names: aliased plugin I/O (the cache pools are updated in place, STEP_GRAPH.md 1)."""
        from clover_export.plugins.trt.plan import PREVIEW_FEATURES

        return list(PREVIEW_FEATURES)

    @staticmethod
    def network_flags(trt_major: int) -> list[str]:
        """NetworkDefinitionCreationFlag names: STRONGLY_TYPED on 10.x (11.x has only strong typing)."""
        return ["STRONGLY_TYPED"] if trt_major == 10 else []
