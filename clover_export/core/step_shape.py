"""The step shapes a backend accepts: plain data the scheduler plans with (it imports no tensor library)."""

from __future__ import annotations

from dataclasses import dataclass

# The default step shape, one value for every command and API (export, build, the memory plan, the runtime,
# the server); STEP_GRAPH.md 1: T = C + N rows per batch row.
PREFILL_CHUNK = 256  # C of a prefill step: the causal rows the prefill profile takes and the runtime feeds a step
MAX_BATCH = 8  # batch rows: the profiles' largest batch, the server's continuous batch (runtime slots)


@dataclass(frozen=True)
class StepShape:
    """Step shapes a backend accepts (a TensorRT optimisation profile, a CUDA-graph bucket): C and batch ranges."""

    min_causal: int
    max_causal: int
    max_batch: int
