"""Standard-op ONNX bodies of the custom ops (STEP_GRAPH.md 2, 4).

Each body reproduces its plain-torch core (`contracts.*.reference`) in
float32 and casts outputs back to the input dtypes, so one FunctionProto
serves fp32 and bf16 graphs. Sizes come from input shapes at run time and
from the node's attributes (`ref_attr_name`), so T = 0 causal rows, any
batch, slot count and pool length work.

Where the torch core uses something ONNX lacks:
- `solve_triangular` of the chunked delta rule: (I + A)^-1 for A strictly
  lower-triangular 64 x 64 by a blocked triangular inverse (`unit_lower_inverse`;
  not the nilpotent product series, STEP_GRAPH.md 2); the chunk-to-chunk state
  recurrence is a `Scan`.
- depthwise convs: a window `Gather` (rows t .. t+K-1) times the taps,
  summed over the taps; the channel count is only known from the input
  shape, and Conv's `group` must be a literal.
- `index_copy` into the slot pools: `ScatterND` (slots are unique per step).
- the routed experts: a `Scan` over the experts, each on the rows routed to
  it (`expert_loop`), where the core loops over experts densely.
"""

from __future__ import annotations

import inspect

import numpy as np
import onnx

from clover_export.model.functional import l2_normalize
from clover_export.model.gdn import CHUNK
from clover_export.plugins.onnx_builder import F32, FunctionBuilder

L2_EPS = inspect.signature(l2_normalize).parameters["eps"].default
BIG = 2**62  # "to the end" for Slice


class Body(FunctionBuilder):
    """FunctionBuilder plus the few compound steps the three bodies share."""

    def scalar_dim(self, x: str, axis: int) -> str:
        return self.op("Squeeze", self.dim(x, axis), self.ints(0))

    def arange(self, n: str) -> str:
        """int64 [0, n) for a scalar n."""
        return self.op("Range", self.const(0), n, self.const(1))

    def rows(self, x: str, start: str | None, end: str | None, axis: int = 1) -> str:
        return self.slice(x, start or self.ints(0), end or self.ints(BIG), axis)

    def l2norm(self, x: str) -> str:
        ss = self.op("ReduceSum", self.op("Mul", x, x), self.ints(-1), keepdims=1)
        return self.op("Div", x, self.op("Sqrt", self.op("Add", ss, self.f32(L2_EPS))))

    def window_conv(self, hist: str, w_kc: str, n_rows: str, k: str) -> str:
        """out[:, t] = sum_j w[j] * hist[:, t + j], t < n_rows: hist [B, n+K-1, C], w_kc [K, C] -> [B, n, C]."""
        idx = self.op("Add", self.unsq(self.arange(n_rows), 1), self.unsq(self.arange(k), 0))  # [n, K]
        win = self.op("Gather", hist, idx, axis=1)  # [B, n, K, C]
        return self.sum(self.op("Mul", win, w_kc), 2)

    def heads(self, x: str, hk: str, dk: str, dv: str, hv: str, scale_q: bool):
        """[B, R, 2 Hk dk + Hv dv] -> q, k [B, R, Hv, dk] (L2-normalised, k-heads repeated), v [B, R, Hv, dv]."""
        kd = self.vec(self.op("Mul", hk, dk))
        kd2 = self.op("Add", kd, kd)
        zz = self.ints(0, 0)
        hk1, dk1, dv1, hv1 = (self.vec(s) for s in (hk, dk, dv, hv))
        q = self.op("Reshape", self.slice(x, self.ints(0), kd, 2), self.cat(zz, hk1, dk1))
        k = self.op("Reshape", self.slice(x, kd, kd2, 2), self.cat(zz, hk1, dk1))
        v = self.op("Reshape", self.slice(x, kd2, self.ints(BIG), 2), self.cat(zz, hv1, dv1))
        rep = self.vec(self.op("Div", hv, hk))
        out = []
        for t in (q, k):
            t = self.l2norm(t)
            t = self.op("Expand", self.unsq(t, 3), self.cat(self.op("Shape", t, start=0, end=3), rep, dk1))
            out.append(self.op("Reshape", t, self.cat(zz, hv1, dk1)))
        if scale_q:
            out[0] = self.op("Mul", out[0], self.op("Pow", self.op("Cast", dk, to=F32), self.f32(-0.5)))
        return out[0], out[1], v

    def scatter_slots(self, pool: str, slots: str, values: str) -> str:
        """pool with rows `slots` [B] replaced by values [B, ...] (index_copy)."""
        return self.op("ScatterND", pool, self.unsq(slots, 1), self.op("CastLike", values, pool))


