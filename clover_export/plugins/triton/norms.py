"""The glue between the custom ops, fused (RMSNorm + residual, q/k-norm + RoPE, gated RMSNorm,
attention's output gate, the shared expert's SwiGLU and its gated sum with the routed experts).

Semantics are those of `clover_export.model.functional` (rms_norm, add_rms_norm, norm_rope,
gated_rms_norm), including where they round to the model dtype; the torch path
(`plugins/triton/ops.py`) swaps them into `Cores` on the Triton backend. Each
replaces a chain of 5-10 elementwise/reduction launches with one: at B = 8 the
eager chains were ~1,500 launches of 1-5 us per step (the per-kernel profile in
bench/results/step_bound_h200_profile.txt).

Rows: program i normalises rows [i ROWS, (i + 1) ROWS) of a [R, D] view whose
rows sit `stride` elements apart (q is a strided view of q_proj's output);
outputs are contiguous. Statistics in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rows(pid, R, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):
    rows = pid * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    return rows, d, (rows < R)[:, None] & (d < D)[None, :]


@triton.jit
def _inv_rms(xf, eps, D: tl.constexpr):
    return tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)


@triton.jit
def rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, R, x_stride, r_stride, eps,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, HAS_RES: tl.constexpr):
    """y = x / rms(x) * (1 + w); with HAS_RES first x <- x + r (model dtype, as torch's add), stored to s."""
    rows, d, m = _rows(tl.program_id(0), R, ROWS, BLOCK_D, D)
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * x_stride + d[None, :], mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + r64[:, None] * r_stride + d[None, :], mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + r64[:, None] * D + d[None, :], x, mask=m)
    xf = x.to(tl.float32)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    y = xf * _inv_rms(xf, eps, D)[:, None] * (1.0 + w)[None, :]
    tl.store(y_ptr + r64[:, None] * D + d[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, R, x_stride, H, eps,
                     D: tl.constexpr, ROT: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """apply_partial_rope(rms_norm(x)): rows are (batch, position, head); cos/sin [B*T, ROT] (NeoX rotate-half:
    dim i < ROT/2 pairs with i + ROT/2). Each product and the sum round to the model dtype, as torch's ops do."""
    rows, d, m = _rows(tl.program_id(0), R, ROWS, BLOCK_D, D)
    r64 = rows.to(tl.int64)
    dt = y_ptr.dtype.element_ty
    HALF: tl.constexpr = ROT // 2
    xf = tl.load(x_ptr + r64[:, None] * x_stride + d[None, :], mask=m, other=0.0).to(tl.float32)
    inv = _inv_rms(xf, eps, D)[:, None]
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    n = (xf * inv * (1.0 + w)[None, :]).to(dt).to(tl.float32)
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    rm = m & (d < ROT)[None, :]
    xp = tl.load(x_ptr + r64[:, None] * x_stride + partner[None, :], mask=rm, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=d < ROT, other=0.0).to(tl.float32)
    npart = (xp * inv * (1.0 + wp)[None, :]).to(dt).to(tl.float32)
    rotated = tl.where((d < HALF)[None, :], -npart, npart)
    bt = (rows // H).to(tl.int64)
    c = tl.load(cos_ptr + bt[:, None] * ROT + d[None, :], mask=rm, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + bt[:, None] * ROT + d[None, :], mask=rm, other=0.0).to(tl.float32)
    out = ((n * c).to(dt).to(tl.float32) + (rotated * s).to(dt).to(tl.float32)).to(dt)
    out = tl.where((d < ROT)[None, :], out, n.to(dt))
    tl.store(y_ptr + r64[:, None] * D + d[None, :], out, mask=m)


@triton.jit
def gated_rms_norm_kernel(o_ptr, z_ptr, w_ptr, y_ptr, R, eps,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """GDN output norm: ((w * (o / rms(o)).to(dt)).to(dt) * silu(z fp32)).to(dt); w plain (not 1 + w)."""
    rows, d, m = _rows(tl.program_id(0), R, ROWS, BLOCK_D, D)
    r64 = rows.to(tl.int64)
    dt = y_ptr.dtype.element_ty
    of = tl.load(o_ptr + r64[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + r64[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    y = (of * _inv_rms(of, eps, D)[:, None]).to(dt).to(tl.float32)
    wy = (w[None, :] * y).to(dt).to(tl.float32)
    tl.store(y_ptr + r64[:, None] * D + d[None, :], (wy * (z * tl.sigmoid(z))).to(dt), mask=m)


@triton.jit
def sigmoid_gate_kernel(o_ptr, g_ptr, y_ptr, R, g_stride, D: tl.constexpr, BLOCK_D: tl.constexpr,
                        ROWS: tl.constexpr):
    """Attention's output gate: o * sigmoid(gate), the sigmoid and the product each rounded to the model dtype;
    gate rows may be strided (q_proj's interleaved gate rows)."""
    rows, d, m = _rows(tl.program_id(0), R, ROWS, BLOCK_D, D)
    r64 = rows.to(tl.int64)
    dt = y_ptr.dtype.element_ty
    o = tl.load(o_ptr + r64[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + r64[:, None] * g_stride + d[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + r64[:, None] * D + d[None, :], (o * tl.sigmoid(g).to(dt).to(tl.float32)).to(dt), mask=m)


@triton.jit
def swiglu_kernel(g_ptr, u_ptr, y_ptr, R, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """The shared expert's silu(gate) * up, each rounded to the model dtype as torch's two ops."""
    rows, d, m = _rows(tl.program_id(0), R, ROWS, BLOCK_D, D)
    off = rows.to(tl.int64)[:, None] * D + d[None, :]
    dt = y_ptr.dtype.element_ty
    g = tl.load(g_ptr + off, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + off, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + off, ((g * tl.sigmoid(g)).to(dt).to(tl.float32) * u).to(dt), mask=m)


@triton.jit
def gated_residual_kernel(r_ptr, sg_ptr, s_ptr, y_ptr, R, D: tl.constexpr, BLOCK_D: tl.constexpr,
                          ROWS: tl.constexpr):
    """The MoE's output: routed + sigmoid(shared gate) * shared expert, one row scalar gate; the sigmoid, the
    product and the sum each rounded to the model dtype as torch's three ops."""
    rows, d, m = _rows(tl.program_id(0), R, ROWS, BLOCK_D, D)
    off = rows.to(tl.int64)[:, None] * D + d[None, :]
    dt = y_ptr.dtype.element_ty
    sg = tl.load(sg_ptr + rows, mask=rows < R, other=0.0).to(tl.float32)
    gate = tl.sigmoid(sg).to(dt).to(tl.float32)
    s = tl.load(s_ptr + off, mask=m, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + off, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + off, (r + (gate[:, None] * s).to(dt).to(tl.float32)).to(dt), mask=m)
