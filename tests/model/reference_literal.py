"""A slow, literal reference of one Clover step, written formula by formula (MODEL.md 4, 5.2, 5.3).

Independent of the package on purpose: only torch, no import of
`clover_export`. It runs in float64 by default (fp32 on request), one batch
row, one token and one head at a time, with the conv taps, the delta rule and the coreset written
as explicit loops. Tests compare `CloverModel.forward` against `literal_step`.

Weights are read from a canonical state dict (`model.layers.{i}....`); the
config is any object with the CloverConfig attribute names. Pools are the
flat list `CloverModel.forward` takes: per layer (conv_state, recurrent_state)
for a GDN layer, (key, value) for an attention layer.

Numeric conventions the spec leaves to the implementation:
- coreset: A_e is a plain fp32 running sum, position by position; the
  sorted prefix sums are the running sum kept in float64 and rounded to fp32
  at each step (what torch's CPU cumsum does for fp32; the spec's "fp32
  cumulative sum" leaves the accumulator open, and plain fp32 accumulation
  decides differently when the target lands exactly on a prefix sum); the
  total `sum_e A_e` is the last prefix sum; top_p >= 1.0 keeps every expert
  with A_e > 0 (MODEL.md 5.3: routing then equals plain top-k);
- softplus is `log(1 + exp(x))` (inputs here are small).
"""

from __future__ import annotations

import torch

F32 = torch.float32