# --- clover::BlockGDN ---------------------------------------------------------
def gdn_body() -> list[onnx.NodeProto]:
    b = Body("g")
    hk, dk, dv, nb = (b.attr_int(a) for a in ("num_k_heads", "head_k_dim", "head_v_dim", "block_size"))
    T = b.dim("mixed_qkv", 1)
    tc = b.op("Sub", T, b.vec(nb))  # 1-D [Tc]
    tc_s = b.op("Squeeze", tc, b.ints(0))
    hv = b.scalar_dim("A_log", 0)
    k_s = b.scalar_dim("conv_w", 1)
    km1 = b.op("Sub", k_s, b.const(1))
    slots = b.i64("slot_ids")
    nc = b.i64("n_causal")
    conv0 = b.op("Gather", "conv_pool", slots, axis=0)  # [B, C, K-1] pool dtype
    s0 = b.f(b.op("Gather", "rec_pool", slots, axis=0))  # [B, Hv, dk, dv]
    beta = b.op("Sigmoid", b.f("b"))  # [B, T, Hv]
    g = b.op("Mul", b.op("Neg", b.op("Exp", b.f("A_log"))),
             b.op("Softplus", b.op("Add", b.f("a"), b.f("dt_bias"))))
    w_kc = b.t(b.f("conv_w"), (1, 0))
    wr_kc = b.t(b.f("conv_w_right"), (1, 0))

    # causal rows: conv from the slot's state, then the chunked delta rule
    m_c_raw = b.rows("mixed_qkv", None, tc)
    m_c = b.f(m_c_raw)
    x_c = b.silu(b.window_conv(b.cat(b.t(b.f(conv0), (0, 2, 1)), m_c, axis=1), w_kc, tc_s, k_s))
    q, k, v = b.heads(x_c, hk, dk, dv, hv, scale_q=True)
    valid = b.op("Less", b.unsq(b.arange(tc_s), 0), b.unsq(nc, 1))  # [B, Tc]
    valid = b.unsq(valid, 2)
    zero = b.f32(0.0)
    beta_c = b.op("Where", valid, b.rows(beta, None, tc), zero)
    g_c = b.op("Where", valid, b.rows(g, None, tc), zero)
    o_c, s1 = delta_rule(b, q, k, v, beta_c, g_c, s0, tc_s)
    # conv state after the causal rows: the last K-1 valid pre-conv rows (pool dtype, bytes as given)
    hist = b.cat(conv0, b.t(m_c_raw, (0, 2, 1)), axis=2)  # [B, C, K-1+Tc]
    idx = b.op("Add", b.unsq(nc, 1), b.unsq(b.arange(km1), 0))  # [B, K-1]
    idx = b.op("Expand", b.unsq(idx, 1), b.op("Shape", conv0))
    conv1 = b.op("GatherElements", hist, idx, axis=2)

    # block rows: [assumed] block mixer from the state after the causal rows (MODEL.md 5.2)
    m_b = b.f(b.rows("mixed_qkv", tc, None))
    n_s = b.scalar_dim(m_b, 1)
    causal = b.window_conv(b.cat(b.t(b.f(conv1), (0, 2, 1)), m_b, axis=1), w_kc, n_s, k_s)
    pads = b.cat(b.ints(0, 0, 0, 0), b.vec(km1), b.ints(0))
    anti = b.window_conv(b.op("Pad", m_b, pads), wr_kc, n_s, k_s)
    x_b = b.silu(b.op("Add", causal, anti))
    qb, kb, vb = b.heads(x_b, hk, dk, dv, hv, scale_q=False)
    o_b = block_mixer(b, qb, kb, vb, b.rows(beta, tc, None), b.rows(g, tc, None), s1, dk)

    o = b.op("CastLike", b.cat(o_c, o_b, axis=1), "mixed_qkv")
    b.nodes.append(onnx.helper.make_node("Identity", [o], ["o"]))
    b.nodes.append(onnx.helper.make_node("Identity", [b.scatter_slots("conv_pool", slots, conv1)], ["conv_pool_out"]))
    b.nodes.append(onnx.helper.make_node("Identity", [b.scatter_slots("rec_pool", slots, s1)], ["rec_pool_out"]))
    return b.nodes


