"""What the runtime is run with, beside the model: one frozen `RuntimeConfig` (docs/runtime.md, Runtime configuration).

`Generator.load(model, config)` takes it, `clover-export generate` and
`serve` build it from their options (cli/options.py), and the server's
`ServeOptions.runtime` holds it. Plain data without torch, so the CLI imports
it cheaply and Ray ships it to replicas. The backend left out is
`backends.default_backend`'s choice: one rule for every door.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clover_export.core.errors import CloverError
from clover_export.core.step_shape import PREFILL_CHUNK

# The fields each backend's `load` takes from the configuration; the others are the other backends' and are left
# out for it (a model option given with --backend ort changes nothing). backend_options go to the backend as given.
BACKEND_FIELDS = {
    "torch": ("dtype", "device", "block_size", "allow_qwen", "threads"),
    "triton": ("dtype", "device", "block_size", "allow_qwen"),
    "ort": ("threads",),
    "trt": (),
}


@dataclass(frozen=True)
class RuntimeConfig:
    """The runtime's settings: the batch and caches (Generator), and how the backend loads (BACKEND_FIELDS)."""

    backend: str | None = None  # torch / ort / trt / triton; None: backends.default_backend(model, device)
    max_slots: int = 4  # requests decoding together (the continuous batch's rows)
    max_context: int | None = None  # positions per request; None: the model's and the backend's limit
    prefix_cache: bool | float = True  # True: on (prefix_cache.DEFAULT_BUDGET_GB of snapshots), a GiB budget, False
    prefill_chunk: int = PREFILL_CHUNK  # prompt tokens per step
    fold_commit: bool = True  # scheduler: commits (and the last prefill chunk) ride along the next denoise step
    early_stop: bool = True  # scheduler: a block is done once an end token is filled with every position before it
    dtype: str = "auto"  # torch / triton: auto, fp32, bf16
    device: str | None = None  # torch / triton; None: cuda if available, else cpu
    block_size: int | None = None  # torch / triton: build the model with it; None: the model's
    allow_qwen: bool = False  # torch / triton: accept a plain Qwen3.5-MoE folder
    threads: int | None = None  # torch / ort CPU threads (backends/threads.py); None: OMP_NUM_THREADS or sized
    backend_options: dict[str, Any] = field(default_factory=dict)  # anything else the backend's load takes

    def __post_init__(self):
        if isinstance(self.max_slots, bool) or not isinstance(self.max_slots, int) or self.max_slots < 1:
            raise CloverError("runtime", f"max_slots must be >= 1, got {self.max_slots}")
        gb = self.prefix_cache
        if not isinstance(gb, bool) and (not isinstance(gb, numbers.Real) or not gb >= 0):
            raise CloverError("runtime", f"prefix_cache must be True, False or a budget in GiB >= 0, got {gb!r}")

    @classmethod
    def of(cls, config: "RuntimeConfig | None" = None, **options: Any) -> "RuntimeConfig":
        """`config` (or the defaults) with `options` set: a field by its name, anything else (a backend's own
        option: providers, fp8_experts, cuda_graphs, ...) into backend_options."""
        config = config or cls()
        names = {f.name for f in dataclasses.fields(cls)}
        extra = {k: v for k, v in options.items() if k not in names}
        fields = {k: v for k, v in options.items() if k in names}
        if extra:
            fields["backend_options"] = {**config.backend_options, **fields.get("backend_options", {}), **extra}
        return dataclasses.replace(config, **fields)

    def backend_for(self, model: str | Path | None) -> str:
        """The backend to run `model` on: the configured one, else `backends.default_backend`'s choice."""
        if self.backend is not None:
            return self.backend
        from clover_export.backends import default_backend  # torch: imported once a backend is chosen

        return default_backend(model, self.device)

    def load_options(self, backend: str) -> dict[str, Any]:
        """Keyword arguments of `backend`'s load: its BACKEND_FIELDS, then backend_options."""
        own = {name: getattr(self, name) for name in BACKEND_FIELDS.get(backend, ())}
        return {**own, **self.backend_options}
