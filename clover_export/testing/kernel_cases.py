"""Kernel cases at Clover-35B-A3B's layer sizes on a CUDA GPU: inputs, and the Triton kernels checked against
the plain-torch cores (same inputs, same dtype; STEP_GRAPH.md 5).

Each `check_*` returns a dict of figures with `_ok` (within tolerance, pools exact where the op writes them).
"""

from __future__ import annotations

import torch

from clover_export.model.attention import attention_core
from clover_export.model.gdn import gdn_core
from clover_export.model.moe import moe_core
from clover_export.plugins.triton.ops import block_attention, block_gdn, coreset_moe
from clover_export.quantize.scales import dequantize, quantize_weight
from clover_export.testing.fullsize import layer_sizes

REAL = layer_sizes()  # D, E, k, I, Hk, Hv, dk, dv, K, H, Hkv, hd, N, top_p of the full-size config
DEV = "cuda"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (inf when a has a non-finite value)."""
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def gdn_inputs(B, Hk, Hv, dk, dv, K, N, Tc, S, dtype, pdtype, seed, nc=None, slots=None):
    """BlockGDN's inputs (parameters in `pdtype`), its conv and recurrent pools of S slots, slot ids, n_causal."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    C, T = 2 * Hk * dk + Hv * dv, Tc + N

    def r(*shape, sc=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g, device=DEV) * sc).to(dt)

    args = [r(B, T, C), r(B, T, Hv), r(B, T, Hv), r(C, K, sc=0.5, dt=pdtype), r(C, K, sc=0.5, dt=pdtype),
            torch.rand(Hv, generator=g, device=DEV).mul(15).add(1).log().to(pdtype), r(Hv, sc=0.1, dt=pdtype) + 1,
            (torch.rand(Hv, generator=g, device=DEV) * 6 + 2).to(pdtype), r(Hv, sc=0.1, dt=pdtype)]
    pools = [r(S, C, K - 1), r(S, Hv, dk, dv, sc=0.1, dt=torch.float32)]
    slots = torch.tensor(slots or list(range(S - 1, S - 1 - B, -1)), dtype=torch.int32, device=DEV)
    nc = torch.tensor(nc or [Tc] * B, dtype=torch.int32, device=DEV)
    return args, pools, slots, nc


def attention_inputs(B, H, Hkv, hd, N, Tc, S, L, past, nc, dtype, seed):
    """(q, k, v), the K/V pools of S slots and L positions, [slot ids, past_len, n_causal]."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    T = Tc + N
    r = lambda *s: torch.randn(*s, generator=g, device=DEV).to(dtype)  # noqa: E731
    q, k, v = r(B, T, H, hd), r(B, T, Hkv, hd), r(B, T, Hkv, hd)
    pools = [r(S, Hkv, L, hd), r(S, Hkv, L, hd)]
    ids = [torch.tensor(x, dtype=torch.int32, device=DEV) for x in (list(range(S - 1, S - 1 - B, -1)), past, nc)]
    return (q, k, v), pools, ids


def valid_rows(n_causal: torch.Tensor, Tc: int, N: int) -> torch.Tensor:
    """[B, Tc + N] bool: the causal rows j < n_causal and every block row. The other causal rows are padding
    (docs/exports.md, `n_causal`): their outputs are unspecified, and the kernels and the cores differ there."""
    j = torch.arange(Tc + N, device=n_causal.device)
    return (j < n_causal.long().unsqueeze(1)) | (j >= Tc)


def moe_inputs(B, T, D, E, I, dtype, seed):
    """Hidden states, router weights (logits of std ~2), gate_up and down weights of E experts."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(B, T, D, generator=g, device=DEV).to(dtype)
    rw = (torch.randn(E, D, generator=g, device=DEV) * D ** -0.5 * 2).to(dtype)  # router logits with std ~2
    gu = (torch.randn(E, 2 * I, D, generator=g, device=DEV) * D ** -0.5).to(dtype)
    dn = (torch.randn(E, D, I, generator=g, device=DEV) * I ** -0.5).to(dtype)
    return x, rw, gu, dn