def delta_rule(b: Body, q, k, v, beta, g, s0, tc_s):
    """Chunked gated delta rule (gdn.delta_rule_chunked): q, k [B, Tc, H, dk], v [B, Tc, H, dv],
    beta, g [B, Tc, H], s0 [B, H, dk, dv] -> (o [B, Tc, H, dv], final state)."""
    c = b.const(CHUNK)
    # at least one chunk, so the Scan never runs zero times (padding rows: beta = g = 0 change nothing)
    n = b.op("Max", b.op("Div", b.op("Add", tc_s, b.const(CHUNK - 1)), c), b.const(1))
    pad = b.vec(b.op("Sub", b.op("Mul", n, c), tc_s))
    q, k, v = (b.op("Pad", b.t(x, (0, 2, 1, 3)), b.cat(b.ints(0, 0, 0, 0, 0, 0), pad, b.ints(0))) for x in (q, k, v))
    beta, g = (b.op("Pad", b.t(x, (0, 2, 1)), b.cat(b.ints(0, 0, 0, 0, 0), pad)) for x in (beta, g))
    n1 = b.vec(n)

    def chunks(x, d=True):  # [B, H, n*64(, d)] -> [B, H, n, 64(, d)]
        shape = b.cat(b.ints(0, 0), n1, b.ints(CHUNK), *( [b.dim(x, -1)] if d else []))
        return b.op("Reshape", x, shape)

    q, k, v = chunks(q), chunks(k), chunks(v)
    beta, g = chunks(beta, False), chunks(g, False)
    G = b.op("CumSum", g, b.const(3))  # inclusive, within each chunk
    incl = b.const(np.tril(np.ones((CHUNK, CHUNK), dtype=bool)), bool)
    strict = b.const(np.tril(np.ones((CHUNK, CHUNK), dtype=bool), -1), bool)
    diff = b.op("Sub", b.unsq(G, 4), b.unsq(G, 3))  # G_t - G_s
    decay = b.op("Where", incl, b.op("Exp", b.op("Min", diff, b.f32(0.0))), b.f32(0.0))
    k_beta = b.op("Mul", k, b.unsq(beta, 4))
    kT = b.t(k, (0, 1, 2, 4, 3))
    A = b.op("Where", strict, b.op("Mul", b.op("MatMul", k_beta, kT), decay), b.f32(0.0))
    inv = unit_lower_inverse(b, A, CHUNK)
    eg = b.op("Exp", G)
    u = b.op("MatMul", inv, b.op("Mul", v, b.unsq(beta, 4)))
    w = b.op("MatMul", inv, b.op("Mul", k_beta, b.unsq(eg, 4)))
    attn = b.op("Mul", b.op("MatMul", q, kT), decay)
    qg = b.op("Mul", q, b.unsq(eg, 4))
    g_last = b.slice(G, b.ints(CHUNK - 1), b.ints(CHUNK), 3)  # [B, H, n, 1]
    kd = b.op("Mul", k, b.unsq(b.op("Exp", b.op("Sub", g_last, G)), 4))
    gl = b.unsq(b.op("Exp", g_last), 4)  # [B, H, n, 1, 1]

    # Scan over chunks: S <- S e^{G_last} + kd^T (u - w S); o = qg S + attn (u - w S)
    s = Body("s")
    S, u_c, w_c, qg_c, at_c, kd_c, gl_c = "S_in", "u_c", "w_c", "qg_c", "at_c", "kd_c", "gl_c"
    v_new = s.op("Sub", u_c, s.op("MatMul", w_c, S))
    o_c = s.op("Add", s.op("MatMul", qg_c, S), s.op("MatMul", at_c, v_new))
    S_out = s.op("Add", s.op("Mul", S, gl_c), s.op("MatMul", s.t(kd_c, (0, 1, 3, 2)), v_new))
    s.nodes.append(onnx.helper.make_node("Identity", [S_out], ["S_out"]))
    s.nodes.append(onnx.helper.make_node("Identity", [o_c], ["o_out"]))
    body = s.graph("chunk_step", dict.fromkeys([S, u_c, w_c, qg_c, at_c, kd_c, gl_c], 4), {"S_out": 4, "o_out": 4})
    # chunk axis first (onnx.reference's Scan only scans axis 0)
    xs = [b.t(x, (2, 0, 1, 3, 4)) for x in (u, w, qg, attn, kd, gl)]
    S_fin, o = b.op("Scan", s0, *xs, outputs=2, body=body, num_scan_inputs=6)
    o = b.t(o, (1, 2, 0, 3, 4))  # [n, B, H, 64, dv] -> [B, H, n, 64, dv] -> [B, Tc, H, dv]
    o = b.op("Reshape", o, b.cat(b.ints(0, 0, -1), b.dim(o, -1)))
    o = b.t(b.rows(o, None, b.vec(tc_s), axis=2), (0, 2, 1, 3))
    return o, S_fin


