"""The step shapes a backend accepts: plain data the scheduler plans with (it imports no tensor library)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepShape:
    """Step shapes a backend accepts (a TensorRT optimisation profile, a CUDA-graph bucket): C and batch ranges."""

    min_causal: int
    max_causal: int
    max_batch: int
