"""`clover::BlockGDN` in Triton (MODEL.md 4, 5.2; STEP_GRAPH.md 2).

Semantics, argument order and dtypes are those of `clover_export.model.gdn.gdn_core`.
Two forms share one per-(v-head, dv tile) body (`_head_tile`):

- `block_gdn_kernel` (the TensorRT plugin, one launch): one program per
  (batch row, k-head). It owns every conv channel that k-head touches (its q
  and k channels and the v channels of its Hv/Hk v-heads), so it can read the
  slot's old conv state and write the new one in place with no other program
  racing on those channels (the pools alias on TensorRT). It loops over its
  v-heads and dv tiles, recomputing the q/k conv for each.
- `gdn_conv_kernel` + `gdn_delta_kernel` (the torch path, two launches): the
  conv kernel, one program per (batch row, q/k/v head), owns its channels: it
  writes the activated rows (conv, SiLU, L2-normalised q/k) to an fp32
  scratch tensor and the new conv state in place. The delta-rule kernel then
  runs on a (batch row, v-head, dv tile) grid: 8x the programs of the fused
  kernel at Clover sizes (it was latency-bound on 16 programs at B = 1).

Inside the body, for one v-head and dv tile:

- causal rows, in chunks of CC rows: causal conv from the slot's conv state,
  SiLU (model-dtype rounding as upstream), L2-normalised q/k, beta, g, then
  the chunked gated delta rule in WY form; (I + A)^-1 for the strictly lower
  triangular A is applied by forward substitution over the chunk's rows
  (not the nilpotent product series, STEP_GRAPH.md 2), the rest with `tl.dot`;
- block rows: the [assumed] block mixer of MODEL.md 5.2 in fp32 (causal +
  anti-causal conv, prefix read-out, innovation, block softmax, gate) from
  the state after the causal rows; block rows write nothing;
- the recurrent state after the causal rows goes back into the slot.

The conv state is written last, after a barrier, once every read of it in
the program is done.

Garbage-safe (docs/tensorrt.md): TensorRT times every plugin on inputs of
arbitrary values while it builds, so `block_gdn_kernel` clamps the values it
addresses memory with, slot ids to [0, S) (S, the pools' slot count, is a
scalar from their shape) and n_causal to [0, T - N]: any values give some
output, never an access outside the tensors. The torch path's two kernels
trust their inputs.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _clamp(x, lo, hi):
    """x limited to [lo, hi]: an index read from an input tensor, kept inside what it indexes."""
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def _softplus(x):
    # torch.nn.functional.softplus (beta 1, threshold 20)
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _conv_causal_rows(m_ptr, st_ptr, w_ptr, rows, Tc, chans, cmask, C: tl.constexpr, KCONV: tl.constexpr):
    """Causal conv of causal rows `rows` (< Tc valid) over channels `chans`, model-dtype weights.

    Tap KCONV-1 multiplies the current row; earlier taps read earlier causal
    rows or, before row 0, the slot's conv state (its column KCONV-1+p).
    Returns the fp32 accumulator [R, CH].
    """
    dt = m_ptr.dtype.element_ty
    acc = tl.zeros([rows.shape[0], chans.shape[0]], dtype=tl.float32)
    live = (rows < Tc)[:, None] & cmask[None, :]
    for j in range(KCONV):
        p = rows - (KCONV - 1) + j
        xm = tl.load(m_ptr + p[:, None] * C + chans[None, :], mask=live & (p >= 0)[:, None], other=0.0)
        xs = tl.load(st_ptr + chans[None, :] * (KCONV - 1) + (KCONV - 1 + p)[:, None],
                     mask=live & (p < 0)[:, None], other=0.0)
        w = tl.load(w_ptr + chans * KCONV + j, mask=cmask, other=0.0).to(dt).to(tl.float32)
        acc += (xm.to(tl.float32) + xs.to(tl.float32)) * w[None, :]
    return acc


@triton.jit
def _conv_block_rows(m_ptr, st_ptr, w_ptr, wr_ptr, rows, N: tl.constexpr, Tc, nc, chans, cmask,
                     C: tl.constexpr, KCONV: tl.constexpr):
    """[assumed] block conv (MODEL.md 5.2 step 1) in fp32, before SiLU.

    Causal taps read the history after the step's valid causal rows (the new
    conv state); anti-causal taps read later block rows, zero past the end.
    """
    acc = tl.zeros([rows.shape[0], chans.shape[0]], dtype=tl.float32)
    live = (rows < N)[:, None] & cmask[None, :]
    for j in range(KCONV):
        p = rows - (KCONV - 1) + j  # block-relative position read by the causal tap
        vp = nc + p  # position in the causal run when before the block
        xb = tl.load(m_ptr + (Tc + p)[:, None] * C + chans[None, :], mask=live & (p >= 0)[:, None], other=0.0)
        xc = tl.load(m_ptr + vp[:, None] * C + chans[None, :], mask=live & ((p < 0) & (vp >= 0))[:, None], other=0.0)
        xs = tl.load(st_ptr + chans[None, :] * (KCONV - 1) + (KCONV - 1 + vp)[:, None],
                     mask=live & (vp < 0)[:, None], other=0.0)
        w = tl.load(w_ptr + chans * KCONV + j, mask=cmask, other=0.0).to(tl.float32)
        acc += (xb.to(tl.float32) + xc.to(tl.float32) + xs.to(tl.float32)) * w[None, :]
        pr = rows + j  # anti-causal tap j
        xr = tl.load(m_ptr + (Tc + pr)[:, None] * C + chans[None, :], mask=live & (pr < N)[:, None], other=0.0)
        wr = tl.load(wr_ptr + chans * KCONV + j, mask=cmask, other=0.0).to(tl.float32)
        acc += xr.to(tl.float32) * wr[None, :]
    return acc


@triton.jit
def _silu_rounded(acc, dt: tl.constexpr):
    """Upstream causal path: conv output in the model dtype, SiLU in the model dtype."""
    x = acc.to(dt).to(tl.float32)
    return (x * tl.sigmoid(x)).to(dt).to(tl.float32)


@triton.jit
def _causal_act(m_ptr, st_ptr, w_ptr, rows, Tc, chans, cmask, C: tl.constexpr, KCONV: tl.constexpr, dt: tl.constexpr):
    return _silu_rounded(_conv_causal_rows(m_ptr, st_ptr, w_ptr, rows, Tc, chans, cmask, C, KCONV), dt)


@triton.jit
def _silu_f32(x):
    return x * tl.sigmoid(x)


@triton.jit
def _l2norm(x):
    return x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit
def _act_rows(act_base, rows, row_ok, chans, cmask, C: tl.constexpr):
    """Rows of `gdn_conv_kernel`'s fp32 scratch (zero outside `row_ok`)."""
    return tl.load(act_base + rows[:, None] * C + chans[None, :], mask=row_ok[:, None] & cmask[None, :], other=0.0)