def unit_lower_inverse(b: Body, A: str, n: int) -> str:
    """(I + A)^-1 for A [B, H, c, n, n] strictly lower-triangular, n a power of two.

    Blocked triangular inverse (STEP_GRAPH.md 2, the scheme of flash-linear-attention's
    `solve_tril`), doubling the block size from 1: the inverse of [[L11, 0], [A21, L22]] is
    [[X11, 0], [-X22 A21 X11, X22]] with X = L^-1. Every factor stays bounded (|A_ts| <= 1),
    so fp32 loses no more than substitution; the product series (I - A)(I + A^2)... instead
    builds A^32 and cancels catastrophically once keys agree and decay is slow.
    """
    X = b.const(np.ones((1, 1, 1, n, 1, 1), dtype=np.float32), np.float32)  # n diagonal 1x1 blocks
    X = b.op("Expand", X, b.cat(b.op("Shape", A, start=0, end=3), b.ints(n, 1, 1)))
    s = 1
    while s < n:
        m = n // (2 * s)  # blocks of size 2s
        # the m diagonal 2s x 2s blocks of A: [B, H, c, m, 2s, m, 2s] masked to equal block indices, summed
        a7 = b.op("Reshape", A, b.ints(0, 0, 0, m, 2 * s, m, 2 * s))
        same = b.const(np.eye(m, dtype=np.float32).reshape(m, 1, m, 1), np.float32)
        diag = b.sum(b.op("Mul", a7, same), 5)  # [B, H, c, m, 2s, 2s]
        a21 = b.slice(b.slice(diag, b.ints(s), b.ints(2 * s), 4), b.ints(0), b.ints(s), 5)
        pairs = b.op("Reshape", X, b.ints(0, 0, 0, m, 2, s, s))
        x11, x22 = (b.op("Squeeze", b.slice(pairs, b.ints(i), b.ints(i + 1), 4), b.ints(4)) for i in (0, 1))
        x21 = b.op("Neg", b.op("MatMul", b.op("MatMul", x22, a21), x11))
        zeros = b.op("ConstantOfShape", b.op("Shape", x11))
        X = b.cat(b.cat(x11, zeros, axis=5), b.cat(x21, x22, axis=5), axis=4)  # [B, H, c, m, 2s, 2s]
        s *= 2
    return b.op("Reshape", X, b.ints(0, 0, 0, n, n))


