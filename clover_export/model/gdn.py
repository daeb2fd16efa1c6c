"""The GDN core: conv with state, gates, causal gated delta rule, then the block mixer (MODEL.md 4, 5.2).

`gdn_core` is the contract of the `clover::BlockGDN` op (STEP_GRAPH.md 2):
per batch row, C causal rows (the first `n_causal` valid) then N block rows.
Causal rows advance the slot's conv and recurrent state; block rows read the
state after them and write nothing. `gdn_core` is functional (new pools
out); `gdn_core_in_place` is the same op updating the rows' slots in place, as
the runtime runs it (STEP_GRAPH.md 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from clover_export.core import assumed
from clover_export.model.functional import l2_normalize, row_mask

CHUNK = 64  # rows per chunk of the chunked delta rule
FEW_ROWS = 4  # eager steps of at most this many causal rows: the conv as taps, the delta rule row by row


def causal_conv(m: torch.Tensor, state: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv: m [B, T, C], state [B, C, K-1] (rows before m), w [C, K] -> [B, T, C].

    Tap K-1 multiplies the current row; earlier taps read earlier rows.
    """
    if m.shape[1] == 0:
        return m
    x = torch.cat([state.transpose(1, 2).to(m.dtype), m], dim=1).transpose(1, 2)
    return F.conv1d(x, w.to(m.dtype).unsqueeze(1), groups=w.shape[0]).transpose(1, 2)


