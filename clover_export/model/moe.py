"""The routed-expert core: router, top-k or block coreset, experts, weighted sum (MODEL.md 4, 5.3).

`moe_core` is the contract of the `clover::CoresetMoE` op (STEP_GRAPH.md 2),
`moe_core_fp8` that of `clover::CoresetMoEFP8` (STEP_GRAPH.md 4).
Causal rows route with plain top-k; block rows (per batch row) route within
the block's expert coreset when it is enabled. The shared expert stays outside.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from clover_export.core import assumed
from clover_export.core.sorting import stable_topk


def route(probs: torch.Tensor, allowed: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of probs [..., E] among allowed experts, renormalised (fp32).

    Returns dense weights [..., E] (zero off the chosen experts) and the chosen mask.
    """
    masked = torch.where(allowed, probs, torch.full_like(probs, -1.0))
    vals, idx = stable_topk(masked, top_k)
    ok = vals >= 0  # fewer than k allowed experts: top-min(k, |set|)
    vals = torch.where(ok, vals, torch.zeros_like(vals))
    vals = vals / vals.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)  # all-zero kept mass: no NaN
    dense = torch.zeros_like(probs).scatter(-1, idx, vals)
    chosen = torch.zeros_like(allowed).scatter(-1, idx, ok)
    return dense, chosen


def moe_core(
    x: torch.Tensor,  # [B, T, D] normalised hidden states, model dtype
    router_w: torch.Tensor,  # [E, D]
    gate_up: torch.Tensor,  # [E, 2I, D] rows: gate then up
    down: torch.Tensor,  # [E, D, I]
    top_k: int,
    top_p: float,
    coreset: bool,
    block_size: int,
):
    """Returns (routed output [B, T, D], distinct experts of each row's block [B] int32)."""
    B, T, D = x.shape
    Tc = T - block_size
    E = router_w.shape[0]
    probs = torch.softmax(F.linear(x, router_w).float(), dim=-1)  # [B, T, E]
    allowed = torch.ones_like(probs, dtype=torch.bool)
    if coreset and block_size > 0:
        keep = assumed.coreset_mask(probs[:, Tc:], top_k, top_p)  # [B, E]
        allowed = torch.cat([allowed[:, :Tc], keep.unsqueeze(1).expand(B, block_size, E)], dim=1)
    weights, chosen = route(probs, allowed, top_k)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for e in range(E):  # dense over experts: no data-dependent control flow
        gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
        out = out + F.linear(F.silu(gate) * up, down[e]) * weights[..., e:e + 1]
    distinct = chosen[:, Tc:].any(dim=1).sum(-1).to(torch.int32)
    return out, distinct


def moe_core_fp8(
    x: torch.Tensor,  # [B, T, D] normalised hidden states, model dtype (activations stay unquantized)
    router_w: torch.Tensor,  # [E, D] model dtype
    gate_up_fp8: torch.Tensor,  # [E, 2I, D] float8_e4m3fn
    gate_up_scale: torch.Tensor,  # [E, 2I] fp32, one per output channel
    down_fp8: torch.Tensor,  # [E, D, I] float8_e4m3fn
    down_scale: torch.Tensor,  # [E, D] fp32
    top_k: int,
    top_p: float,
    coreset: bool,
    block_size: int,
):
    """`moe_core` on the dequantized experts: W = (fp8 as fp32 * scale per output row), cast to x's dtype."""
    gate_up = (gate_up_fp8.float() * gate_up_scale.float()[..., None]).to(x.dtype)
    down = (down_fp8.float() * down_scale.float()[..., None]).to(x.dtype)
    return moe_core(x, router_w, gate_up, down, top_k, top_p, coreset, block_size)