def block_mixer(b: Body, q, k, v, beta, g, s0, dk):
    """assumed.block_mixer: q, k [B, N, Hv, dk] (unscaled), v [B, N, Hv, dv], beta, g [B, N, Hv]."""
    G = b.op("CumSum", g, b.const(1))
    decay = b.unsq(b.op("Exp", G), 3)  # [B, N, Hv, 1]
    qs = b.op("Mul", q, b.op("Pow", b.op("Cast", dk, to=F32), b.f32(-0.5)))
    qt, kt = b.t(qs, (0, 2, 1, 3)), b.t(k, (0, 2, 1, 3))  # [B, Hv, N, dk]
    o_pre = b.op("Mul", decay, b.t(b.op("MatMul", qt, s0), (0, 2, 1, 3)))
    v_innov = b.op("Sub", v, b.op("Mul", decay, b.t(b.op("MatMul", kt, s0), (0, 2, 1, 3))))
    scale = b.op("Reshape", b.f("block_scale"), b.ints(1, -1, 1, 1))
    scores = b.op("Mul", b.op("MatMul", b.t(q, (0, 2, 1, 3)), b.t(k, (0, 2, 3, 1))), scale)
    attn = b.op("Softmax", scores, axis=-1)  # [B, Hv, N, N]
    bv = b.t(b.op("Mul", b.unsq(beta, 3), v_innov), (0, 2, 1, 3))  # [B, Hv, N, dv]
    o_blk = b.t(b.op("MatMul", attn, bv), (0, 2, 1, 3))
    gate = b.op("Reshape", b.op("Sigmoid", b.f("block_gate")), b.ints(1, 1, -1, 1))
    return b.op("Add", o_pre, b.op("Mul", gate, o_blk))