def check_gdn(dtype, pdtype=None, tol=None):
    """BlockGDN at real head sizes, 3 rows (32 causal, 5, none) in 5 slots: output, pools, untouched slots."""
    pdtype = pdtype or dtype
    tol = tol or (2e-3 if dtype == torch.float32 else 3e-2)
    c = dict(B=3, Hk=REAL["Hk"], Hv=REAL["Hv"], dk=REAL["dk"], dv=REAL["dv"], K=REAL["K"], N=REAL["N"], Tc=32, S=5)
    args, (cp, rp), slots, nc = gdn_inputs(**c, dtype=dtype, pdtype=pdtype, seed=1, nc=[32, 5, 0], slots=[4, 0, 2])
    want = gdn_core(*args, cp, rp, slots, nc, c["Hk"], c["dk"], c["dv"], c["N"])
    mine_c, mine_r = cp.clone(), rp.clone()
    o = block_gdn(*args, mine_c, mine_r, slots, nc, c["Hk"], c["dk"], c["dv"], c["N"])[0]
    info = {"o_rel": rel(o, want[0]), "rec_rel": rel(mine_r, want[2]),
            "conv_exact": bool(torch.equal(mine_c, want[1])),
            "untouched_slots_exact": bool(torch.equal(mine_r[[1, 3]], rp[[1, 3]])
                                          and torch.equal(mine_c[[1, 3]], cp[[1, 3]]))}
    info["_ok"] = info["o_rel"] < tol and info["rec_rel"] < tol and info["conv_exact"] and info["untouched_slots_exact"]
    return info


def check_attention(dtype, splits, tol=None):
    """BlockAttention (16/2 heads of 256) over prefixes of 4096, 17 and 0 with `splits` (None: automatic): the
    output's valid rows, and the pools exactly."""
    tol = tol or (1e-3 if dtype == torch.float32 else 2e-2)
    c = dict(B=3, H=16, Hkv=2, hd=256, N=32, Tc=32, S=5, L=4160)
    (q, k, v), (kp, vp), ids = attention_inputs(**c, past=[4096, 17, 0], nc=[32, 7, 0], dtype=dtype, seed=2)
    want = attention_core(q, k, v, kp, vp, *ids, c["N"], c["hd"] ** -0.5)
    mk, mv = kp.clone(), vp.clone()
    o = block_attention(q, k, v, mk, mv, *ids, c["N"], c["hd"] ** -0.5, splits=splits)[0]
    rows = valid_rows(ids[2], c["Tc"], c["N"])
    info = {"o_rel": rel(o[rows], want[0][rows]), "k_exact": bool(torch.equal(mk, want[1])),
            "v_exact": bool(torch.equal(mv, want[2]))}
    info["_ok"] = info["o_rel"] < tol and info["k_exact"] and info["v_exact"]
    return info


def check_moe(dtype, fp8=False, tol=None):
    """CoresetMoE (256 experts x 512, top-8, coreset top_p); FP8 against the core on the dequantized weights."""
    tol = tol or (1e-3 if dtype == torch.float32 else 3e-2)
    B, T, N = 2, 64, 32
    x, rw, gu, dn = moe_inputs(B, T, REAL["D"], REAL["E"], REAL["I"], dtype, seed=3)
    kw = {}
    if fp8:
        (gq, gs), (dq, ds) = quantize_weight(gu), quantize_weight(dn)
        gu, dn = dequantize(gq, gs, dtype), dequantize(dq, ds, dtype)
        kw = dict(gate_up_scale=gs, down_scale=ds)
    want = moe_core(x, rw, gu, dn, REAL["k"], REAL["top_p"], True, N)
    got = coreset_moe(x, rw, gq if fp8 else gu, dq if fp8 else dn, REAL["k"], REAL["top_p"], True, N, **kw)
    info = {"routed_rel": rel(got[0], want[0]), "coreset_size": got[1].tolist(), "ref_coreset_size": want[1].tolist()}
    info["_ok"] = info["routed_rel"] < tol and info["coreset_size"] == info["ref_coreset_size"]
    return info
