"""Generation controls and their defaults (DECODING.md 3; model card).

Defaults come from this table, then `generation_config.json`, then the call
site; `GenerationSettings.validate` rejects out-of-range values up front.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clover_export.config import read_json
from clover_export.errors import CloverError


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 1024
    threshold: float = 0.95
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.9
    dllm_length_penalty: float = 10.0
    dllm_length_penalty_start: int = 8192
    dllm_length_penalty_window: int = 8192
    dllm_think_end_bias: float = 10.0
    dllm_think_end_start: int = 4096
    dllm_think_end_window: int = 4096
    enable_thinking: bool = True
    seed: int | None = None
    eos_token_id: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()

    def override(self, **changes: Any) -> "GenerationSettings":
        changes = {k: v for k, v in changes.items() if v is not None}
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise CloverError("generate", f"unknown generation parameter(s): {', '.join(sorted(unknown))}")
        for key in ("eos_token_id", "stop"):
            if key in changes and not isinstance(changes[key], tuple):
                v = changes[key]
                changes[key] = tuple(v) if isinstance(v, (list, tuple)) else (v,)
        return dataclasses.replace(self, **changes).validate()

    def validate(self) -> "GenerationSettings":
        def bad(name: str, why: str) -> CloverError:
            return CloverError("generate", f"parameter '{name}' {why}, got {getattr(self, name)!r}")

        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", "must be an integer >= 1")
        if not 0 < self.threshold <= 1:
            raise bad("threshold", "must be in (0, 1]")
        if self.temperature <= 0:
            raise bad("temperature", "must be > 0")
        if self.top_k < 0:
            raise bad("top_k", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        for name in ("frequency_penalty", "presence_penalty", "dllm_length_penalty", "dllm_think_end_bias"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        for name in ("dllm_length_penalty_window", "dllm_think_end_window"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be > 0")
        return self


def load_generation_settings(model_dir: str | Path, eos_fallback: tuple[int, ...] = ()) -> GenerationSettings:
    """Defaults overridden by the model folder's generation_config.json, if any."""
    path = Path(model_dir) / "generation_config.json"
    raw = read_json(path, "generation_config") if path.exists() else {}
    names = {f.name for f in dataclasses.fields(GenerationSettings)}
    known = {k: v for k, v in raw.items() if k in names}
    if "eos_token_id" not in known and eos_fallback:
        known["eos_token_id"] = eos_fallback
    try:
        return GenerationSettings().override(**known)
    except CloverError as e:
        raise CloverError("generation_config", f"{path}: {e}") from None