# --- clover::BlockAttention -----------------------------------------------------
def attention_body() -> list[onnx.NodeProto]:
    b = Body("a")
    nb = b.attr_int("block_size")
    scale = b.attr_float("scale")
    T = b.dim("q", 1)
    tc = b.op("Sub", T, b.vec(nb))
    tc_s = b.op("Squeeze", tc, b.ints(0))
    slots, past, nc = b.i64("slot_ids"), b.i64("past_len"), b.i64("n_causal")
    q, k, v = b.f("q"), b.f("k"), b.f("v")
    pools = {}
    for name, new in (("key_pool", k), ("value_pool", v)):
        pools[name] = write_causal_rows(b, name, b.rows(new, None, tc), slots, past, nc, tc_s)
    L = b.scalar_dim("key_pool", 2)
    kb, vb = (b.t(b.rows(x, tc, None), (0, 2, 1, 3)) for x in (k, v))  # [B, Hkv, N, hd]
    keys = b.cat(b.f(pools["key_pool"]), kb, axis=2)  # [B, Hkv, L+N, hd]
    vals = b.cat(b.f(pools["value_pool"]), vb, axis=2)
    # visibility (attention.attention_core): causal row j sees p < past+j+1, block rows p < past+n_causal and the block
    rows = b.arange(b.op("Squeeze", T, b.ints(0)))
    is_causal = b.op("Less", rows, tc_s)  # [T]
    limit = b.op("Where", b.unsq(is_causal, 0),
                 b.op("Add", b.unsq(past, 1), b.op("Add", b.unsq(rows, 0), b.const(1))),
                 b.unsq(b.op("Add", past, nc), 1))  # [B, T]
    see_slot = b.op("Less", b.unsq(b.arange(L), 0, 1), b.unsq(limit, 2))  # [B, T, L]
    n_rows = b.vec(nb)
    see_block = b.op("Expand", b.unsq(b.op("Not", is_causal), 0, 2), b.cat(b.dim("q", 0), T, n_rows))
    allowed = b.unsq(b.cat(see_slot, see_block, axis=2), 1, 2)  # [B, 1, 1, T, L+N]
    # GQA: q [B, T, H, hd] -> [B, Hkv, rep, T, hd] against keys [B, Hkv, 1, L+N, hd]
    hkv = b.dim("k", 2)
    rep = b.op("Div", b.dim("q", 2), hkv)
    qg = b.op("Reshape", b.t(q, (0, 2, 1, 3)), b.cat(b.ints(0), hkv, rep, b.ints(-1), b.dim("q", 3)))
    scores = b.op("Mul", b.op("MatMul", qg, b.t(b.unsq(keys, 2), (0, 1, 2, 4, 3))), scale)
    scores = b.op("Where", allowed, scores, b.f32(-np.inf))
    probs = b.op("Softmax", scores, axis=-1)
    o = b.op("MatMul", probs, b.unsq(vals, 2))  # [B, Hkv, rep, T, hd]
    o = b.t(b.op("Reshape", o, b.cat(b.ints(0), b.dim("q", 2), b.ints(-1), b.dim("q", 3))), (0, 2, 1, 3))
    b.nodes.append(onnx.helper.make_node("CastLike", [o, "q"], ["o"]))
    for name in ("key_pool", "value_pool"):
        b.nodes.append(onnx.helper.make_node("Identity", [b.scatter_slots(name, slots, pools[name])], [name + "_out"]))
    return b.nodes


def write_causal_rows(b: Body, pool: str, new, slots, past, nc, tc_s):
    """attention.write_causal_rows: the batch rows' slots [B, Hkv, L, hd] with new [B, Tc, Hkv, hd] written
    at past_len + j (j < n_causal). A zero row is appended to `new` so Tc = 0 needs no special case."""
    slot_rows = b.op("Gather", pool, slots, axis=0)
    L = b.scalar_dim(pool, 2)
    rel = b.op("Sub", b.unsq(b.arange(L), 0), b.unsq(past, 1))  # [B, L]
    write = b.op("And", b.op("GreaterOrEqual", rel, b.const(0)), b.op("Less", rel, b.unsq(nc, 1)))
    zero_row = b.op("Expand", b.f32(0.0), b.cat(b.dim(new, 0), b.ints(1), b.op("Shape", new, start=2)))
    padded = b.cat(new, zero_row, axis=1)  # [B, Tc+1, Hkv, hd]
    src = b.op("Min", b.op("Max", rel, b.const(0)), tc_s)  # row Tc is the zero row (Clip: no int64 on TensorRT)
    gathered = b.t(b.op("GatherND", padded, b.unsq(src, 2), batch_dims=1), (0, 2, 1, 3))  # [B, Hkv, L, hd]
    return b.op("Where", b.unsq(write, 1, 3), b.op("CastLike", gathered, slot_rows), slot_rows)


