"""Torch entry points of the plugin kernels: in-place cache updates, no host sync (CUDA-graph capturable).

Each function takes the arguments of its plain-torch core (same order and
dtypes) and returns what the core returns, except that the cache pools are
updated in place and returned as the same tensors. The kernels also run on
the CPU under `TRITON_INTERPRET=1` (set before triton is imported), which is
how the tests check them.
"""

from __future__ import annotations

import torch

from clover_export.plugins.triton import launch

_I32 = torch.int32
_FUSION = dict(enable_fp_fusion=launch.FP_FUSION)  # explicit, as in the AOT PTX (Triton 3.10 flips the default)


def _contig(name: str, t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (it is updated in place)")
    return t


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == _I32 else t.to(_I32)


def block_gdn(mixed_qkv, a, b, conv_w, conv_w_right, A_log, dt_bias, block_scale, block_gate,
              conv_pool, rec_pool, slot_ids, n_causal, num_k_heads: int, head_k_dim: int, head_v_dim: int,
              block_size: int, *, chunk: int = 32, bv: int = 64, dot_precision: str | None = None,
              num_warps: int | None = None):
    """`gdn_core` with the pools updated in place: returns (o, conv_pool, rec_pool).

    chunk / bv / dot_precision / num_warps override the defaults (benchmark sweeps).
    """
    from clover_export.plugins.triton.gdn import block_gdn_kernel

    B, T, C = mixed_qkv.shape
    Hv = A_log.shape[0]
    K = conv_w.shape[-1]
    if T < block_size:
        raise ValueError(f"BlockGDN: T={T} rows cannot hold block_size={block_size} block rows")
    _contig("conv_pool", conv_pool), _contig("rec_pool", rec_pool)
    if rec_pool.dtype != torch.float32:
        raise ValueError("BlockGDN: rec_pool must be float32")
    prec = dot_precision or launch.gdn_dot_precision(str(mixed_qkv.dtype).removeprefix("torch."))
    consts = launch.gdn_constexprs(num_k_heads, Hv, head_k_dim, head_v_dim, K, block_size, chunk, bv, prec)
    o = torch.empty(B, T, Hv, head_v_dim, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    args = [x.contiguous() for x in (mixed_qkv, a, b, conv_w, conv_w_right, A_log, dt_bias, block_scale, block_gate)]
    if B > 0:
        block_gdn_kernel[launch.gdn_grid(B, num_k_heads)](
            *args, conv_pool, rec_pool, _i32(slot_ids), _i32(n_causal), T, o, conv_pool, rec_pool,
            **launch.gdn_launch(consts, num_warps), **consts, **_FUSION)
    return o, conv_pool, rec_pool


def block_attention(q, k, v, key_pool, value_pool, slot_ids, past_len, n_causal, block_size: int, scale: float,
                    *, splits: int | None = None, arch: int | None = None, tiles: tuple | None = None):
    """`attention_core` with the pools updated in place: returns (o, key_pool, value_pool).

    `splits` > 1 splits the cached prefix over more programs and merges the
    partials (two launches); None picks it from the shapes and the GPU size.
    `tiles` = (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the per-arch table.
    """
    from clover_export.plugins.triton import attention as kern

    B, T, H, hd = q.shape
    Hkv, L = key_pool.shape[1], key_pool.shape[2]
    _contig("key_pool", key_pool), _contig("value_pool", value_pool)
    if arch is None:
        arch = _arch(q.device)
    dtype = str(q.dtype).removeprefix("torch.")
    consts = launch.attention_constexprs(H, Hkv, hd, block_size, scale, dtype, arch, tiles)
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        splits = launch.attention_splits(B, T, L, consts, sms)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    ids = (_i32(slot_ids), _i32(past_len), _i32(n_causal))
    o = torch.empty_like(q)
    if B == 0 or T == 0:
        return o, key_pool, value_pool
    opts = launch.attention_launch(arch, dtype, tiles)
    if splits <= 1:
        kern.block_attention_kernel[launch.attention_grid(B, T, consts)](
            q, k, v, key_pool, value_pool, *ids, T, L, o, key_pool, value_pool, **consts, **opts, **_FUSION)
        return o, key_pool, value_pool
    R = B * T * H
    acc = torch.empty(splits, R, consts["HDP"], dtype=torch.float32, device=q.device)
    ml = torch.empty(splits, R, 2, dtype=torch.float32, device=q.device)
    kern.block_attention_split_kernel[launch.attention_grid(B, T, consts, splits)](
        q, k, v, key_pool, value_pool, *ids, T, L, acc, ml, key_pool, value_pool, SPLITS=splits, **consts, **opts,
        **_FUSION)
    block_r = 16
    kern.attention_combine_kernel[(launch.cdiv(R, block_r),)](
        acc, ml, o, R, HD=hd, HDP=consts["HDP"], SPLITS=splits, BLOCK_R=block_r, num_warps=4, **_FUSION)
    return o, key_pool, value_pool


def _arch(device: torch.device) -> int:
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def moe_route(x, router_w, top_k: int, top_p: float, coreset: bool, block_size: int, n_causal=None,
              router_bias=None):
    """Routing of `moe_core`: (idx [B, T, k] int32 with E for "none", weights [B, T, k] x.dtype, distinct [B] int32).

    Torch glue: the router logits, `F.linear` exactly as the reference computes them.
    With `n_causal` [B], padding causal rows (at or past n_causal) select no
    expert (PERF.md 1): their pairs sort last and no expert kernel reads them.
    `router_bias` [E] is added to the router logits (benchmarks plant a skewed router with it).
    """
    import torch.nn.functional as F

    from clover_export.plugins.triton import moe as kern

    B, T, _ = x.shape
    E = router_w.shape[0]
    idx = torch.empty(B, T, top_k, dtype=_I32, device=x.device)
    w = torch.empty(B, T, top_k, dtype=x.dtype, device=x.device)
    distinct = torch.zeros(B, dtype=_I32, device=x.device)
    if B * T:
        logits = F.linear(x, router_w, router_bias)  # [B, T, E] in the model dtype
        rc = launch.moe_route_constexprs(E, top_k, block_size, top_p, coreset)
        kern.moe_route_kernel[launch.moe_route_grid(B, T, rc)](logits, T, idx, w, distinct, **rc,
                                                               **launch.MOE_ROUTE_LAUNCH, **_FUSION)
        if n_causal is not None and T > block_size:
            rows = torch.arange(T - block_size, device=x.device)
            pad = rows[None, :] >= n_causal.to(rows.dtype)[:, None]  # [B, Tc]
            idx[:, :T - block_size].masked_fill_(pad[..., None], E)
            w[:, :T - block_size].masked_fill_(pad[..., None], 0)
    return idx, w, distinct


def coreset_moe(x, router_w, gate_up, down, top_k: int, top_p: float, coreset: bool, block_size: int,
                *, gate_up_scale=None, down_scale=None, arch: int | None = None, tiles: dict | None = None,
                n_causal=None, router_bias=None):
    """`moe_core`: returns (routed [B, T, D], distinct experts of each row's block [B] int32).

    FP8 weights: `gate_up`/`down` in float8_e4m3fn with fp32 per-output-channel
    scales `gate_up_scale` [E, 2I] and `down_scale` [E, D]; activations stay
    in x's dtype. `tiles` overrides entries of `launch.MOE_TILES` (benchmark sweeps).
    `n_causal` [B]: padding causal rows select no expert (their output rows are 0).
    """
    x = x.contiguous()
    idx, w, distinct = moe_route(x, router_w, top_k, top_p, coreset, block_size, n_causal, router_bias)
    out = moe_experts(x, idx, w, gate_up, down, gate_up_scale=gate_up_scale, down_scale=down_scale, arch=arch,
                      tiles=tiles)
    return out, distinct


def moe_experts(x, idx, w, gate_up, down, *, gate_up_scale=None, down_scale=None, arch: int | None = None,
                tiles: dict | None = None):
    """Routed SwiGLU experts and the weighted sum for given routing (idx, w from `moe_route`).

    Torch glue: one sort of the (token, slot) pairs by expert id and
    `searchsorted` for each expert's segment of them.
    """
    from clover_export.plugins.triton import moe as kern

    B, T, D = x.shape
    E, I, top_k = gate_up.shape[0], down.shape[-1], idx.shape[-1]
    fp8 = gate_up.dtype == torch.float8_e4m3fn
    if fp8 != (down.dtype == torch.float8_e4m3fn) or fp8 != (gate_up_scale is not None) or fp8 != (down_scale is not None):
        raise ValueError("CoresetMoE: FP8 needs both weights in float8_e4m3fn and both scales (fp32)")
    arch = _arch(x.device) if arch is None else arch
    dtype = str(x.dtype).removeprefix("torch.")
    P = B * T * top_k
    out = torch.empty_like(x)
    if P == 0:
        return out
    sorted_ids, order = torch.sort(idx.view(-1))  # pairs grouped by expert (E = "none" sorts last)
    offsets = torch.searchsorted(sorted_ids, torch.arange(E + 1, dtype=_I32, device=x.device)).to(_I32)
    gu, dn, opts = launch.moe_gemm_constexprs(D, I, top_k, launch.moe_block_m(P, E), fp8, dtype, arch, tiles)
    gu, dn = launch.moe_m_grid(gu, dn, E)  # a hot expert's M tiles run in parallel
    grids = launch.moe_grids(E, B, T, gu, dn)
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    gs = offsets if gate_up_scale is None else gate_up_scale.float().contiguous()  # offsets: never read
    ds = offsets if down_scale is None else down_scale.float().contiguous()
    kern.moe_gate_up_kernel[grids["gate_up"]](x, gate_up.contiguous(), gs, offsets, order, h, **gu, **opts, **_FUSION)
    y = torch.empty(P, D, dtype=x.dtype, device=x.device)
    kern.moe_down_kernel[grids["down"]](h, down.contiguous(), ds, w, offsets, order, y, **dn, **opts, **_FUSION)
    kern.moe_combine_kernel[grids["combine"]](y, idx, out, D=D, E=E, K=top_k, KP=launch.next_pow2(top_k),
                                              BLOCK_D=256, **launch.MOE_SMALL_LAUNCH, **_FUSION)
    return out
