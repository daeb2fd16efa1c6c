"""Size arithmetic shared by `info`, `doctor` and the engine memory plan: parameters, weights, caches."""

from __future__ import annotations

import math
from dataclasses import dataclass

from clover_export.core import names
from clover_export.core.config import CloverConfig
from clover_export.model.model import cache_bytes_per_token_and_fixed

GiB = 1024**3


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active_per_token: int  # everything except the experts a token does not route to
    routed_experts: int


def param_counts(cfg: CloverConfig) -> ParamCounts:
    shapes = names.expected_tensors(cfg, clover=cfg.is_clover)
    total = sum(math.prod(s) for s in shapes.values())
    routed = sum(math.prod(s) for n, s in shapes.items() if n.endswith((".experts.gate_up_proj", ".experts.down_proj")))
    active = total - routed + routed * cfg.num_experts_per_tok // cfg.num_experts
    return ParamCounts(total, active, routed)


def fp8_weight_names(cfg: CloverConfig, include_lm_head: bool = False) -> list[str]:
    """The GEMM weights an FP8 engine stores as e4m3 with per-output-channel scales."""
    out = []
    for n, s in names.expected_tensors(cfg, clover=cfg.is_clover).items():
        if n == names.EMBED or (n == names.LM_HEAD and not include_lm_head):
            continue
        if n == names.LM_HEAD or n.endswith(("experts.gate_up_proj", "experts.down_proj")) or (
                len(s) == 2 and n.endswith("proj.weight")):
            out.append(n)
    return out


def weight_bytes(cfg: CloverConfig, precision: str = "bf16") -> int:
    """Bytes of weights on the GPU: bf16 everywhere, or fp8 GEMM weights (+ fp32 per-channel scales)."""
    shapes = names.expected_tensors(cfg, clover=cfg.is_clover)
    total = sum(math.prod(s) for s in shapes.values()) * 2
    if precision == "bf16":
        return total
    if precision != "fp8":
        raise ValueError(precision)
    for n in fp8_weight_names(cfg):
        s = shapes[n]
        channels = math.prod(s[:-1])
        total -= math.prod(s) * 2 - math.prod(s) - channels * 4
    return total


def cache_bytes(cfg: CloverConfig, context: int, dtype_bytes: int = 2) -> dict[str, int]:
    """One sequence's caches at `context` tokens: attention K/V grows, GDN states are fixed."""
    per_token, fixed = cache_bytes_per_token_and_fixed(cfg, dtype_bytes)
    return {"attention_kv": per_token * context, "gdn_states": fixed, "total": per_token * context + fixed}