@triton.jit
def _head_tile(src, a_ptr, b_ptr, conv_w_ptr, conv_wr_ptr, A_log_ptr, dt_bias_ptr, bscale_ptr, bgate_ptr,
               st_base, rec_pool_ptr, rec_out_ptr, o_ptr, pid_b, slot, nc, T, h, kh, v0,
               HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KCONV: tl.constexpr,
               N: tl.constexpr, DKP: tl.constexpr, BV: tl.constexpr, CC: tl.constexpr, BN: tl.constexpr,
               Q_SCALE: tl.constexpr, DOT_PREC: tl.constexpr, FROM_ACT: tl.constexpr):
    """v-head h, state columns [v0, v0 + BV): output rows and the recurrent state after the causal rows.

    src: the batch row's pre-conv rows [T, C] (FROM_ACT False: q/k/v are convolved here from them and the
    slot's conv state at st_base) or its activated rows from `gdn_conv_kernel` (FROM_ACT True)."""
    C: tl.constexpr = 2 * HK * DK + HV * DV
    dt = o_ptr.dtype.element_ty
    Tc = T - N
    dk = tl.arange(0, DKP)
    dk_ok = dk < DK
    q_ch = kh * DK + dk
    k_ch = HK * DK + kh * DK + dk
    dvv = tl.arange(0, BV)
    rr = tl.arange(0, CC)
    tri_incl = rr[:, None] >= rr[None, :]
    tri_strict = rr[:, None] > rr[None, :]
    rb = tl.arange(0, BN)
    rb_ok = rb < N
    A_h = tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dtb_h = tl.load(dt_bias_ptr + h).to(tl.float32)
    v_col = v0 + dvv
    v_ok = v_col < DV
    v_ch = 2 * HK * DK + h * DV + v_col
    s_ptrs = (slot * HV + h) * DK * DV + dk[:, None] * DV + v_col[None, :]
    s_mask = dk_ok[:, None] & v_ok[None, :]
    S = tl.load(rec_pool_ptr + s_ptrs, mask=s_mask, other=0.0)

    # ---- causal rows: chunked gated delta rule (MODEL.md 4) ----
    for c0 in range(0, Tc, CC):
        rows = c0 + rr
        row_ok = rows < Tc
        valid = rows < nc
        if FROM_ACT:  # gdn_conv_kernel's rows (the same values, computed once)
            q = _act_rows(src, rows, row_ok, q_ch, dk_ok, C)
            k = _act_rows(src, rows, row_ok, k_ch, dk_ok, C)
            v = _act_rows(src, rows, row_ok, v_ch, v_ok, C)
        else:
            q = _l2norm(_causal_act(src, st_base, conv_w_ptr, rows, Tc, q_ch, dk_ok, C, KCONV, dt))
            k = _l2norm(_causal_act(src, st_base, conv_w_ptr, rows, Tc, k_ch, dk_ok, C, KCONV, dt))
            v = _causal_act(src, st_base, conv_w_ptr, rows, Tc, v_ch, v_ok, C, KCONV, dt)
        q = tl.where(row_ok[:, None], q * Q_SCALE, 0.0)
        k = tl.where(row_ok[:, None], k, 0.0)
        v = tl.where(row_ok[:, None], v, 0.0)
        gi = (pid_b.to(tl.int64) * T + rows) * HV + h
        bv = tl.load(b_ptr + gi, mask=row_ok, other=0.0).to(tl.float32)
        beta = tl.where(valid, tl.sigmoid(bv).to(dt).to(tl.float32), 0.0)
        av = tl.load(a_ptr + gi, mask=row_ok, other=0.0).to(tl.float32)
        g = tl.where(valid, -A_h * _softplus(av + dtb_h), 0.0)
        G = tl.cumsum(g, axis=0)
        decay = tl.where(tri_incl, tl.exp(tl.minimum(G[:, None] - G[None, :], 0.0)), 0.0)
        kk = tl.dot(k, tl.trans(k), input_precision=DOT_PREC)
        A = tl.where(tri_strict, beta[:, None] * kk * decay, 0.0)
        kS = tl.dot(k, S, input_precision=DOT_PREC)
        # v_new = (I + A)^-1 beta (v - exp(G) k S)
        x = beta[:, None] * (v - tl.exp(G)[:, None] * kS)
        # forward substitution, row by row: x_i -= A[i, :i] x[:i] (STEP_GRAPH.md 2: the product
        # series (I - A)(I + A^2)... cancels catastrophically once keys agree and decay is slow).
        # Rows from nc on have beta = 0 (zero rows of A and x): the loop stops at the last valid row.
        for i in range(1, tl.minimum(nc - c0, CC)):
            a_i = tl.sum(tl.where(rr[:, None] == i, A, 0.0), axis=0)  # row i of A: zero from column i
            x = tl.where(rr[:, None] == i, x - tl.sum(a_i[:, None] * x, axis=0)[None, :], x)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * decay
        o = (tl.dot(q * tl.exp(G)[:, None], S, input_precision=DOT_PREC)
             + tl.dot(qk, x, input_precision=DOT_PREC))
        o_ptrs = o_ptr + ((pid_b.to(tl.int64) * T + rows) * HV + h)[:, None] * DV + v_col[None, :]
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])
        G_last = tl.sum(g, axis=0)
        kw = k * tl.exp(G_last - G)[:, None]
        S = S * tl.exp(G_last) + tl.dot(tl.trans(kw), x, input_precision=DOT_PREC)

    # ---- block rows: [assumed] block mixer (MODEL.md 5.2), fp32 ----
    if N > 0:
        if FROM_ACT:
            qb = _act_rows(src, Tc + rb, rb_ok, q_ch, dk_ok, C)
            kb = _act_rows(src, Tc + rb, rb_ok, k_ch, dk_ok, C)
            vb = _act_rows(src, Tc + rb, rb_ok, v_ch, v_ok, C)
        else:
            qb = tl.where(rb_ok[:, None], _l2norm(_silu_f32(_conv_block_rows(
                src, st_base, conv_w_ptr, conv_wr_ptr, rb, N, Tc, nc, q_ch, dk_ok, C, KCONV))), 0.0)
            kb = tl.where(rb_ok[:, None], _l2norm(_silu_f32(_conv_block_rows(
                src, st_base, conv_w_ptr, conv_wr_ptr, rb, N, Tc, nc, k_ch, dk_ok, C, KCONV))), 0.0)
            vb = tl.where(rb_ok[:, None], _silu_f32(_conv_block_rows(
                src, st_base, conv_w_ptr, conv_wr_ptr, rb, N, Tc, nc, v_ch, v_ok, C, KCONV)), 0.0)
        gib = (pid_b.to(tl.int64) * T + Tc + rb) * HV + h
        bv = tl.load(b_ptr + gib, mask=rb_ok, other=0.0).to(tl.float32)
        beta_b = tl.where(rb_ok, tl.sigmoid(bv).to(dt).to(tl.float32), 0.0)
        av = tl.load(a_ptr + gib, mask=rb_ok, other=0.0).to(tl.float32)
        g_b = tl.where(rb_ok, -A_h * _softplus(av + dtb_h), 0.0)
        eG = tl.exp(tl.cumsum(g_b, axis=0))
        o_pre = tl.dot(qb, S, input_precision=DOT_PREC) * (Q_SCALE * eG[:, None])
        v_in = vb - eG[:, None] * tl.dot(kb, S, input_precision=DOT_PREC)
        bscale = tl.load(bscale_ptr + h).to(tl.float32)
        sc = tl.dot(qb, tl.trans(kb), input_precision=DOT_PREC) * bscale
        sc = tl.where(rb_ok[None, :], sc, float("-inf"))
        pr = tl.exp(sc - tl.max(sc, axis=1)[:, None])
        pr = pr / tl.sum(pr, axis=1)[:, None]
        o_blk = tl.dot(pr, beta_b[:, None] * v_in, input_precision=DOT_PREC)
        gate = tl.sigmoid(tl.load(bgate_ptr + h).to(tl.float32))
        ob = o_pre + gate * o_blk
        ob_ptrs = o_ptr + ((pid_b.to(tl.int64) * T + Tc + rb) * HV + h)[:, None] * DV + v_col[None, :]
        tl.store(ob_ptrs, ob.to(o_ptr.dtype.element_ty), mask=rb_ok[:, None] & v_ok[None, :])

    tl.debug_barrier()
    tl.store(rec_out_ptr + s_ptrs, S, mask=s_mask)


