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
              block_size: int, *, chunk: int = 32, bv: int | None = None, dot_precision: str | None = None,
              num_warps: int | None = None, split: bool = True):
    """`gdn_core` with the pools updated in place: returns (o, conv_pool, rec_pool).

    split (default): two launches, the conv kernel over (batch row, head) writing an fp32 scratch of the
    activated rows (B x T x C_conv x 4 bytes: 17 MB for 8 rows of 64 at Clover sizes, 8.4 MB per 256-row
    prefill chunk; the allocator reuses it), then the delta rule over (batch row, v-head, dv tile).
    split=False: the one-launch kernel TensorRT runs (one program per (batch row, k-head)).
    chunk / bv / dot_precision / num_warps override the defaults (benchmark sweeps).
    """
    from clover_export.plugins.triton import gdn as kern

    B, T, C = mixed_qkv.shape
    Hv = A_log.shape[0]
    K = conv_w.shape[-1]
    if T < block_size:
        raise ValueError(f"BlockGDN: T={T} rows cannot hold block_size={block_size} block rows")
    _contig("conv_pool", conv_pool), _contig("rec_pool", rec_pool)
    if rec_pool.dtype != torch.float32:
        raise ValueError("BlockGDN: rec_pool must be float32")
    prec = dot_precision or launch.gdn_dot_precision(str(mixed_qkv.dtype).removeprefix("torch."))
    if bv is None:
        bv = launch.gdn_split_bv(B, Hv, head_v_dim, _num_sms(mixed_qkv.device)) if split else 64
    consts = launch.gdn_constexprs(num_k_heads, Hv, head_k_dim, head_v_dim, K, block_size, chunk, bv, prec)
    o = torch.empty(B, T, Hv, head_v_dim, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    mixed_qkv, a, b, conv_w, conv_w_right, A_log, dt_bias, block_scale, block_gate = (
        x.contiguous() for x in (mixed_qkv, a, b, conv_w, conv_w_right, A_log, dt_bias, block_scale, block_gate))
    ids = (_i32(slot_ids), _i32(n_causal))
    if B == 0:
        return o, conv_pool, rec_pool
    if not split:
        kern.block_gdn_kernel[launch.gdn_grid(B, num_k_heads)](
            mixed_qkv, a, b, conv_w, conv_w_right, A_log, dt_bias, block_scale, block_gate, conv_pool, rec_pool,
            *ids, T, conv_pool.shape[0], o, conv_pool, rec_pool,  # T, S: launch.GDN_ABI's scalars
            **launch.gdn_launch(consts, num_warps), **consts, **_FUSION)
        return o, conv_pool, rec_pool
    act = torch.empty(B, T, C, dtype=torch.float32, device=mixed_qkv.device)
    cc = launch.gdn_conv_constexprs(consts)
    grids = launch.gdn_split_grids(B, consts)
    kern.gdn_conv_kernel[grids["conv"]](mixed_qkv, conv_w, conv_w_right, conv_pool, *ids, T, act, conv_pool,
                                        **cc, **launch.gdn_conv_launch(cc), **_FUSION)
    kern.gdn_delta_kernel[grids["delta"]](act, a, b, A_log, dt_bias, block_scale, block_gate, rec_pool, *ids, T, o,
                                          rec_pool, **consts, **launch.gdn_launch(consts, num_warps), **_FUSION)
    return o, conv_pool, rec_pool


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def block_attention(q, k, v, key_pool, value_pool, slot_ids, past_len, n_causal, block_size: int, scale: float,
                    *, splits: int | None = None, arch: int | None = None, tiles: tuple | None = None,
                    kv_first: bool = True, split_rule: str = "two_waves"):
    """`attention_core` with the pools updated in place: returns (o, key_pool, value_pool).

    kv_first (default): the step's causal K/V are written by their own launch first, then the attention
    reads every prefix position from the pool; False: the one-kernel form TensorRT runs.

    `splits` > 1 splits the cached prefix over more programs and merges the
    partials (two launches); None picks it from the shapes and the GPU size
    (`split_rule`: "two_waves", launch.attention_splits, or "waves", launch.attention_splits_waves).
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
        rule = {"two_waves": launch.attention_splits, "waves": launch.attention_splits_waves}[split_rule]
        splits = rule(B, T, L, consts, _num_sms(q.device))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    ids = (_i32(slot_ids), _i32(past_len), _i32(n_causal))
    o = torch.empty_like(q)
    if B == 0 or T == 0:
        return o, key_pool, value_pool
    if kv_first:  # the step's causal K/V into the pool first: the prefix loop then reads the pool alone
        kern.write_kv_kernel[(B * Hkv,)](k, v, *ids, T, L, key_pool, value_pool, HKV=Hkv, HD=hd,
                                         HDP=consts["HDP"], BLOCK_N=consts["BLOCK_N"], **launch.MOE_SMALL_LAUNCH,
                                         **_FUSION)
    consts = dict(consts, KV_FIRST=kv_first)
    if splits <= 1:
        kern.block_attention_kernel[launch.attention_grid(B, T, consts)](
            q, k, v, key_pool, value_pool, *ids, T, L, key_pool.shape[0], o, key_pool, value_pool, **consts,
            **launch.attention_launch(arch, dtype, tiles), **_FUSION)
        return o, key_pool, value_pool
    acc = torch.empty(splits * B * T, H, hd, dtype=torch.float32, device=q.device)  # contracts.BLOCK_ATTENTION_SPLIT
    ml = torch.empty(splits * B * T, H, 2, dtype=torch.float32, device=q.device)
    count = torch.empty(1, dtype=torch.int32, device=q.device)
    kern.block_attention_split_kernel[launch.attention_grid(B, T, consts, splits)](
        q, k, v, key_pool, value_pool, *ids, T, L, key_pool.shape[0], acc, ml, count, key_pool, value_pool, **consts,
        **launch.attention_split_launch(arch, dtype, tiles), **_FUSION)
    kern.attention_merge_kernel[launch.attention_merge_grid(B, T, H)](
        acc, ml, count, q, T, acc.shape[0], o, **launch.attention_merge_constexprs(H, hd),
        **launch.ATTENTION_MERGE_LAUNCH, **_FUSION)
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
                n_causal=None, router_bias=None, align: str = "kernels"):
    """`moe_core`: returns (routed [B, T, D], distinct experts of each row's block [B] int32).

    FP8 weights: `gate_up`/`down` in float8_e4m3fn with fp32 per-output-channel
    scales `gate_up_scale` [E, 2I] and `down_scale` [E, D]; activations stay
    in x's dtype. `tiles` overrides entries of `launch.MOE_TILES` (benchmark sweeps).
    `n_causal` [B]: padding causal rows select no expert (their output rows are 0).
    """
    x = x.contiguous()
    idx, w, distinct = moe_route(x, router_w, top_k, top_p, coreset, block_size, n_causal, router_bias)
    out = moe_experts(x, idx, w, gate_up, down, gate_up_scale=gate_up_scale, down_scale=down_scale, arch=arch,
                      tiles=tiles, align=align)
    return out, distinct


def moe_experts(x, idx, w, gate_up, down, *, gate_up_scale=None, down_scale=None, arch: int | None = None,
                tiles: dict | None = None, align: str = "kernels", shared: tuple | None = None):
    """Routed SwiGLU experts and the weighted sum for given routing (idx, w from `moe_route`): the pairs grouped
    by expert (`moe_align`), the two expert GEMMs (w8a8 where launch.moe_w8a8 says), the combine.

    shared = (gate [I, D], up [I, D], down [D, I], weight [B, T] or [B, T, 1]): the shared expert runs as expert
    E of the same grouped GEMMs, one pair per token weighted by `weight` (sigmoid of the shared gate), and the
    combine adds its row (launch.moe_shared_fusable says when: same shapes and dtype as the routed experts).

    align="sort": the pairs grouped by torch.sort + searchsorted instead (the 2026-11-30 baseline that
    bench/step_bound.py measures side by side)."""
    from clover_export.plugins.triton import moe as kern

    B, T, D = x.shape
    E, I, top_k = gate_up.shape[0], down.shape[-1], idx.shape[-1]
    fp8 = gate_up.dtype == torch.float8_e4m3fn
    if (
        fp8 != (down.dtype == torch.float8_e4m3fn)
        or fp8 != (gate_up_scale is not None)
        or fp8 != (down_scale is not None)
    ):
        raise ValueError("CoresetMoE: FP8 needs both weights in float8_e4m3fn and both scales (fp32)")
    if shared is not None:
        sg, su, sd, sw = shared
        if fp8 or align != "kernels" or {tuple(sg.shape), tuple(su.shape), tuple(sd.shape[::-1])} != {(I, D)} or any(
                t.dtype != gate_up.dtype for t in (sg, su, sd)):
            raise ValueError(
                f"CoresetMoE: the shared expert joins the grouped GEMMs only with the routed experts' "
                f"shapes ([{I}, {D}], [{D}, {I}]) and dtype ({gate_up.dtype}), not FP8, on align='kernels'"
            )
    arch = _arch(x.device) if arch is None else arch
    dtype = str(x.dtype).removeprefix("torch.")
    P = B * T * top_k
    out = torch.empty_like(x)
    if P == 0:
        return out
    if align == "sort":
        sorted_ids, order = torch.sort(idx.view(-1))  # E ("none") sorts last
        offsets = torch.searchsorted(sorted_ids, torch.arange(E + 1, dtype=_I32, device=x.device)).to(_I32)
    elif align == "kernels":
        offsets, order = moe_align(idx, E, shared_rows=B * T if shared is not None else 0)
    else:
        raise ValueError(f"CoresetMoE: align must be 'kernels' or 'sort', not {align!r}")
    segments = E + (shared is not None)  # the shared expert is segment E
    rows = P + (B * T if shared is not None else 0)  # pair rows of h and y: the routed pairs, then one per token
    a8 = launch.moe_w8a8(fp8, dtype, tiles)
    block_m = launch.moe_a8_block_m(rows, segments, arch) if a8 else launch.moe_block_m(rows, segments)
    gu, dn, opts = launch.moe_gemm_constexprs(D, I, top_k, block_m, fp8, dtype, arch, tiles)
    gu, dn = launch.moe_m_grid(gu, dn, segments)  # a hot expert's M tiles run in parallel
    grids = launch.moe_grids(segments, B, T, gu, dn, pairs=rows)
    h = torch.empty(rows, I, dtype=x.dtype, device=x.device)
    gs = offsets if gate_up_scale is None else gate_up_scale.float().contiguous()  # offsets: never read
    ds = offsets if down_scale is None else down_scale.float().contiguous()
    y = torch.empty(rows, D, dtype=x.dtype, device=x.device)
    if a8:
        xq, xs = act_quant(x.view(B * T, D))
        kern.moe_gate_up_a8_kernel[grids["gate_up"]](xq, xs, gate_up.contiguous(), gs, offsets, order, B, T, h, **gu,
                                                     **opts, **_FUSION)
        hq, hs = act_quant(h)
        kern.moe_down_a8_kernel[grids["down"]](hq, hs, down.contiguous(), ds, w, offsets, order, B, T, y, **dn, **opts,
                                               **_FUSION)
    elif shared is not None:
        w_all = torch.cat([w.reshape(-1), sw.reshape(-1).to(w.dtype)])  # the shared pairs' weights follow
        kern.moe_gate_up_shared_kernel[grids["gate_up"]](x, gate_up.contiguous(), sg.contiguous(), su.contiguous(),
                                                         offsets, order, B, T, h, **gu, **opts, **_FUSION)
        kern.moe_down_shared_kernel[grids["down"]](h, down.contiguous(), sd.contiguous(), w_all, offsets, order, B, T,
                                                   y, **dn, **opts, **_FUSION)
    else:
        kern.moe_gate_up_kernel[grids["gate_up"]](x, gate_up.contiguous(), gs, offsets, order, B, T, h, **gu, **opts,
                                                  **_FUSION)
        kern.moe_down_kernel[grids["down"]](h, down.contiguous(), ds, w, offsets, order, B, T, y, **dn, **opts,
                                            **_FUSION)
    kern.moe_combine_kernel[grids["combine"]](
        y,
        idx,
        out,
        **launch.moe_combine_constexprs(D, E, top_k, shared is not None),
        **launch.MOE_SMALL_LAUNCH,
        **_FUSION,
    )
    return out


def moe_block(x, router_w, gate_up, down, shared_gate, shared_up, shared_down, shared_gate_w, top_k: int,
              top_p: float, coreset: bool, block_size: int, *, arch: int | None = None, tiles: dict | None = None,
              n_causal=None, router_bias=None):
    """The sparse MoE block (`model.SparseMoe`): routed experts + sigmoid(shared gate) x shared expert, the shared
    expert as one more expert of the grouped GEMMs (`moe_experts(shared=...)`). Returns (out, distinct).

    Rounding: each expert's output row times its weight is rounded to the model dtype as the reference rounds it;
    the routed rows and the shared row are then summed in fp32 and rounded once (the reference rounds the routed
    sum first)."""
    import torch.nn.functional as F

    x = x.contiguous()
    idx, w, distinct = moe_route(x, router_w, top_k, top_p, coreset, block_size, n_causal, router_bias)
    sw = torch.sigmoid(F.linear(x, shared_gate_w))  # [B, T, 1], model dtype as the reference's
    out = moe_experts(x, idx, w, gate_up, down, arch=arch, tiles=tiles,
                      shared=(shared_gate, shared_up, shared_down, sw))
    return out, distinct


def moe_align(idx: torch.Tensor, num_experts: int, shared_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets [E+1] int32, order [P] int32): the pairs of idx [B, T, k] grouped by expert id (unused slots,
    id E, are left out; order's tail past offsets[E] is never read). No host sync (CUDA-graph capturable).

    shared_rows = R > 0: one more segment E (offsets [E+2], order [P+R]) holding pairs P..P+R-1, the shared
    expert's (one per token)."""
    from clover_export.plugins.triton import moe as kern

    P = idx.numel()
    counts = torch.zeros(num_experts, dtype=_I32, device=idx.device)
    rank = torch.empty(P, dtype=_I32, device=idx.device)
    offsets = torch.empty(num_experts + 1 + (shared_rows > 0), dtype=_I32, device=idx.device)
    order = torch.zeros(P + shared_rows, dtype=_I32, device=idx.device)
    grid = (launch.cdiv(P, launch.MOE_ALIGN_BLOCK),)
    flat = idx.contiguous().view(-1)
    kern.moe_count_kernel[grid](flat, P, counts, rank, E=num_experts, BLOCK=launch.MOE_ALIGN_BLOCK,
                                **launch.MOE_SMALL_LAUNCH, **_FUSION)
    kern.moe_place_kernel[grid](flat, P, shared_rows, counts, rank, offsets, order,
                                **launch.moe_place_constexprs(num_experts, shared_rows > 0),
                                **launch.MOE_SMALL_LAUNCH, **_FUSION)
    return offsets, order


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [R, W] -> (e4m3 [R, W], fp32 scale [R]) with x ~ xq * scale (moe.py `act_quant_kernel`)."""
    R, W = x.shape
    xq = torch.empty(R, W, dtype=torch.float8_e4m3fn, device=x.device)
    xs = torch.empty(R, dtype=torch.float32, device=x.device)
    _row_launch("moe.act_quant_kernel", (x.contiguous(), xq, xs), (), x)
    return xq, xs


def _row_launch(kernel: str, ptrs: tuple, scalars: tuple, like: torch.Tensor, **consts) -> None:
    """Launch a row kernel ("module.name" under plugins/triton: the norms.py glue, moe.act_quant_kernel) over
    the last-dim rows of `like`: kernel(*ptrs, R, *scalars, D=row width, tiles of launch.row_tiles)."""
    import importlib

    D = like.shape[-1]
    R = like.numel() // D if D else 0
    if R:
        module, name = kernel.split(".")
        fn = getattr(importlib.import_module(f"clover_export.plugins.triton.{module}"), name)
        c, opts = launch.row_tiles(D)
        fn[(launch.cdiv(R, c["ROWS"]),)](*ptrs, R, *scalars, D=D, **c, **consts, **opts, **_FUSION)


# ---------------------------------------------------------------- fused glue (norms.py)
def _row_stride(x: torch.Tensor) -> int | None:
    """Element stride between consecutive last-dim rows when x's leading dims collapse to one, else None."""
    if x.dim() < 2:
        return x.shape[-1]
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        return None
    step, span = x.stride(-2), 1
    for i in range(x.dim() - 2, -1, -1):  # dim i must sit `span` rows apart
        if x.shape[i] > 1 and x.stride(i) != step * span:
            return None
        span *= x.shape[i]
    return step


def _rows_of(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    stride = _row_stride(x)
    if stride is None:
        x = x.contiguous()
        stride = x.shape[-1]
    return x, stride


def rms_norm(x, weight, eps: float):
    """`functional.rms_norm` in one kernel."""
    x, stride = _rows_of(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _row_launch("norms.rms_norm_kernel", (x, x, weight.contiguous(), y, y), (stride, 0, float(eps)), x, HAS_RES=False)
    return y


def add_rms_norm(h, r, weight, eps: float):
    """`functional.add_rms_norm` in one kernel: (h + r, rms_norm(h + r))."""
    h, hs = _rows_of(h)
    r, rs = _rows_of(r)
    s = torch.empty(h.shape, dtype=torch.promote_types(h.dtype, r.dtype), device=h.device)
    y = torch.empty_like(s)
    _row_launch("norms.rms_norm_kernel", (h, r, weight.contiguous(), y, s), (hs, rs, float(eps)), h, HAS_RES=True)
    return s, y


def norm_rope(x, weight, eps: float, cos, sin):
    """`functional.norm_rope` in one kernel: x [B, T, heads, hd] (rows may be strided), cos/sin [B, T, rot]."""
    B, T, H, D = x.shape
    x, stride = _rows_of(x)
    y = torch.empty(B, T, H, D, dtype=x.dtype, device=x.device)
    _row_launch("norms.norm_rope_kernel", (x, weight.contiguous(), cos.contiguous(), sin.contiguous(), y),
                (stride, H, float(eps)), x, ROT=cos.shape[-1])
    return y


def gated_rms_norm(o, z, weight, eps: float):
    """`functional.gated_rms_norm` in one kernel."""
    o, z = o.contiguous(), z.contiguous()
    y = torch.empty_like(o)
    _row_launch("norms.gated_rms_norm_kernel", (o, z, weight.contiguous(), y), (float(eps),), o)
    return y


def sigmoid_gate(o, gate):
    """`functional.sigmoid_gate` in one kernel: o [B, T, H, hd] contiguous rows, gate rows may be strided."""
    o = o.contiguous()
    gate, gs = _rows_of(gate)
    y = torch.empty_like(o)
    _row_launch("norms.sigmoid_gate_kernel", (o, gate, y), (gs,), o)
    return y


def swiglu(g, u):
    """`functional.swiglu` in one kernel."""
    g, u = g.contiguous(), u.contiguous()
    y = torch.empty_like(g)
    _row_launch("norms.swiglu_kernel", (g, u, y), (), g)
    return y


def gated_residual(routed, shared_gate, shared):
    """`functional.gated_residual` in one kernel: shared_gate [..., 1] is one gate per row."""
    routed, shared_gate, shared = routed.contiguous(), shared_gate.contiguous(), shared.contiguous()
    y = torch.empty_like(routed)
    _row_launch("norms.gated_residual_kernel", (routed, shared_gate, shared, y), (), routed)
    return y


GLUE = dict(rms_norm=rms_norm, add_rms_norm=add_rms_norm, norm_rope=norm_rope, gated_rms_norm=gated_rms_norm,
            sigmoid_gate=sigmoid_gate, swiglu=swiglu, gated_residual=gated_residual)
