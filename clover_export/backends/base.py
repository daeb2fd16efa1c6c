"""The backend contract: what every backend is and does (STEP_GRAPH.md 1; Polygraphy's runners)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from clover_export.core.config import CloverConfig
from clover_export.core.step_shape import StepShape
from clover_export.model.model import StepResult

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

    def step(self, inputs: dict[str, torch.Tensor], pools: dict[str, torch.Tensor]) -> StepResult:
        """One step: `inputs` by `names.STEP_INPUTS` name (`logit_rows` [B, R] may be left out: row 0, R = 1),
        `pools` by `past_key_values.*` name. Returns a `model.model.StepResult`: unpacks as (logits [B, N, V]
        fp32, coreset_size [B, layers] int32, the new pools by name), with `causal_logits` [B, R, V] fp32 (the
        next-token logits of the causal rows `logit_rows` names), all on the backend's device."""
        ...