@triton.jit
def block_gdn_kernel(
    # inputs (contract order)
    mixed_ptr, a_ptr, b_ptr, conv_w_ptr, conv_wr_ptr, A_log_ptr, dt_bias_ptr, bscale_ptr, bgate_ptr,
    conv_pool_ptr, rec_pool_ptr, slot_ids_ptr, n_causal_ptr,
    # int32 scalars: step rows, pool slots (bounds of the slot ids and n_causal values)
    T, S,
    # outputs
    o_ptr, conv_out_ptr, rec_out_ptr,
    # compile-time sizes
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KCONV: tl.constexpr,
    N: tl.constexpr, DKP: tl.constexpr, BV: tl.constexpr, CC: tl.constexpr, LOG2_CC: tl.constexpr,
    BN: tl.constexpr, KM1P: tl.constexpr, Q_SCALE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    REP: tl.constexpr = HV // HK
    C: tl.constexpr = 2 * HK * DK + HV * DV
    KM1: tl.constexpr = KCONV - 1
    pid_b = tl.program_id(0)
    kh = tl.program_id(1)
    # any input values stay inside the tensors (TensorRT times plugins on garbage): ids clamped to their ranges
    slot = _clamp(tl.load(slot_ids_ptr + pid_b), 0, S - 1).to(tl.int64)
    nc = _clamp(tl.load(n_causal_ptr + pid_b), 0, T - N)

    m_base = mixed_ptr + pid_b.to(tl.int64) * T * C
    st_base = conv_pool_ptr + slot * C * KM1
    dk = tl.arange(0, DKP)
    dk_ok = dk < DK

    for r in range(REP):
        for v0 in range(0, DV, BV):
            _head_tile(m_base, a_ptr, b_ptr, conv_w_ptr, conv_wr_ptr, A_log_ptr, dt_bias_ptr, bscale_ptr, bgate_ptr,
                       st_base, rec_pool_ptr, rec_out_ptr, o_ptr, pid_b, slot, nc, T, kh * REP + r, kh, v0,
                       HK, HV, DK, DV, KCONV, N, DKP, BV, CC, BN, Q_SCALE, DOT_PREC, False)

    # ---- new conv state: the last K-1 valid pre-conv rows (after every read above) ----
    jj = tl.arange(0, KM1P)
    j_ok = jj < KM1
    hist = nc + jj  # index into [old state (K-1 columns), causal rows]
    from_state = hist < KM1
    for part in tl.static_range(2):  # q channels, then k channels
        _copy_conv_state(m_base, st_base, conv_out_ptr + slot * C * KM1, part * HK * DK + kh * DK + dk, dk_ok,
                         hist, from_state, j_ok, jj, C, KM1)
    for r in range(REP):
        for v0 in range(0, DV, DKP):
            col = v0 + dk
            _copy_conv_state(m_base, st_base, conv_out_ptr + slot * C * KM1, 2 * HK * DK + (kh * REP + r) * DV + col,
                             col < DV, hist, from_state, j_ok, jj, C, KM1)


@triton.jit
def _copy_conv_state(m_base, st_base, out_base, ch, cm, hist, from_state, j_ok, jj, C: tl.constexpr, KM1: tl.constexpr):
    msk = cm[:, None] & j_ok[None, :]
    old = tl.load(st_base + ch[:, None] * KM1 + hist[None, :], mask=msk & from_state[None, :], other=0.0)
    new = tl.load(m_base + (hist - KM1)[None, :] * C + ch[:, None], mask=msk & ~from_state[None, :], other=0.0)
    val = tl.where(from_state[None, :], old, new)
    tl.debug_barrier()  # the shift reads columns other threads write
    tl.store(out_base + ch[:, None] * KM1 + jj[None, :], val.to(out_base.dtype.element_ty), mask=msk)


@triton.jit
def gdn_conv_kernel(mixed_ptr, conv_w_ptr, conv_wr_ptr, conv_pool_ptr, slot_ids_ptr, n_causal_ptr, T,
                    act_ptr, conv_out_ptr,
                    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KCONV: tl.constexpr,
                    N: tl.constexpr, CP: tl.constexpr, RT: tl.constexpr, BN: tl.constexpr, KM1P: tl.constexpr):
    """Grid (B, 2 Hk + Hv): program (b, j) owns q head j (j < Hk), k head j - Hk (j < 2 Hk) or v head j - 2 Hk.

    act [B, T, C] fp32 <- the activated rows `_head_tile` would compute: causal rows conv + SiLU in the model
    dtype, block rows the [assumed] fp32 block conv + SiLU; q/k L2-normalised (q unscaled). Then the new conv
    state of its channels, in place (no other program reads them)."""
    C: tl.constexpr = 2 * HK * DK + HV * DV
    KM1: tl.constexpr = KCONV - 1
    dt = mixed_ptr.dtype.element_ty
    pid_b = tl.program_id(0)
    j = tl.program_id(1)
    slot = tl.load(slot_ids_ptr + pid_b).to(tl.int64)
    nc = tl.load(n_causal_ptr + pid_b)
    Tc = T - N
    is_qk = j < 2 * HK
    d = tl.arange(0, CP)
    ch = tl.where(is_qk, j * DK, 2 * HK * DK + (j - 2 * HK) * DV) + d
    ok = d < tl.where(is_qk, DK, DV)
    m_base = mixed_ptr + pid_b.to(tl.int64) * T * C
    a_base = act_ptr + pid_b.to(tl.int64) * T * C
    st_base = conv_pool_ptr + slot * C * KM1
    rt = tl.arange(0, RT)
    for r0 in range(0, Tc, RT):
        rows = r0 + rt
        x = _causal_act(m_base, st_base, conv_w_ptr, rows, Tc, ch, ok, C, KCONV, dt)
        x = tl.where(is_qk, _l2norm(x), x)
        tl.store(a_base + rows[:, None] * C + ch[None, :], x, mask=(rows < Tc)[:, None] & ok[None, :])
    if N > 0:
        rb = tl.arange(0, BN)
        x = _silu_f32(_conv_block_rows(m_base, st_base, conv_w_ptr, conv_wr_ptr, rb, N, Tc, nc, ch, ok, C, KCONV))
        x = tl.where(is_qk, _l2norm(x), x)
        tl.store(a_base + (Tc + rb)[:, None] * C + ch[None, :], x, mask=(rb < N)[:, None] & ok[None, :])
    jj = tl.arange(0, KM1P)
    hist = nc + jj  # index into [old state (K-1 columns), causal rows]
    _copy_conv_state(m_base, st_base, conv_out_ptr + slot * C * KM1, ch, ok, hist, hist < KM1, jj < KM1, jj, C, KM1)


@triton.jit
def gdn_delta_kernel(act_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, bscale_ptr, bgate_ptr, rec_pool_ptr,
                     slot_ids_ptr, n_causal_ptr, T, o_ptr, rec_out_ptr,
                     HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KCONV: tl.constexpr,
                     N: tl.constexpr, DKP: tl.constexpr, BV: tl.constexpr, CC: tl.constexpr, LOG2_CC: tl.constexpr,
                     BN: tl.constexpr, KM1P: tl.constexpr, Q_SCALE: tl.constexpr, DOT_PREC: tl.constexpr):
    """Grid (B, Hv, cdiv(dv, BV)): the delta rule and block mixer of one v-head's state columns from act."""
    C: tl.constexpr = 2 * HK * DK + HV * DV
    pid_b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ids_ptr + pid_b).to(tl.int64)
    nc = tl.load(n_causal_ptr + pid_b)
    src = act_ptr + pid_b.to(tl.int64) * T * C
    _head_tile(src, a_ptr, b_ptr, act_ptr, act_ptr, A_log_ptr, dt_bias_ptr, bscale_ptr, bgate_ptr,
               act_ptr, rec_pool_ptr, rec_out_ptr, o_ptr, pid_b, slot, nc, T, h, h // (HV // HK),
               tl.program_id(2) * BV, HK, HV, DK, DV, KCONV, N, DKP, BV, CC, BN, Q_SCALE, DOT_PREC, True)