# --- clover::CoresetMoE ---------------------------------------------------------
def moe_body(inputs=("gate_up", "down"), expert=None) -> list[onnx.NodeProto]:
    """moe.moe_core over the expert tensors `inputs`; `expert` makes one expert's fp32 (gate_up, down) from its
    slices of them (expert_loop)."""
    expert = expert or _expert_weights
    b = Body("m")
    top_k, top_p, coreset, nb = (
        b.attr_int("top_k"),
        b.attr_float("top_p"),
        b.attr_int("coreset"),
        b.attr_int("block_size"),
    )
    x = b.f("x")
    T = b.dim("x", 1)
    tc = b.op("Sub", T, b.vec(nb))
    E = b.dim("router_w", 0)
    logits = b.op("MatMul", b.op("CastLike", "x", "router_w"), b.t("router_w", (1, 0)))
    probs = b.op("Softmax", b.f(logits), axis=-1)  # [B, T, E]
    k1 = b.vec(top_k)
    # block coreset (assumed.coreset_mask) over the block rows
    pb = b.rows(probs, tc, None)  # [B, N, E]
    top_v, top_i = b.op("TopK", pb, k1, axis=-1, largest=1, sorted=1, outputs=2)
    dense = b.op("ScatterElements", b.op("Mul", pb, b.f32(0.0)), top_i, top_v, axis=2)
    agg = b.sum(dense, 1)  # [B, E]
    sorted_agg, order = b.op("TopK", agg, E, axis=-1, largest=1, sorted=1, outputs=2)  # ties: lower id first
    # the boundary rule of assumed.coreset_mask: fp32 CumSum adds one element at a time (ORT), target = top_p * total
    cum = b.op("CumSum", sorted_agg, b.const(1))
    before = b.op("CumSum", sorted_agg, b.const(1), exclusive=1)
    target = b.op("Mul", top_p, b.slice(cum, b.ints(-1), b.ints(BIG), 1))
    first = b.op("Equal", b.arange(b.op("Squeeze", E, b.ints(0))), b.const(0))
    keep_sorted = b.op("Or", b.op("Less", before, target), b.unsq(first, 0))
    # top_p >= 1: every expert some position chose stays (fp32 sums may absorb tiny masses)
    all_chosen = b.op("And", b.op("GreaterOrEqual", top_p, b.f32(1.0)), b.op("Greater", sorted_agg, b.f32(0.0)))
    keep_sorted = b.op("Or", keep_sorted, all_chosen)
    keep = b.op("ScatterElements", b.op("Mul", agg, b.f32(0.0)), order, b.op("Cast", keep_sorted, to=F32), axis=1)
    use_coreset = b.op("Greater", coreset, b.const(0))
    keep = b.op("Or", b.op("Not", use_coreset), b.op("Greater", keep, b.f32(0.5)))  # [B, E] bool
    # allowed experts per row: all for causal rows, the coreset for block rows
    is_block = b.op("GreaterOrEqual", b.arange(b.op("Squeeze", T, b.ints(0))), b.op("Squeeze", tc, b.ints(0)))
    allowed = b.op("Or", b.op("Not", b.unsq(is_block, 0, 2)), b.unsq(keep, 1))  # [B, T, E]
    masked = b.op("Where", allowed, probs, b.f32(-1.0))
    vals, idx = b.op("TopK", masked, k1, axis=-1, largest=1, sorted=1, outputs=2)
    ok = b.op("GreaterOrEqual", vals, b.f32(0.0))
    vals = b.op("Where", ok, vals, b.f32(0.0))
    vals = b.op("Div", vals, b.sum(vals, -1, keepdims=1))
    zeros = b.op("Mul", probs, b.f32(0.0))
    weights = b.op("ScatterElements", zeros, idx, vals, axis=2)  # [B, T, E]
    chosen = b.op("ScatterElements", zeros, idx, b.op("Cast", ok, to=F32), axis=2)
    weights = b.f(b.op("CastLike", weights, "x"))  # routing weights in the hidden dtype (MODEL.md 4)
    # experts: a Loop over E, each expert on its routed rows only (expert_loop)
    routed = b.op("Reshape", expert_loop(b, list(inputs), expert, x, weights, chosen, E), b.op("Shape", "x"))
    b.nodes.append(onnx.helper.make_node("CastLike", [routed, "x"], ["routed"]))
    block_chosen = b.op("ReduceMax", b.rows(chosen, tc, None), b.ints(1), keepdims=0)  # [B, E]
    b.nodes.append(onnx.helper.make_node("Cast", [b.sum(block_chosen, 1)], ["coreset_size"], to=onnx.TensorProto.INT32))
    return b.nodes


