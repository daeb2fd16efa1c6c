"""`clover::BlockAttention` in Triton (MODEL.md 4, 5.1; STEP_GRAPH.md 2).

Semantics are those of `clover_export.model.attention.attention_core`. The
query vectors of one (batch row, kv-head) are its T rows times the H/Hkv
q-heads that share the kv-head (GQA), flattened and tiled by BLOCK_M, so K/V
tiles are read once per tile of many queries. Keys form one virtual sequence
per batch row: cache positions [0, L) where [past_len, past_len + n_causal)
come from the step's own causal K/V (what the slot holds once they are
written), then the block rows' K/V. Per query row a visibility limit masks
it: causal row j sees positions < past_len + j + 1, block rows see
< past_len + n_causal plus the whole block.

Reads of the pool never touch [past_len, past_len + n_causal), which is
exactly where the causal rows' K/V are written (by the programs of query
tile 0, split 0), so the in-place update (aliased pools) cannot race. The
torch path writes them first instead (`write_kv_kernel`, its own launch) and
runs the attention with KV_FIRST: the prefix loop is then one contiguous pool
load per tile.

`block_attention_kernel`: one pass, the TensorRT AOT kernel.
`block_attention_split_kernel` + `attention_merge_kernel`: flash-decoding
split of the cached prefix over a grid axis, then a merge; used when a pass
alone would leave most of the GPU idle (batch 1, long prefix): by the torch
path, and on TensorRT as two AOT plugins (`clover::BlockAttentionSplit` /
`BlockAttentionMerge`, the partials a graph tensor; split count from the
shapes at run time, `launch.attention_splits`).

Garbage-safe (docs/tensorrt.md): TensorRT times every plugin on inputs of
arbitrary values while it builds. The TensorRT kernels clamp the values they
address memory with: slot ids to [0, S) (S, the pools' slot count, is a
scalar from their shape), past_len to [0, L], n_causal to [0, T - N], and the
merge's split count to the splits its partials hold (ROWS, their first
dimension): any values give some output, never an access outside the
tensors. `write_kv_kernel` (the torch path's first launch) trusts its inputs.
"""

from __future__ import annotations

import triton
import triton.language as tl

