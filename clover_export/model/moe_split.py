"""`moe_core` as a chain of single-kernel steps: the contracts of the MoE sub-ops of `model.trt.onnx`.

TensorRT launches each AOT plugin as one kernel with no workspace, so the
routed experts (`clover::CoresetMoE`, MODEL.md 5.3) become: router logits
(a plain MatMul in the graph), `route_core`, `align_core`, `gate_up_core`,
`down_core`, `combine_core`, with every intermediate a graph tensor.
Composed they equal `moe_core` (tests/plugins/test_moe_trt_chain.py). Pairs are the
B*T*k (token, slot) routing choices in row-major [B, T, k] order; a slot
left unused (fewer than k experts kept) has id E and weight 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from clover_export.core import assumed
from clover_export.core.sorting import stable_topk


def route_core(logits: torch.Tensor, top_k: int, top_p: float, coreset: bool, block_size: int):
    """(idx [B, T, k] int32, w [B, T, k] logits.dtype, coreset_size [B] int32), routing exactly as `moe_core`."""
    B, T, E = logits.shape
    Tc = T - block_size
    probs = torch.softmax(logits.float(), dim=-1)
    allowed = torch.ones_like(probs, dtype=torch.bool)
    if coreset and block_size > 0:
        keep = assumed.coreset_mask(probs[:, Tc:], top_k, top_p)
        allowed = torch.cat([allowed[:, :Tc], keep.unsqueeze(1).expand(B, block_size, E)], dim=1)
    vals, idx = stable_topk(torch.where(allowed, probs, torch.full_like(probs, -1.0)), top_k)
    ok = vals >= 0
    vals = torch.where(ok, vals, torch.zeros_like(vals))
    vals = vals / vals.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    chosen = torch.zeros_like(allowed).scatter(-1, idx, ok)
    distinct = chosen[:, Tc:].any(dim=1).sum(-1).to(torch.int32)
    idx = torch.where(ok, idx, torch.full_like(idx, E)).to(torch.int32)
    return idx, vals.to(logits.dtype), distinct


def align_core(idx: torch.Tensor, num_experts: int):
    """(offsets [E+1] int32, order [B, T, k] int32): a stable sort of the pairs by expert id."""
    flat = idx.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    return offsets.to(torch.int32), order.to(torch.int32).reshape(idx.shape)


def _pairs(offsets: torch.Tensor):
    """(expert, sorted position range) of every expert with pairs."""
    for e in range(offsets.numel() - 1):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if hi > lo:
            yield e, lo, hi


def gate_up_core(x: torch.Tensor, gate_up: torch.Tensor, offsets: torch.Tensor, order: torch.Tensor):
    """h [B, T, k, I]: silu(g) * u per used pair, model-dtype rounding as `moe_core`; unused rows are zero."""
    B, T, D = x.shape
    k, I = order.shape[-1], gate_up.shape[1] // 2
    h = x.new_zeros(B * T * k, I)
    flat, rows = order.reshape(-1).long(), x.reshape(B * T, D)
    for e, lo, hi in _pairs(offsets):
        pairs = flat[lo:hi]
        g, u = F.linear(rows[pairs // k], gate_up[e]).chunk(2, dim=-1)
        h[pairs] = F.silu(g) * u
    return h.reshape(B, T, k, I)


def gate_up_fp8_core(x, gate_up_fp8, gate_up_scale, offsets, order):
    return gate_up_core(x, (gate_up_fp8.float() * gate_up_scale.float()[..., None]).to(x.dtype), offsets, order)


def down_core(h: torch.Tensor, down: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, order: torch.Tensor):
    """y [B, T, k, D]: (W_down[e] h) * routing weight per used pair (model dtype); unused rows are zero."""
    B, T, k, I = h.shape
    D = down.shape[1]
    y = h.new_zeros(B * T * k, D)
    flat, hp, wp = order.reshape(-1).long(), h.reshape(-1, I), w.reshape(-1, 1)
    for e, lo, hi in _pairs(offsets):
        pairs = flat[lo:hi]
        y[pairs] = F.linear(hp[pairs], down[e]) * wp[pairs]
    return y.reshape(B, T, k, D)


def down_fp8_core(h, down_fp8, down_scale, w, offsets, order):
    return down_core(h, (down_fp8.float() * down_scale.float()[..., None]).to(h.dtype), w, offsets, order)


def combine_core(y: torch.Tensor, idx: torch.Tensor, num_experts: int):
    """routed [B, T, D]: each token's used pair rows summed in fp32, cast to y's dtype."""
    used = (idx < num_experts).unsqueeze(-1)
    return torch.where(used, y.float(), 0.0).sum(dim=2).to(y.dtype)


def moe_chain(x, router_w, gate_up, down, top_k: int, top_p: float, coreset: bool, block_size: int,
              gate_up_scale=None, down_scale=None):
    """The sub-ops composed as `model.trt.onnx` wires them: (routed, coreset_size), = `moe_core` (or _fp8)."""
    E = router_w.shape[0]
    idx, w, distinct = route_core(F.linear(x, router_w), top_k, top_p, coreset, block_size)
    offsets, order = align_core(idx, E)
    if gate_up_scale is None:
        h = gate_up_core(x, gate_up, offsets, order)
        y = down_core(h, down, w, offsets, order)
    else:
        h = gate_up_fp8_core(x, gate_up, gate_up_scale, offsets, order)
        y = down_fp8_core(h, down, down_scale, w, offsets, order)
    return combine_core(y, idx, E), distinct