def _expert_weights(s: Body, w: dict[str, str]) -> tuple[str, str]:
    """One expert's (gate_up [2I, D], down [D, I]) in fp32 from its slices of the CoresetMoE inputs."""
    return s.f(w["gate_up"]), s.f(w["down"])


def expert_loop(b: Body, inputs: list[str], expert, x: str, weights: str, chosen: str, E: str) -> str:
    """sum_e w[:, e] * FFN_e(x) over the rows that chose expert e: [B*T, D] fp32 (x fp32 [B, T, D]).

    A Scan over the experts (not one [E, B*T, D] product): each iteration
    gets ONE expert's slices of `inputs` (any dtype: the Scan body's weight
    inputs are untyped, and opset 20's Gather takes no float8), makes them
    fp32 with `expert(body, {input: slice})`, runs them on the rows that
    chose the expert and scatter-adds the result. ONNX Runtime so holds one
    expert in fp32 at a time and does only the routed work: the dense form
    held fp32 copies and transposes of every expert (2 GiB each at full size)
    and did E / top_k times the arithmetic. A row that did not choose e has
    weight 0 for it, so the sum is the dense one.
    """
    xf = b.op("Reshape", x, b.cat(b.ints(-1), b.dim("x", 2)))  # [BT, D]
    wT, cT = (b.t(b.op("Reshape", t, b.cat(b.ints(-1), E)), (1, 0)) for t in (weights, chosen))  # [E, BT]
    s = Body("e")
    rows = s.t(s.op("NonZero", s.op("Greater", "c_e", s.f32(0.5))), (1, 0))  # [n, 1]
    xe = s.op("GatherND", xf, rows)  # [n, D]
    we = s.unsq(s.op("GatherND", "w_e", rows), 1)  # [n, 1]
    gate_up, down = expert(s, {n: f"{n}_e" for n in inputs})
    gate, up = s.op("Split", s.op("Gemm", xe, gate_up, transB=1), num_outputs=2, axis=1, outputs=2)  # [n, I] x2
    y = s.op("Gemm", s.op("Mul", s.silu(gate), up), down, transB=1)  # [n, D]
    s.nodes.append(onnx.helper.make_node("ScatterND", ["acc_in", rows, s.op("Mul", y, we)], ["acc_out"],
                                         reduction="add"))
    info = onnx.helper.make_tensor_value_info
    untyped = [onnx.ValueInfoProto(name=f"{n}_e") for n in inputs]  # dtype from the call site
    body = onnx.helper.make_graph(
        s.nodes, "expert_step",
        [info("acc_in", F32, [None, None]), info("c_e", F32, [None]), info("w_e", F32, [None]), *untyped],
        [info("acc_out", F32, [None, None])])
    return b.op("Scan", b.op("Mul", xf, b.f32(0.0)), cT, wT, *inputs, body=body, num_scan_inputs=2 + len(inputs))


# --- clover::CoresetMoEFP8 ------------------------------------------------------
def moe_fp8_body() -> list[onnx.NodeProto]:
    """moe.moe_core_fp8: W = Cast(fp8, float) * scale[..., None], rounded to x's dtype, then the CoresetMoE body
    (self-contained: no nested function call, so the function runs wherever it is attached); dequantized one
    expert at a time inside the expert Scan."""

    def expert(s: Body, w: dict[str, str]) -> tuple[str, str]:
        def deq(name: str) -> str:
            return s.f(s.op("CastLike", s.op("Mul", s.f(w[f"{name}_fp8"]), s.unsq(w[f"{name}_scale"], -1)), "x"))

        return deq("gate_up"), deq("down")

    return moe_body(("gate_up_fp8", "gate_up_scale", "down_fp8", "down_scale"), expert)


BODIES = {"BlockGDN": gdn_body, "BlockAttention": attention_body, "CoresetMoE": moe_body,
          "CoresetMoEFP8": moe_fp8_body}
