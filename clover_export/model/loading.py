"""Find and load a model: MODEL argument -> folder -> config + reference model."""

from __future__ import annotations

from pathlib import Path

import torch

from clover_export.core.checkpoint import load_state_dict
from clover_export.core.config import CloverConfig, load_config
from clover_export.core.errors import CloverError
from clover_export.model.model import CloverModel

DEFAULT_MODEL = "tiny"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_model_dir(model: str | Path | None) -> Path:
    """`None` or "tiny" -> the embedded default (generated on first use); else a folder with config.json."""
    if model is None or str(model) == DEFAULT_MODEL:
        from clover_export.tiny import ensure_tiny

        return ensure_tiny()
    path = Path(model)
    if not path.is_dir():
        raise CloverError("model", f"{path}: no such model folder", "pass a folder holding config.json, or 'tiny'")
    if not (path / "config.json").exists():
        raise CloverError("model", f"{path}: no config.json in this folder")
    return path


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise CloverError("model", f"unknown dtype {name!r}", f"expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def has_weights(model_dir: Path) -> bool:
    return (model_dir / "model.safetensors.index.json").exists() or (model_dir / "model.safetensors").exists()


def build_model(cfg: CloverConfig, dtype: torch.dtype = torch.float32, device="cpu", block_size=None) -> CloverModel:
    with torch.device(device):
        model = CloverModel(cfg, block_size=block_size)
    return model.to(dtype)


def load_model(
    model: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    allow_qwen: bool = False,
    device: str = "cpu",
    block_size: int | None = None,
) -> CloverModel:
    """The reference model with the folder's weights (memory-mapped, checked against the config)."""
    model_dir = resolve_model_dir(model)
    cfg = load_config(model_dir)
    state = load_state_dict(model_dir, cfg, dtype=dtype, allow_qwen=allow_qwen)
    ref = build_model(cfg, dtype, device="meta", block_size=block_size)
    ref.load_state_dict(state, strict=True, assign=True)
    return ref.to(device).eval().requires_grad_(False)
