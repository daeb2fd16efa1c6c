"""Model config: three on-disk layouts normalised into one validated object (MODEL.md 2).

Accepted `model_type`s: `clover_moe` (flat, or text fields under
`text_config`), `qwen3_5_moe` (multimodal wrapper, text under `text_config`)
and `qwen3_5_moe_text` (flat). Generation defaults live in `generation.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clover_export.core import assumed
from clover_export.core.errors import CloverError
from clover_export.core.json_file import read_json

MODEL_TYPES = ("clover_moe", "qwen3_5_moe", "qwen3_5_moe_text")
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class CloverConfig:
    # backbone [upstream]
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    layer_types: tuple[str, ...] = ()
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    eos_token_id: tuple[int, ...] = (248044,)
    # Clover fields (MODEL.md 2, 5.1)
    block_size: int = 32
    mask_token_id: int | None = None
    moe_block_coreset_enabled: bool = True
    moe_block_coreset_top_p: float = 0.9
    max_context: int = 131072
    logits_shift: bool = assumed.LOGITS_SHIFT_DEFAULT
    block_alignment: str = assumed.BLOCK_ALIGNMENT_DEFAULT
    # where it came from
    model_type: str = "clover_moe"
    source: str = field(default="<memory>", compare=False)

    # --- derived sizes ------------------------------------------------------
    @property
    def is_clover(self) -> bool:
        return self.model_type == "clover_moe"

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    def require_mask_token(self) -> int:
        if self.mask_token_id is None:
            raise CloverError(
                "config",
                f"{self.source}: field 'mask_token_id' is missing; diffusion decoding needs it",
                "add \"mask_token_id\": <id> to config.json (the tokenizer's mask token)",
            )
        return self.mask_token_id

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source")
        d["layer_types"] = list(self.layer_types)
        d["eos_token_id"] = list(self.eos_token_id)
        return d

    def fingerprint(self) -> str:
        """Stable hash of everything that shapes the graph and the weights."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **changes: Any) -> "CloverConfig":
        return validate(dataclasses.replace(self, **changes))


_INT_FIELDS = [
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "block_size", "max_context",
]


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> CloverConfig:
    """Normalise any accepted layout (MODEL.md 2) and validate it."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CloverError(
            "config", f"{source}: field 'model_type' is {model_type!r}",
            f"expected one of {', '.join(MODEL_TYPES)}",
        )
    text = dict(raw)
    if isinstance(raw.get("text_config"), dict):
        # wrapper layout: text fields under text_config; top-level Clover fields still count
        text = {**{k: v for k, v in raw.items() if k != "text_config"}, **raw["text_config"]}
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise CloverError("config", f"{source}: field 'rope_parameters' must be an object")

    names = {f.name for f in dataclasses.fields(CloverConfig)}
    kwargs: dict[str, Any] = {k: v for k, v in text.items() if k in names}
    kwargs["model_type"] = model_type
    kwargs["source"] = source
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in rope:
            kwargs[key] = rope[key]
    eos = text.get("eos_token_id", CloverConfig.eos_token_id)
    if eos is None:  # transformers writes null when unset; generation_config.json may still name it
        eos = ()
    kwargs["eos_token_id"] = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    layers = kwargs.get("num_hidden_layers", CloverConfig.num_hidden_layers)
    if text.get("layer_types") is not None:
        kwargs["layer_types"] = tuple(text["layer_types"])
    else:
        interval = text.get("full_attention_interval", 4)
        if not isinstance(interval, int) or interval < 1:
            raise CloverError("config", f"{source}: field 'full_attention_interval' must be a positive integer")
        kwargs["layer_types"] = tuple(
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers if isinstance(layers, int) else 0)
        )
    return validate(CloverConfig(**kwargs))


def validate(cfg: CloverConfig) -> CloverConfig:
    """One clear error naming the field (MODEL.md 2)."""

    def bad(fieldname: str, why: str) -> CloverError:
        return CloverError("config", f"{cfg.source}: field '{fieldname}' {why}")

    for name in _INT_FIELDS:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise bad(name, f"must be a positive integer, got {v!r}")
    for name in ("rms_norm_eps", "rope_theta"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise bad(name, f"must be a positive number, got {v!r}")
    if not 0 < cfg.partial_rotary_factor <= 1:
        raise bad("partial_rotary_factor", f"must be in (0, 1], got {cfg.partial_rotary_factor!r}")
    if cfg.rotary_dim % 2:
        raise bad("partial_rotary_factor", f"gives an odd rotary dim {cfg.rotary_dim}")
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise bad("layer_types", f"has {len(cfg.layer_types)} entries, num_hidden_layers is {cfg.num_hidden_layers}")
    for i, t in enumerate(cfg.layer_types):
        if t not in LAYER_TYPES:
            raise bad("layer_types", f"entry {i} is {t!r}; expected one of {', '.join(LAYER_TYPES)}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise bad(
            "num_attention_heads",
            f"({cfg.num_attention_heads}) must be divisible by num_key_value_heads ({cfg.num_key_value_heads})",
        )
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise bad(
            "linear_num_value_heads",
            f"({cfg.linear_num_value_heads}) must be divisible by linear_num_key_heads ({cfg.linear_num_key_heads})",
        )
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise bad("num_experts_per_tok", f"({cfg.num_experts_per_tok}) exceeds num_experts ({cfg.num_experts})")
    if not 0 < cfg.moe_block_coreset_top_p <= 1:
        raise bad("moe_block_coreset_top_p", f"must be in (0, 1], got {cfg.moe_block_coreset_top_p!r}")
    if not isinstance(cfg.logits_shift, bool):
        raise bad("logits_shift", f"must be true or false, got {cfg.logits_shift!r}")
    if cfg.block_alignment not in assumed.BLOCK_ALIGNMENTS:
        raise bad(
            "block_alignment", f"is {cfg.block_alignment!r}; expected one of {', '.join(assumed.BLOCK_ALIGNMENTS)}"
        )
    if cfg.mask_token_id is not None and not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise bad("mask_token_id", f"({cfg.mask_token_id}) is outside the vocabulary (size {cfg.vocab_size})")
    for e in cfg.eos_token_id:
        if not isinstance(e, int) or not 0 <= e < cfg.vocab_size:
            raise bad("eos_token_id", f"entry {e!r} is outside the vocabulary (size {cfg.vocab_size})")
    if cfg.tie_word_embeddings:
        raise bad("tie_word_embeddings", "is true; Clover and Qwen3.5-MoE use an untied lm_head")
    return cfg


def load_config(model_dir: str | Path) -> CloverConfig:
    path = Path(model_dir) / "config.json"
    return config_from_dict(read_json(path, "config"), source=str(path))