def depthwise_conv(x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """sum_j taps[c, j] x[:, t + j, c]: x [B, T + J - 1, C], taps [C, J] -> [B, T, C], in x's dtype.

    On the CPU as J multiply-adds of contiguous rows, 2-3x faster than the depthwise conv1d at every size
    measured (1 to 4096 rows, 256 to 8192 channels; the rounding may differ from conv1d's); elsewhere one
    conv1d."""
    J = taps.shape[1]
    T = x.shape[1] - J + 1
    if x.device.type != "cpu":
        return F.conv1d(x.transpose(1, 2), taps.to(x.dtype).unsqueeze(1), groups=taps.shape[0]).transpose(1, 2)
    rows = taps.to(x.dtype).t().contiguous()  # [J, C]
    out = x[:, :T] * rows[0]
    for j in range(1, J):
        out.addcmul_(x[:, j:j + T], rows[j])
    return out


def causal_conv_taps(m: torch.Tensor, state: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`causal_conv` as `depthwise_conv` (in fp32, as conv1d accumulates; the rounding may differ): the
    runtime's conv for a few rows."""
    x = torch.cat([state.transpose(1, 2).to(m.dtype), m], dim=1).float()  # [B, K-1+T, C]
    return depthwise_conv(x, w.float()).to(m.dtype)


def next_conv_state(m: torch.Tensor, state: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
    """The last K-1 valid pre-conv rows after `n_valid` rows of m: [B, C, K-1]."""
    history = torch.cat([state.to(m.dtype), m.transpose(1, 2)], dim=2)  # [B, C, K-1+T]
    km1 = state.shape[-1]
    idx = n_valid.long().unsqueeze(1) + torch.arange(km1, device=m.device)  # [B, K-1]
    return torch.gather(history, 2, idx.unsqueeze(1).expand(-1, history.shape[1], -1))


def split_heads(x: torch.Tensor, num_k_heads: int, dk: int, dv: int):
    """Conv output [B, T, 2*Hk*dk + Hv*dv] -> q, k [B, T, Hk, dk], v [B, T, Hv, dv]."""
    B, T, _ = x.shape
    kd = num_k_heads * dk
    q, k, v = torch.split(x, [kd, kd, x.shape[-1] - 2 * kd], dim=-1)
    return q.reshape(B, T, num_k_heads, dk), k.reshape(B, T, num_k_heads, dk), v.reshape(B, T, v.shape[-1] // dv, dv)


def delta_rule_chunked(q, k, v, beta, g, state, chunk: int = CHUNK):
    """Gated delta rule over T rows, in fp32 (MODEL.md 4).

    q, k [B, T, H, dk] (normalised; q already scaled), v [B, T, H, dv], beta, g
    [B, T, H], state [B, H, dk, dv]. Per row: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T;
    o = S^T q. Rows with beta = 0 and g = 0 leave S unchanged. Returns o [B, T, H, dv], S.
    """
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    q, k, v = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v))  # [B, H, T', d]
    beta, g = (F.pad(x.transpose(1, 2), (0, pad)) for x in (beta, g))  # [B, H, T']
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v))
    beta, g = beta.reshape(B, H, n, chunk), g.reshape(B, H, n, chunk)
    G = g.cumsum(-1)  # within each chunk
    incl = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(incl, (G.unsqueeze(-1) - G.unsqueeze(-2)).clamp(max=0), float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    # (I + A) u = beta v, with A_ts = beta_t k_t.k_s exp(G_t - G_s) for s < t (WY form)
    A = (k_beta @ k.transpose(-1, -2)) * decay
    A = A.masked_fill(~incl.tril(-1), 0) + torch.eye(chunk, device=q.device)
    u = torch.linalg.solve_triangular(A, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(A, k_beta * G.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    outs = []
    S = state
    for c in range(n):
        v_new = u[:, :, c] - w[:, :, c] @ S
        outs.append((q[:, :, c] * G[:, :, c].exp().unsqueeze(-1)) @ S + attn[:, :, c] @ v_new)
        g_last = G[:, :, c, -1:]
        S = (
            S * g_last.exp().unsqueeze(-1)
            + (k[:, :, c] * (g_last - G[:, :, c]).exp().unsqueeze(-1)).transpose(-1, -2) @ v_new
        )
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, chunk, dv)
    return o.reshape(B, H, -1, dv)[:, :, :T].transpose(1, 2), S


def delta_rule_one_chunk(q, k, v, beta, g, state):
    """`delta_rule_chunked` over T <= CHUNK rows as one chunk of exactly T rows: no padding rows, no chunk loop,
    both triangular systems in one solve (which reads only A's strict lower triangle: `unitriangular`). The
    eager path of a step of more than a few rows. Same arguments and results but `chunk`."""
    T, dv = k.shape[1], v.shape[-1]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, d]
    beta, G = beta.transpose(1, 2), g.transpose(1, 2).cumsum(-1)  # [B, H, T]
    incl = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(incl, (G.unsqueeze(-1) - G.unsqueeze(-2)).clamp(max=0), float("-inf")).exp()
    k_beta, G_exp = k * beta.unsqueeze(-1), G.exp().unsqueeze(-1)
    A = (k_beta @ k.transpose(-1, -2)) * decay  # (I + A) [u w] = [beta v, beta k exp(G)], as delta_rule_chunked
    u, w = torch.linalg.solve_triangular(A, torch.cat([v * beta.unsqueeze(-1), k_beta * G_exp], -1), upper=False,
                                         unitriangular=True).split([dv, k.shape[-1]], -1)
    v_new = u - w @ state
    o = (q * G_exp) @ state + ((q @ k.transpose(-1, -2)) * decay) @ v_new
    g_last = G[..., -1:]
    S = state * g_last.exp().unsqueeze(-1) + (k * (g_last - G).exp().unsqueeze(-1)).transpose(-1, -2) @ v_new
    return o.transpose(1, 2), S


def delta_rule_recurrent(q, k, v, beta, g, state):
    """`delta_rule_chunked` row by row (its per-row definition, as upstream's recurrent decode step): cheaper
    for a step of a few rows. Same arguments and results but `chunk`."""
    outs, S = [], state
    for t in range(k.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        k_t = k[:, t].unsqueeze(-1)  # [B, H, dk, 1]
        u = (v[:, t] - (S * k_t).sum(-2)) * beta[:, t].unsqueeze(-1)  # beta (v - S^T k)
        S = S + k_t * u.unsqueeze(-2)
        outs.append((S * q[:, t].unsqueeze(-1)).sum(-2))  # S^T q
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, S


def gdn_rows(mixed_qkv, a, b, conv_w, conv_w_right, A_log, dt_bias, block_scale, block_gate, conv0, s0, n_causal,
             num_k_heads: int, head_k_dim: int, head_v_dim: int, block_size: int, eager: bool = False):
    """The GDN core for the rows' own states conv0 [B, C_conv, K-1], s0 [B, Hv, dk, dv].

    eager (`gdn_core_in_place`, never traced): the step's causal row count picks the computation, the same
    up to rounding: for at most FEW_ROWS causal rows the conv as `depthwise_conv` and the delta rule row by
    row, else the reference conv and one chunk of exactly the causal rows up to CHUNK (not CHUNK rows of
    padding), else CHUNK-row chunks; the block's two convs as one `depthwise_conv` (`assumed.block_conv_taps`).
    (More causal rows keep conv1d: its sums are the functional model's to the bit, which the runtime's
    literal-reference tests compare block logits with at 2e-4.)

    Returns (o [B, T, Hv, dv] model dtype, conv state [B, C_conv, K-1], recurrent state [B, Hv, dk, dv] fp32)
    after the causal rows.
    """
    dtype = mixed_qkv.dtype
    T = mixed_qkv.shape[1]
    Tc, Hv = T - block_size, A_log.shape[0]
    rep = Hv // num_k_heads  # v-head j uses k-head floor(j * Hk / Hv)
    s0 = s0.float()
    beta = torch.sigmoid(b)  # model dtype, as upstream
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias)  # fp32

    def qkv(x, scale_q: bool):
        q, k, v = split_heads(x, num_k_heads, head_k_dim, head_v_dim)
        q, k = (l2_normalize(t.float()).repeat_interleave(rep, dim=2) for t in (q, k))
        return (q * head_k_dim**-0.5 if scale_q else q), k, v.float()

    # causal rows: upstream GDN from the slot's state; padding rows (beta = g = 0) change nothing
    m_c = mixed_qkv[:, :Tc]
    valid = row_mask(n_causal, Tc).unsqueeze(-1)
    few = eager and Tc <= FEW_ROWS
    x_c = F.silu((causal_conv_taps if few else causal_conv)(m_c, conv0, conv_w))
    q, k, v = qkv(x_c, scale_q=True)
    zero = torch.zeros((), device=g.device)
    beta_c, g_c = torch.where(valid, beta[:, :Tc].float(), zero), torch.where(valid, g[:, :Tc], zero)
    if few:
        o_c, s1 = delta_rule_recurrent(q, k, v, beta_c, g_c, s0)
    elif eager and Tc <= CHUNK:
        o_c, s1 = delta_rule_one_chunk(q, k, v, beta_c, g_c, s0)
    else:
        o_c, s1 = delta_rule_chunked(q, k, v, beta_c, g_c, s0)
    conv1 = next_conv_state(m_c, conv0, n_causal)

    # block rows: [assumed] bidirectional block mixer (MODEL.md 5.2), fp32, from the state after the causal rows
    o = o_c.to(dtype)
    if block_size > 0:
        m_b = mixed_qkv[:, Tc:].float()
        if eager:  # [prefix state, block rows, K-1 zero rows] through the two convs' one kernel
            tail = m_b.new_zeros(m_b.shape[0], conv_w.shape[1] - 1, m_b.shape[2])
            rows = torch.cat([conv1.float().transpose(1, 2), m_b, tail], dim=1)
            x_b = F.silu(depthwise_conv(rows, assumed.block_conv_taps(conv_w.float(), conv_w_right.float())))
        else:
            x_b = F.silu(
                causal_conv(m_b, conv1.float(), conv_w.float()) + assumed.anticausal_conv(m_b, conv_w_right.float())
            )
        q_b, k_b, v_b = qkv(x_b, scale_q=False)
        o_b = assumed.block_mixer(q_b, k_b, v_b, beta[:, Tc:].float(), g[:, Tc:], s1, block_scale, block_gate)
        o = torch.cat([o, o_b.to(dtype)], dim=1)
    return o, conv1, s1


def gdn_core(
    mixed_qkv: torch.Tensor,  # [B, T, C_conv] pre-conv projections, model dtype
    a: torch.Tensor,  # [B, T, Hv]  x W_a^T
    b: torch.Tensor,  # [B, T, Hv]  x W_b^T
    conv_w: torch.Tensor,  # [C_conv, K]
    conv_w_right: torch.Tensor,  # [C_conv, K]  [assumed]
    A_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    block_scale: torch.Tensor,  # [Hv]  [assumed]
    block_gate: torch.Tensor,  # [Hv]  [assumed]
    conv_pool: torch.Tensor,  # [S, C_conv, K-1] model dtype
    rec_pool: torch.Tensor,  # [S, Hv, dk, dv] fp32
    slot_ids: torch.Tensor,  # [B]
    n_causal: torch.Tensor,  # [B]
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    block_size: int,
):
    """Returns (o [B, T, Hv, dv] model dtype, new conv_pool, new rec_pool)."""
    slot_ids = slot_ids.long()
    o, conv1, s1 = gdn_rows(mixed_qkv, a, b, conv_w, conv_w_right, A_log, dt_bias, block_scale, block_gate,
                            conv_pool.index_select(0, slot_ids), rec_pool.index_select(0, slot_ids), n_causal,
                            num_k_heads, head_k_dim, head_v_dim, block_size)
    new_conv = conv_pool.index_copy(0, slot_ids, conv1.to(conv_pool.dtype))
    new_rec = rec_pool.index_copy(0, slot_ids, s1.to(rec_pool.dtype))
    return o, new_conv, new_rec


def gdn_core_in_place(mixed_qkv, a, b, conv_w, conv_w_right, A_log, dt_bias, block_scale, block_gate, conv_pool,
                      rec_pool, slot_ids, n_causal, num_k_heads: int, head_k_dim: int, head_v_dim: int,
                      block_size: int):
    """`gdn_core` updating the pools in place: reads and rewrites only the rows' slots' states
    (B x (C_conv x (K-1) + Hv x dk x dv) elements, nothing that grows with the context). The runtime's,
    never traced: `gdn_rows`' eager computation (a decode step of one row is one recurrent update, not a
    chunk of 64 rows of padding)."""
    slot_ids = slot_ids.long()
    o, conv1, s1 = gdn_rows(mixed_qkv, a, b, conv_w, conv_w_right, A_log, dt_bias, block_scale, block_gate,
                            conv_pool.index_select(0, slot_ids), rec_pool.index_select(0, slot_ids), n_causal,
                            num_k_heads, head_k_dim, head_v_dim, block_size, eager=True)
    conv_pool.index_copy_(0, slot_ids, conv1.to(conv_pool.dtype))
    rec_pool.index_copy_(0, slot_ids, s1.to(rec_pool.dtype))
    return o, conv_pool, rec_pool