# --- small formulas -------------------------------------------------------------
def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * sigmoid(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.log(1.0 + torch.exp(x))


def softmax(x: torch.Tensor) -> torch.Tensor:
    e = torch.exp(x - x.max())
    return e / e.sum()


def rms_norm_one_plus(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * (1 + w) over the last dim."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (1.0 + w)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + 1e-6)."""
    return x / torch.sqrt((x * x).sum() + 1e-6)


def matvec(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[out, in] weight times a vector."""
    return w @ x


def rope(x: torch.Tensor, position: int, rot: int, theta: float) -> torch.Tensor:
    """NeoX rotate-half on the first `rot` dims of one head vector: dim i pairs with i + rot/2."""
    out = x.clone()
    half = rot // 2
    for i in range(half):
        inv_freq = torch.tensor(1.0 / theta ** (2 * i / rot), dtype=x.dtype)
        angle = torch.tensor(float(position), dtype=x.dtype) * inv_freq
        c, s = torch.cos(angle), torch.sin(angle)
        a, b = x[i], x[i + half]
        out[i] = a * c - b * s
        out[i + half] = b * c + a * s
    return out


def order_desc(values: list[float]) -> list[int]:
    """Indices sorted by value descending, ties by lower index (explicit sort key)."""
    return sorted(range(len(values)), key=lambda e: (-values[e], e))


# --- MoE and coreset (MODEL.md 4, 5.3) -------------------------------------------
def router_probs(x: torch.Tensor, w_router: torch.Tensor) -> torch.Tensor:
    """Router softmax in fp32 (MODEL.md 4), whatever the compute dtype."""
    return softmax(matvec(w_router, x).to(F32))


def top_k_experts(p: torch.Tensor, k: int, allowed: set[int] | None = None) -> list[int]:
    """Top-min(k, |allowed|) experts by p (ties: lower id first)."""
    vals = p.tolist()
    ranked = [e for e in order_desc(vals) if allowed is None or e in allowed]
    return ranked[:k]


def aggregate(probs: list[torch.Tensor], k: int) -> list[torch.Tensor]:
    """A_e = sum_t sum_{e in K_t} p_t,e (un-renormalised), fp32, position by position."""
    A = [torch.zeros((), dtype=F32) for _ in range(probs[0].shape[0])]
    for p in probs:
        for e in top_k_experts(p, k):
            A[e] = A[e] + p[e].to(F32)
    return A


def coreset(probs: list[torch.Tensor], k: int, top_p: float) -> list[int]:
    """Kept experts of one block (one batch row), in the sorted order; probs: one [E] tensor per position."""
    A = aggregate(probs, k)
    order = order_desc([float(a) for a in A])
    if top_p >= 1.0:  # "with top_p = 1.0 routing equals plain top-k": every expert some position chose
        return [e for e in order if float(A[e]) > 0] or order[:1]
    prefix = []  # fp32 prefix sums in the sorted order, one fp32 rounding per addition (assumed.coreset_mask)
    running = torch.zeros((), dtype=F32)
    for e in order:
        running = running + A[e].to(F32)
        prefix.append(running)
    target = torch.tensor(top_p, dtype=F32) * prefix[-1]  # sum_e A_e: the same sum, in the same order
    kept: list[int] = []
    for r, e in enumerate(order):
        if kept and not bool(prefix[r - 1] < target):
            break  # the prefix before e already reaches the target
        kept.append(e)
    return kept


def expert(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    inter = w_gate_up.shape[0] // 2
    g = matvec(w_gate_up[:inter], x)
    u = matvec(w_gate_up[inter:], x)
    return matvec(w_down, silu(g) * u)


def moe_row(x: torch.Tensor, P: dict, L: str, experts: list[int], p: torch.Tensor) -> torch.Tensor:
    """Routed experts with renormalised weights plus the gated shared expert, for one row."""
    M = L + "mlp."
    mass = torch.zeros((), dtype=p.dtype)
    for e in experts:
        mass = mass + p[e]
    out = torch.zeros_like(x)
    for e in experts:
        w = p[e] / mass
        out = out + w * expert(x, P[M + "experts.gate_up_proj"][e], P[M + "experts.down_proj"][e])
    sh_gate = matvec(P[M + "shared_expert.gate_proj.weight"], x)
    sh_up = matvec(P[M + "shared_expert.up_proj.weight"], x)
    shared = matvec(P[M + "shared_expert.down_proj.weight"], silu(sh_gate) * sh_up)
    return out + sigmoid(matvec(P[M + "shared_expert_gate.weight"], x)) * shared


# --- GDN (MODEL.md 4, 5.2) ----------------------------------------------------------
class GdnRow:
    """One batch row's GDN layer: its conv history and recurrent state, advanced token by token."""

    def __init__(self, cfg, P: dict, L: str, conv_state: torch.Tensor, rec_state: torch.Tensor):
        A = L + "linear_attn."
        self.P, self.A = P, A
        self.Hk, self.Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.K = cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        self.w_conv = P[A + "conv1d.weight"][:, 0, :]  # [C, K]
        self.w_right = P[A + "conv1d_right.weight"][:, 0, :]
        # history of pre-conv rows, oldest first: the K-1 cached columns
        self.history = [conv_state[:, j].clone() for j in range(self.K - 1)]
        self.S = [rec_state[h].clone() for h in range(self.Hv)]  # each [dk, dv]

    def project(self, x):
        P, A = self.P, self.A
        m = matvec(P[A + "in_proj_qkv.weight"], x)
        z = matvec(P[A + "in_proj_z.weight"], x)
        beta = sigmoid(matvec(P[A + "in_proj_b.weight"], x))
        g = -torch.exp(P[A + "A_log"]) * softplus(matvec(P[A + "in_proj_a.weight"], x) + P[A + "dt_bias"])
        return m, z, beta, g

    def split(self, c: torch.Tensor, h: int):
        """q, k of the k-head serving v-head h, and v of v-head h, from the conv output c."""
        kd = self.Hk * self.dk
        kh = (h * self.Hk) // self.Hv
        q = c[kh * self.dk:(kh + 1) * self.dk]
        k = c[kd + kh * self.dk: kd + (kh + 1) * self.dk]
        v = c[2 * kd + h * self.dv: 2 * kd + (h + 1) * self.dv]
        return q, k, v

    def causal_conv(self, window: list[torch.Tensor]) -> torch.Tensor:
        """sum_j w[c, j] * window[j][c]; window holds K rows, the last one the current token."""
        total = torch.zeros_like(window[-1])
        for j in range(self.K):
            total = total + self.w_conv[:, j] * window[j]
        return total

    def out(self, o_heads: list[torch.Tensor], z: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm per head (plain weight), then out_proj."""
        w = self.P[self.A + "norm.weight"]
        parts = []
        for h, o in enumerate(o_heads):
            zh = z[h * self.dv:(h + 1) * self.dv]
            parts.append(o / torch.sqrt((o * o).mean() + self.eps) * w * silu(zh))
        return matvec(self.P[self.A + "out_proj.weight"], torch.cat(parts))

    def causal_token(self, x: torch.Tensor) -> torch.Tensor:
        m, z, beta, g = self.project(x)
        c = silu(self.causal_conv(self.history[len(self.history) - (self.K - 1):] + [m]))
        self.history.append(m)
        o_heads = []
        for h in range(self.Hv):
            q, k, v = self.split(c, h)
            q = l2_normalize(q) * self.dk**-0.5
            k = l2_normalize(k)
            S = torch.exp(g[h]) * self.S[h]
            S = S + torch.outer(k, beta[h] * (v - S.T @ k))
            self.S[h] = S
            o_heads.append(S.T @ q)
        return self.out(o_heads, z)

    def conv_state(self) -> torch.Tensor:
        return torch.stack(self.history[len(self.history) - (self.K - 1):], dim=1)  # [C, K-1]

    def block(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The block mixer over all block rows (reads the state, writes nothing)."""
        N = len(xs)
        proj = [self.project(x) for x in xs]
        ms = [p[0] for p in proj]
        prefix = self.history[len(self.history) - (self.K - 1):]
        convs = []
        for t in range(N):
            window = (prefix + ms)[t: t + self.K]  # K-1 rows before t, then t
            right = torch.zeros_like(ms[t])
            for j in range(self.K):  # anti-causal taps, zero beyond the block end
                if t + j < N:
                    right = right + self.w_right[:, j] * ms[t + j]
            convs.append(silu(self.causal_conv(window) + right))
        o_all = [[None] * self.Hv for _ in range(N)]
        for h in range(self.Hv):
            S0 = self.S[h]
            qs, ks, vs, betas, gs = [], [], [], [], []
            for t in range(N):
                q, k, v = self.split(convs[t], h)
                qs.append(l2_normalize(q))
                ks.append(l2_normalize(k))
                vs.append(v)
                betas.append(proj[t][2][h])
                gs.append(proj[t][3][h])
            G = []
            acc = torch.zeros((), dtype=gs[0].dtype)
            for t in range(N):
                acc = acc + gs[t]
                G.append(acc)
            v_innov = [vs[s] - torch.exp(G[s]) * (S0.T @ ks[s]) for s in range(N)]
            scale = self.P[self.A + "block_softmax_scale"][h]
            gate = sigmoid(self.P[self.A + "block_softmax_gate"][h])
            for t in range(N):
                o_pre = torch.exp(G[t]) * (S0.T @ (qs[t] * self.dk**-0.5))
                scores = torch.stack([scale * torch.dot(qs[t], ks[s]) for s in range(N)])
                A = softmax(scores)
                o_blk = torch.zeros(self.dv, dtype=S0.dtype)
                for s in range(N):
                    o_blk = o_blk + A[s] * betas[s] * v_innov[s]
                o_all[t][h] = o_pre + gate * o_blk
        return [self.out(o_all[t], proj[t][1]) for t in range(N)]


# --- attention (MODEL.md 4, 5.1) -------------------------------------------------------
class AttentionRow:
    """One batch row's attention layer over its slot's K/V cache."""

    def __init__(self, cfg, P: dict, L: str, key: torch.Tensor, value: torch.Tensor, past_len: int):
        self.P, self.S = P, L + "self_attn."
        self.H, self.Hkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rot = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.theta, self.eps = cfg.rope_theta, cfg.rms_norm_eps
        self.key, self.value = key.clone(), value.clone()  # [Hkv, L, hd]
        self.length = past_len

    def qkv(self, x: torch.Tensor, position: int):
        P, S, hd = self.P, self.S, self.hd
        qg = matvec(P[S + "q_proj.weight"], x)
        kk = matvec(P[S + "k_proj.weight"], x)
        vv = matvec(P[S + "v_proj.weight"], x)
        qs, gates = [], []
        for h in range(self.H):
            q = qg[h * 2 * hd: h * 2 * hd + hd]
            gates.append(qg[h * 2 * hd + hd: (h + 1) * 2 * hd])
            qs.append(rope(rms_norm_one_plus(q, P[S + "q_norm.weight"], self.eps), position, self.rot, self.theta))
        ks = [
            rope(
                rms_norm_one_plus(kk[j * hd : (j + 1) * hd], P[S + "k_norm.weight"], self.eps),
                position,
                self.rot,
                self.theta,
            )
            for j in range(self.Hkv)
        ]
        vs = [vv[j * hd:(j + 1) * hd] for j in range(self.Hkv)]
        return qs, gates, ks, vs

    def attend(self, qs, gates, keys_of, vals_of) -> torch.Tensor:
        """keys_of(j), vals_of(j): [n, hd] visible keys/values of kv-head j."""
        outs = []
        for h in range(self.H):
            j = (h * self.Hkv) // self.H
            keys, vals = keys_of(j), vals_of(j)
            probs = softmax(torch.stack([torch.dot(qs[h], keys[i]) for i in range(keys.shape[0])]) * self.hd**-0.5)
            o = torch.zeros(self.hd, dtype=vals.dtype)
            for i in range(keys.shape[0]):
                o = o + probs[i] * vals[i]
            outs.append(o * sigmoid(gates[h]))
        return matvec(self.P[self.S + "o_proj.weight"], torch.cat(outs))

    def causal_token(self, x: torch.Tensor) -> torch.Tensor:
        pos = self.length
        qs, gates, ks, vs = self.qkv(x, pos)
        for j in range(self.Hkv):
            self.key[j, pos] = ks[j]
            self.value[j, pos] = vs[j]
        self.length += 1
        n = self.length
        return self.attend(qs, gates, lambda j: self.key[j, :n], lambda j: self.value[j, :n])

    def block(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        n = self.length
        per = [self.qkv(x, n + i) for i, x in enumerate(xs)]
        bk = [torch.stack([p[2][j] for p in per]) for j in range(self.Hkv)]
        bv = [torch.stack([p[3][j] for p in per]) for j in range(self.Hkv)]
        return [
            self.attend(
                qs,
                gates,
                lambda j: torch.cat([self.key[j, :n], bk[j]]),
                lambda j: torch.cat([self.value[j, :n], bv[j]]),
            )
            for qs, gates, _, _ in per
        ]


# --- one step ---------------------------------------------------------------------------
@torch.no_grad()
def literal_step(cfg, P: dict, block_size: int, input_ids, n_causal, has_block, slot_ids, past_len, pools: list,
                 dtype: torch.dtype = torch.float64):
    """Returns (block logits [B, N, V] fp32, coreset sizes [B, layers] int32, new pools list).

    Computes in `dtype` (float64 by default, so that comparisons measure the
    package's fp32 rounding alone); router softmax and coreset sums stay fp32.
    """
    P = {k: v.detach().to(dtype) for k, v in P.items()}
    B, T = input_ids.shape
    N = block_size
    C = T - N
    eps = cfg.rms_norm_eps
    new_pools = [p.clone() for p in pools]
    logits = torch.zeros(B, N, cfg.vocab_size, dtype=F32)
    sizes = torch.zeros(B, len(cfg.layer_types), dtype=torch.int32)
    for b in range(B):
        slot, nc, start = int(slot_ids[b]), int(n_causal[b]), int(past_len[b])
        hc = [P["model.embed_tokens.weight"][int(t)] for t in input_ids[b, :nc]]
        hb = [P["model.embed_tokens.weight"][int(t)] for t in input_ids[b, C:]]
        for i, kind in enumerate(cfg.layer_types):
            L = f"model.layers.{i}."
            p0, p1 = pools[2 * i][slot].to(dtype), pools[2 * i + 1][slot].to(dtype)
            if kind == "linear_attention":
                mixer = GdnRow(cfg, P, L, p0, p1)
            else:
                mixer = AttentionRow(cfg, P, L, p0, p1, start)
            w_in = P[L + "input_layernorm.weight"]
            hc = [h + mixer.causal_token(rms_norm_one_plus(h, w_in, eps)) for h in hc]
            if N:
                hb = [h + o for h, o in zip(hb, mixer.block([rms_norm_one_plus(h, w_in, eps) for h in hb]))]
            if kind == "linear_attention":
                new_pools[2 * i][slot] = mixer.conv_state().to(pools[2 * i].dtype)
                new_pools[2 * i + 1][slot] = torch.stack(mixer.S).to(pools[2 * i + 1].dtype)
            else:
                new_pools[2 * i][slot] = mixer.key.to(pools[2 * i].dtype)
                new_pools[2 * i + 1][slot] = mixer.value.to(pools[2 * i + 1].dtype)
            # MoE: causal rows plain top-k; block rows within the coreset (if enabled)
            w_post, w_router = P[L + "post_attention_layernorm.weight"], P[L + "mlp.gate.weight"]
            k = cfg.num_experts_per_tok
            new_hc = []
            for h in hc:
                x = rms_norm_one_plus(h, w_post, eps)
                p = router_probs(x, w_router)
                new_hc.append(h + moe_row(x, P, L, top_k_experts(p, k), p))
            hc = new_hc
            if N:
                xs = [rms_norm_one_plus(h, w_post, eps) for h in hb]
                ps = [router_probs(x, w_router) for x in xs]
                allowed = set(coreset(ps, k, cfg.moe_block_coreset_top_p)) if cfg.moe_block_coreset_enabled else None
                chosen = [top_k_experts(p, k, allowed) for p in ps]
                hb = [h + moe_row(x, P, L, ex, p) for h, x, ex, p in zip(hb, xs, chosen, ps)]
                if int(has_block[b]):
                    sizes[b, i] = len(set(e for ex in chosen for e in ex))
        for t, h in enumerate(hb):
            logits[b, t] = matvec(P["lm_head.weight"], rms_norm_one_plus(h, P["model.norm.weight"], eps)).to(F32)
    return logits, sizes, new_pools


def literal_distinct(probs_block: torch.Tensor, k: int, top_p: float, enabled: bool) -> int:
    """Distinct experts the block rows of one batch row route to; probs_block [N, E]."""
    ps = list(probs_block.float())
    allowed = set(coreset(ps, k, top_p)) if enabled else None
    return len({e for p in ps for e in top_k_experts(p, k, allowed)})