_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima (keeps exp() NaN-free)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _clamp(x, lo, hi):
    """x limited to [lo, hi]: an index read from an input tensor, kept inside what it indexes."""
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def _tile_setup(q_ptr, slot_ids_ptr, past_len_ptr, n_causal_ptr, T, L, S, pid_m, pid_bh,
                H: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr, N: tl.constexpr,
                BLOCK_M: tl.constexpr):
    REP: tl.constexpr = H // HKV
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    Tc = T - N
    # garbage-safe: the ids are clamped to the pools' slots, positions and the step's causal rows
    slot = _clamp(tl.load(slot_ids_ptr + b), 0, S - 1).to(tl.int64)
    past = _clamp(tl.load(past_len_ptr + b), 0, L)
    nc = _clamp(tl.load(n_causal_ptr + b), 0, Tc)
    mi = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = mi < T * REP
    row = mi // REP
    head = kvh * REP + mi % REP
    d = tl.arange(0, HDP)
    d_ok = d < HD
    q_off = ((b.to(tl.int64) * T + row) * H + head)[:, None] * HD + d[None, :]
    q = tl.load(q_ptr + q_off, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    causal = row < Tc
    limit = tl.minimum(tl.where(causal, past + row + 1, past + nc), L)  # visible cache positions < limit
    limit = tl.where(m_ok, limit, 0)
    hi = tl.max(limit, axis=0)
    return b, kvh, slot, past, nc, Tc, row, head, m_ok, causal, limit, hi, q, q_off, d, d_ok


@triton.jit
def _attend_cache(acc, m_i, l_i, q, k_ptr, v_ptr, kp_ptr, vp_ptr, b, kvh, slot, past, nc, T, L, limit,
                  start, stop, d, d_ok,
                  HKV: tl.constexpr, HD: tl.constexpr, SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_PREC: tl.constexpr, KV_FIRST: tl.constexpr):
    """Online softmax over cache positions [start, stop).

    KV_FIRST (the torch path: `write_kv_kernel` ran before this launch): every position comes from the pool,
    one contiguous load per tile. Else the step's causal positions [past, past + nc) come from k/v (two
    masked loads per tile)."""
    pool_base = (slot * HKV + kvh) * L
    for n0 in range(start, stop, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        live = pos < stop
        p_off = (pool_base + pos)[:, None] * HD + d[None, :]
        if KV_FIRST:
            pm = live[:, None] & d_ok[None, :]
            kt = tl.load(kp_ptr + p_off, mask=pm, other=0.0)
        else:
            in_step = (pos >= past) & (pos < past + nc)
            pm = (live & ~in_step)[:, None] & d_ok[None, :]
            sm = (live & in_step)[:, None] & d_ok[None, :]
            s_off = ((b.to(tl.int64) * T + (pos - past)) * HKV + kvh)[:, None] * HD + d[None, :]
            kt = tl.load(kp_ptr + p_off, mask=pm, other=0.0) + tl.load(k_ptr + s_off, mask=sm, other=0.0)
        s = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC) * (SCALE * _LOG2E)
        s = tl.where(pos[None, :] < limit[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_FIRST:
            vt = tl.load(vp_ptr + p_off, mask=pm, other=0.0)
        else:
            vt = tl.load(vp_ptr + p_off, mask=pm, other=0.0) + tl.load(v_ptr + s_off, mask=sm, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend_block(acc, m_i, l_i, q, k_ptr, v_ptr, b, kvh, T, Tc, causal, d, d_ok,
                  HKV: tl.constexpr, HD: tl.constexpr, N: tl.constexpr, BN: tl.constexpr, SCALE: tl.constexpr,
                  DOT_PREC: tl.constexpr):
    """The block rows' own K/V: visible to block rows only (bidirectional)."""
    s_idx = tl.arange(0, BN)
    s_ok = s_idx < N
    off = ((b.to(tl.int64) * T + Tc + s_idx) * HKV + kvh)[:, None] * HD + d[None, :]
    msk = s_ok[:, None] & d_ok[None, :]
    kt = tl.load(k_ptr + off, mask=msk, other=0.0)
    s = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC) * (SCALE * _LOG2E)
    s = tl.where(~causal[:, None] & s_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    vt = tl.load(v_ptr + off, mask=msk, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _write_causal_kv(k_ptr, v_ptr, ko_ptr, vo_ptr, b, kvh, slot, past, nc, T, L, d, d_ok,
                     HKV: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Causal rows j < n_causal go to cache position past_len + j (if inside the pool)."""
    for j0 in range(0, nc, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        ok = (j < nc) & (past + j < L)
        msk = ok[:, None] & d_ok[None, :]
        src = ((b.to(tl.int64) * T + j) * HKV + kvh)[:, None] * HD + d[None, :]
        dst = ((slot * HKV + kvh) * L + past + j)[:, None] * HD + d[None, :]
        tl.store(ko_ptr + dst, tl.load(k_ptr + src, mask=msk, other=0.0), mask=msk)
        tl.store(vo_ptr + dst, tl.load(v_ptr + src, mask=msk, other=0.0), mask=msk)


@triton.jit
def block_attention_kernel(
    q_ptr, k_ptr, v_ptr, kp_ptr, vp_ptr, slot_ids_ptr, past_len_ptr, n_causal_ptr,
    T, L, S,
    o_ptr, ko_ptr, vo_ptr,
    H: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr, N: tl.constexpr, BN: tl.constexpr,
    SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    KV_FIRST: tl.constexpr,
):
    """Grid (cdiv(T * H/Hkv, BLOCK_M), B * Hkv): one pass over the visible prefix, then the block."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, kvh, slot, past, nc, Tc, row, head, m_ok, causal, limit, hi, q, q_off, d, d_ok = _tile_setup(
        q_ptr, slot_ids_ptr, past_len_ptr, n_causal_ptr, T, L, S, pid_m, pid_bh, H, HKV, HD, HDP, N, BLOCK_M)
    acc = tl.zeros([BLOCK_M, HDP], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_cache(acc, m_i, l_i, q, k_ptr, v_ptr, kp_ptr, vp_ptr, b, kvh, slot, past, nc, T, L,
                                  limit, 0, hi, d, d_ok, HKV, HD, SCALE, BLOCK_N, DOT_PREC, KV_FIRST)
    if N > 0:
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_ptr, v_ptr, b, kvh, T, Tc, causal, d, d_ok,
                                      HKV, HD, N, BN, SCALE, DOT_PREC)
    l_i = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_i[:, None]
    tl.store(o_ptr + q_off, o.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    if not KV_FIRST:
        if pid_m == 0:
            _write_causal_kv(k_ptr, v_ptr, ko_ptr, vo_ptr, b, kvh, slot, past, nc, T, L, d, d_ok, HKV, HD, BLOCK_N)


@triton.jit
def block_attention_split_kernel(
    q_ptr, k_ptr, v_ptr, kp_ptr, vp_ptr, slot_ids_ptr, past_len_ptr, n_causal_ptr,
    T, L, S,
    acc_ptr, ml_ptr, splits_ptr, ko_ptr, vo_ptr,
    H: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr, N: tl.constexpr, BN: tl.constexpr,
    SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    KV_FIRST: tl.constexpr,
):
    """Grid (m tiles, B * Hkv, splits): split s takes one slice of the visible prefix; the last also the block.

    Writes unnormalised partials (`clover::BlockAttentionSplit`, model/attention_split.py): acc [S * B * T * H,
    HD] fp32, (m, l) [S * B * T * H, 2] fp32 (the buffers may hold more rows), and S into splits_ptr for the merge.
    S is the grid's third dimension (TensorRT computes it from the shapes at run time: launch.attention_splits)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    sp = tl.program_id(2)
    SPLITS = tl.num_programs(2)
    b, kvh, slot, past, nc, Tc, row, head, m_ok, causal, limit, hi, q, q_off, d, d_ok = _tile_setup(
        q_ptr, slot_ids_ptr, past_len_ptr, n_causal_ptr, T, L, S, pid_m, pid_bh, H, HKV, HD, HDP, N, BLOCK_M)
    per = tl.cdiv(tl.cdiv(hi, SPLITS), BLOCK_N) * BLOCK_N
    start = sp * per
    stop = tl.minimum(start + per, hi)
    acc = tl.zeros([BLOCK_M, HDP], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_cache(acc, m_i, l_i, q, k_ptr, v_ptr, kp_ptr, vp_ptr, b, kvh, slot, past, nc, T, L,
                                  limit, start, stop, d, d_ok, HKV, HD, SCALE, BLOCK_N, DOT_PREC, KV_FIRST)
    if N > 0:
        if sp == SPLITS - 1:
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_ptr, v_ptr, b, kvh, T, Tc, causal, d, d_ok,
                                          HKV, HD, N, BN, SCALE, DOT_PREC)
    B = tl.num_programs(1) // HKV
    qrow = (b.to(tl.int64) * T + row) * H + head  # [BLOCK_M]
    part = sp.to(tl.int64) * B * T * H + qrow
    tl.store(acc_ptr + part[:, None] * HD + d[None, :], acc, mask=m_ok[:, None] & d_ok[None, :])
    tl.store(ml_ptr + part * 2, m_i, mask=m_ok)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=m_ok)
    if (pid_m + pid_bh + sp) == 0:
        tl.store(splits_ptr, SPLITS)
    if not KV_FIRST and pid_m == 0:
        if sp == 0:
            _write_causal_kv(k_ptr, v_ptr, ko_ptr, vo_ptr, b, kvh, slot, past, nc, T, L, d, d_ok, HKV, HD, BLOCK_N)


@triton.jit
def write_kv_kernel(k_ptr, v_ptr, slot_ids_ptr, past_len_ptr, n_causal_ptr, T, L, ko_ptr, vo_ptr,
                    HKV: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (B * Hkv,): the step's causal K/V into the pool (the torch path's first launch, KV_FIRST)."""
    pid_bh = tl.program_id(0)
    b = pid_bh // HKV
    d = tl.arange(0, HDP)
    _write_causal_kv(k_ptr, v_ptr, ko_ptr, vo_ptr, b, pid_bh % HKV, tl.load(slot_ids_ptr + b).to(tl.int64),
                     tl.load(past_len_ptr + b), tl.load(n_causal_ptr + b), T, L, d, d < HD, HKV, HD, BLOCK_N)


@triton.jit
def attention_merge_kernel(acc_ptr, ml_ptr, splits_ptr, q_ptr, T, ROWS, o_ptr, H: tl.constexpr, HD: tl.constexpr,
                           HDP: tl.constexpr, BLOCK_R: tl.constexpr):
    """Grid (cdiv(T * H, BLOCK_R), B): `clover::BlockAttentionMerge`, o from the S = splits_ptr[0] partials the
    split kernel wrote, one pass over them (running maximum, both sums rescaled as it grows). q gives o's dtype
    and is not read. ROWS: the partials' first dimension; S is clamped to the splits they hold (garbage-safe)."""
    R = tl.num_programs(1).to(tl.int64) * T * H
    S = _clamp(tl.load(splits_ptr).to(tl.int64), 0, ROWS.to(tl.int64) * H // R)
    local = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = local < T * H
    r = tl.program_id(1).to(tl.int64) * T * H + local
    d = tl.arange(0, HDP)
    d_ok = d < HD
    m = tl.full([BLOCK_R], _NEG, dtype=tl.float32)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    num = tl.zeros([BLOCK_R, HDP], dtype=tl.float32)
    for s in range(S):
        part = s * R + r
        ms = tl.load(ml_ptr + part * 2, mask=r_ok, other=_NEG)
        m_new = tl.maximum(m, ms)
        keep, take = tl.exp2(m - m_new), tl.exp2(ms - m_new)
        den = den * keep + take * tl.load(ml_ptr + part * 2 + 1, mask=r_ok, other=0.0)
        a = tl.load(acc_ptr + part[:, None] * HD + d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        num = num * keep[:, None] + take[:, None] * a
        m = m_new
    den = tl.where(den > 0, den, 1.0)
    tl.store(o_ptr + r[:, None] * HD + d[None, :], (num / den[:, None]).to(o_ptr.dtype.element_ty),
             mask=r_ok[:, None] & d_ok[None, :])
