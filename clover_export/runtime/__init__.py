"""Block-diffusion runtime: LowConfidence decoding over one backend contract (DECODING.md).

Layout (nano-vllm's split):
- `request.py`, `scheduler.py`, `prefix_cache.py`: plain Python (no torch/numpy):
  per-request state, slots, each step's `StepPlan` (STEP_GRAPH.md 1), the prefix cache's books.
- `decoding/`: one `Strategy` per decoding mode (plain Python; `decoding/device.py` runs their
  device work where the logits are, with `selector.py`, `controls.py`).
- `runner.py`: the device side: per-slot parameters/generators, one step
  (`step_io.py`: the one upload and read-back); `state_mover.py`: every copy of the cache pools.
- `backends/`: `torch` (reference model), `ort` (exported artifact),
  `trt` (TensorRT engine), one `step` contract.
- `frontend.py`: a request's checks and tokens against the model's config, tokenizer and defaults
  (no torch: a server's HTTP process uses it alone);
- `loop.py`: joins scheduler and runner; `generator.py`: the Python API;
  `tokenizer.py`: tokenizer + sandboxed chat template; `golden.py`:
  golden files; `cli.py`: `generate` and `compare`.

Public API: `Generator.load(...)`, `.generate`, `.stream`, `.submit`,
`.generate_batch`; `Result`, `StreamChunk`.
"""

from __future__ import annotations

_EXPORTS = {
    "Generator": "clover_export.runtime.generator",
    "Stream": "clover_export.runtime.generator",
    "context_needed": "clover_export.runtime.frontend",
    "Result": "clover_export.runtime.output",
    "StreamChunk": "clover_export.runtime.output",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):  # lazy, so the plain-Python scheduler imports without torch
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)
