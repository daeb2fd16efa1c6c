"""The routed-expert core: router, top-k or block coreset, experts, weighted sum (MODEL.md 4, 5.3).

`moe_core` is the contract of the `clover::CoresetMoE` op (STEP_GRAPH.md 2),
`moe_core_fp8` that of `clover::CoresetMoEFP8` (STEP_GRAPH.md 4).
Causal rows route with plain top-k; block rows (per batch row) route within
the block's expert coreset when it is enabled. The shared expert stays outside.

`moe_core_gathered` is `moe_core` run eagerly: each selected expert on the
rows routed to it only (what the torch backend runs on the CPU; never traced:
its shapes depend on the routing). Each row sums the same expert terms in the
same expert order; `moe_core` adds exact zeros for the others, so the two
differ only by the GEMMs' rounding over fewer rows (tests/backends/test_torch_backend_eager.py).
A small step that uses several experts (a draft's verification, a block) is
dominated by per-op costs, not arithmetic: there the used experts run as two
batched GEMMs over rows padded to the busiest expert's count
(`experts_batched`), where a loop would issue ~6 ops per expert; a step that
uses few experts (a decode row), or whose padding or weight copy would cost
more, runs the loop (`experts_looped`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from clover_export.core import assumed
from clover_export.core.sorting import stable_topk

# experts_batched when at least BATCHED_MIN_EXPERTS experts are used (its ~20 ops against the loop's ~6 per
# expert), padded to the busiest one they hold at most BATCHED_PADDING x the (expert, row) pairs plus one row
# per expert, and gathering their weights (none when all are used) copies at most BATCHED_COPY_BYTES
BATCHED_MIN_EXPERTS = 4
BATCHED_PADDING = 2
BATCHED_COPY_BYTES = 1 << 22


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


def routing(x: torch.Tensor, router_w: torch.Tensor, top_k: int, top_p: float, coreset: bool, block_size: int):
    """(weights [B, T, E] in x's dtype, zero off the chosen experts; chosen [B, T, E] bool; distinct experts of
    each row's block [B] int32): the router, then top-k, block rows within their block's coreset."""
    B, T, _ = x.shape
    Tc = T - block_size
    E = router_w.shape[0]
    probs = torch.softmax(F.linear(x, router_w).float(), dim=-1)  # [B, T, E]
    allowed = torch.ones_like(probs, dtype=torch.bool)
    if coreset and block_size > 0:
        keep = assumed.coreset_mask(probs[:, Tc:], top_k, top_p)  # [B, E]
        allowed = torch.cat([allowed[:, :Tc], keep.unsqueeze(1).expand(B, block_size, E)], dim=1)
    weights, chosen = route(probs, allowed, top_k)
    distinct = chosen[:, Tc:].any(dim=1).sum(-1).to(torch.int32)
    return weights.to(x.dtype), chosen, distinct


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
    weights, _, distinct = routing(x, router_w, top_k, top_p, coreset, block_size)
    out = torch.zeros_like(x)
    for e in range(router_w.shape[0]):  # dense over experts: no data-dependent control flow
        gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
        out = out + F.linear(F.silu(gate) * up, down[e]) * weights[..., e:e + 1]
    return out, distinct


def moe_core_gathered(x, router_w, gate_up, down, top_k: int, top_p: float, coreset: bool, block_size: int):
    """`moe_core` computing only the experts some row selected, each on its own rows (module docstring)."""
    B, T, D = x.shape
    E = router_w.shape[0]
    weights, chosen, distinct = routing(x, router_w, top_k, top_p, coreset, block_size)
    experts, rows = chosen.reshape(-1, E).t().nonzero().unbind(1)  # the (expert, row) pairs, by expert then row
    counts = torch.bincount(experts, minlength=E)
    per_expert = counts.tolist()  # the step's one host read
    used = [e for e, c in enumerate(per_expert) if c]
    U, xs = len(used), x.reshape(-1, D).index_select(0, rows)
    copied = 0 if U == E else U * (gate_up[0].nbytes + down[0].nbytes)
    if U >= BATCHED_MIN_EXPERTS and U * max(per_expert) <= BATCHED_PADDING * len(rows) + U and \
            copied <= BATCHED_COPY_BYTES:
        ys = experts_batched(xs, experts, counts, used, max(per_expert), gate_up, down)
    else:
        ys = experts_looped(xs, per_expert, gate_up, down)
    terms = ys * weights.reshape(-1, E)[rows, experts].unsqueeze(-1)
    # index_add_ adds the pairs in order: each row's terms in increasing expert order, as moe_core's sum
    out = torch.zeros(B * T, D, dtype=x.dtype, device=x.device).index_add_(0, rows, terms)
    return out.reshape(B, T, D), distinct


def experts_looped(xs: torch.Tensor, per_expert: list[int], gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The pairs' expert outputs [P, D] (xs [P, D]: the pairs' rows, by expert then row), one expert at a time."""
    ys = []
    for e, rows in enumerate(xs.split(per_expert)):
        if rows.shape[0]:
            gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
            ys.append(F.linear(F.silu(gate) * up, down[e]))
    return torch.cat(ys)


def experts_batched(xs: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor, used: list[int], width: int,
                    gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """`experts_looped` as two batched GEMMs: the used experts' rows padded with zero rows to `width` (the
    busiest expert's count) as [U, width, D]; each pair's output read back from its padded position."""
    P, D = xs.shape
    U = len(used)
    start = counts.cumsum(0) - counts  # each expert's first pair
    rank = (counts > 0).cumsum(0) - 1  # each used expert's place among the used
    at = rank[experts] * width + torch.arange(P, device=xs.device) - start[experts]
    padded = xs.new_zeros(U * width, D).index_copy_(0, at, xs).view(U, width, D)
    if U < gate_up.shape[0]:
        idx = torch.tensor(used, device=xs.device)
        gate_up, down = gate_up.index_select(0, idx), down.index_select(0, idx)
    gate, up = torch.bmm(padded, gate_up.transpose(1, 2)).chunk(2, dim=-1)
    return torch.bmm(F.silu(gate) * up, down.transpose(1, 2)).view(U * width, D).index_select(0, at)


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
