"""The backend contract: what every backend is and does (STEP_GRAPH.md 1; Polygraphy's runners)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from clover_export.core.config import CloverConfig
from clover_export.core.step_shape import StepShape

BACKENDS = ("torch", "ort", "trt", "triton")


class Backend(Protocol):
    name: str
    cfg: CloverConfig
    block_size: int
    max_context: int  # the most positions the backend was built for
    device: torch.device
    source_dir: Path  # folder holding config, generation config and tokenizer files
    step_shapes: list[StepShape] | None  # None: any causal rows C and batch size

    def allocate_pools(self, num_slots: int, max_len: int) -> dict[str, torch.Tensor]: ...

    def step(self, inputs: dict[str, torch.Tensor], pools: dict[str, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]: ...
