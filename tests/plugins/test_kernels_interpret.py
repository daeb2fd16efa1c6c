"""The Triton kernels equal the plain-torch cores (the op contracts) under TRITON_INTERPRET=1 (STEP_GRAPH.md 5).

The interpreter must be on when the kernels' @triton.jit decorators run, so
the checks run in one child process (this file executed as a script with
TRITON_INTERPRET=1), fp32, tiny shapes; each pytest test reads its case's
result. References are `gdn_core`, `attention_core`, `moe_core` and the
reference model step; whole pools are compared (untouched slots included).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import pytest

ATOL, RTOL = 3e-5, 1e-5


# ----------------------------------------------------------------- the checks (run in the child)
def _close(got, want, what):
    import torch

    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def gdn_case(B=2, Hk=2, Hv=4, dk=16, dv=16, K=4, N=5, Tc=19, S=3, nc=(19, 2), chunk=16, seed=0, split=True):
    """split: the torch path's conv + delta-rule kernels; False: the one-launch kernel TensorRT runs."""
    import torch

    from clover_export.model.gdn import gdn_core
    from clover_export.plugins.triton.ops import block_gdn

    g = torch.Generator().manual_seed(seed)
    C, T = 2 * Hk * dk + Hv * dv, Tc + N
    r = lambda *s, sc=1.0: torch.randn(*s, generator=g) * sc  # noqa: E731
    args = (r(B, T, C), r(B, T, Hv), r(B, T, Hv), r(C, K, sc=0.5), r(C, K, sc=0.5),
            torch.rand(Hv, generator=g).mul(4).add(0.5).log(), r(Hv, sc=0.1) + 1, torch.rand(Hv, generator=g) * 6 + 2,
            r(Hv))
    conv_pool, rec_pool = r(S, C, K - 1), r(S, Hv, dk, dv, sc=0.3)
    slots = torch.tensor([2, 0, 1][:B], dtype=torch.int32)
    ncs = torch.tensor(nc[:B], dtype=torch.int32)
    want = gdn_core(*args, conv_pool, rec_pool, slots, ncs, Hk, dk, dv, N)
    cp, rp = conv_pool.clone(), rec_pool.clone()
    got = block_gdn(*args, cp, rp, slots, ncs, Hk, dk, dv, N, chunk=chunk, bv=16, split=split)
    assert got[1] is cp and got[2] is rp, "pools must be updated in place"
    for name, x, y in zip(("o", "conv_pool", "rec_pool"), got, want):
        _close(x, y, name)


def gdn_trained_like_case(Tc=128, chunk=32, split=True):
    """Keys sharing a direction, slow decay, beta ~1, dk = 128 (tests/plugins/test_gdn_numerics.py): the kernel's
    chunk inverse must not cancel (STEP_GRAPH.md 2)."""
    from test_gdn_numerics import trained_like_case

    from clover_export.model.gdn import gdn_core
    from clover_export.plugins.triton.ops import block_gdn

    t, a = trained_like_case(Tc=Tc, key_noise=2.5)
    names = ("mixed_qkv", "a", "b", "conv_w", "conv_w_right", "A_log", "dt_bias", "block_scale", "block_gate")
    args = [t[n] for n in names]
    rest = (t["slot_ids"], t["n_causal"], a["num_k_heads"], a["head_k_dim"], a["head_v_dim"], a["block_size"])
    want = gdn_core(*args, t["conv_pool"], t["rec_pool"], *rest)
    got = block_gdn(*args, t["conv_pool"].clone(), t["rec_pool"].clone(), *rest, chunk=chunk, bv=32, split=split)
    for name, x, y in zip(("o", "conv_pool", "rec_pool"), got, want):
        _close(x, y, name)


def _attention_step(B, H, Hkv, hd, N, Tc, S, L, past, nc, seed):
    """Random q, k, v [B, Tc + N, heads, hd], pools of S slots x L positions and (slot_ids, past_len, n_causal),
    with `attention_core`'s (o, key_pool, value_pool) for them."""
    import torch

    from clover_export.model.attention import attention_core

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, Tc + N, h, hd, generator=g) for h in (H, Hkv, Hkv))
    kp, vp = torch.randn(S, Hkv, L, hd, generator=g), torch.randn(S, Hkv, L, hd, generator=g)
    ids = [torch.tensor(x[:B], dtype=torch.int32) for x in ((2, 0, 1), past, nc)]
    return q, k, v, kp, vp, ids, attention_core(q, k, v, kp, vp, *ids, N, hd ** -0.5)


def _close_attention(got, want, n_causal, Tc):
    """(o, key_pool, value_pool) against the core's. Padding causal rows (at or past n_causal) are don't-care
    outputs (STEP_GRAPH.md 1): the core zeroes the values they would read past the valid prefix, the kernel
    reads them; compare the valid rows."""
    import torch

    pad = torch.arange(got[0].shape[1]).unsqueeze(0) >= n_causal.long().unsqueeze(1)
    pad[:, Tc:] = False
    o_got, o_want = got[0].clone(), want[0].clone()
    o_got[pad], o_want[pad] = 0, 0
    for name, x, y in zip(("o", "key_pool", "value_pool"), (o_got, *got[1:]), (o_want, *want[1:])):
        _close(x, y, name)


def attention_case(B=2, H=4, Hkv=2, hd=16, N=4, Tc=5, S=3, L=40, past=(7, 30), nc=(5, 2), splits=1, seed=0,
                   kv_first=True):
    """kv_first: the torch path (K/V written by their own launch first); False: the one-kernel TensorRT form."""
    from clover_export.plugins.triton.ops import block_attention

    q, k, v, kp, vp, ids, want = _attention_step(B, H, Hkv, hd, N, Tc, S, L, past, nc, seed)
    a, b = kp.clone(), vp.clone()
    got = block_attention(q, k, v, a, b, *ids, N, hd ** -0.5, splits=splits, kv_first=kv_first)
    assert got[1] is a and got[2] is b, "pools must be updated in place"
    _close_attention(got, want, ids[2], Tc)


def attention_trt_split_case(B=2, H=4, Hkv=2, hd=16, N=4, Tc=5, S=3, L=4096, past=(7, 3000), nc=(5, 2),
                             num_sms=16, seed=6):
    """BlockAttention's split-KV form as TensorRT launches it (model.trt.onnx: BlockAttentionSplit, then
    BlockAttentionMerge): each kernel from its AOT plan (variant, grid, int32 scalars from input dims,
    pointers in contract order), partials allocated at the plan's declared shapes (rows past S x B x T
    included) and filled with garbage; the merged output and the pools equal `attention_core`. Batch row 0
    sees 12 positions: most of its splits are empty."""
    import torch

    from clover_export.plugins import contracts
    from clover_export.plugins.triton import attention as kern
    from clover_export.plugins.triton.launch import attention_split_cap
    from clover_export.plugins.trt import plan

    T = Tc + N
    q, k, v, kp, vp, ids, want = _attention_step(B, H, Hkv, hd, N, Tc, S, L, past, nc, seed)
    attrs = {"block_size": N, "scale": hd ** -0.5, "max_splits": attention_split_cap(L)}  # as trt_graph writes it

    def launch(op, inputs, outputs, **kw):
        c = contracts.TRT_CONTRACTS[op]
        shapes = {n: tuple(t.shape) for n, t in inputs.items()}
        dtypes = {n: str(t.dtype).removeprefix("torch.") for n, t in inputs.items()}
        p = plan.aot_plan(op, shapes, attrs if c.attributes else {}, dtypes, 90, **kw)
        args = ([inputs[t.name] for t in c.inputs] + [int(shapes[src][dim]) for src, dim in p.scalars]
                + [outputs[t.name] for t in c.outputs])
        getattr(kern, p.variant.kernel)[p.grid](*args, **p.variant.constexprs, **p.variant.options)
        return p

    a, b = kp.clone(), vp.clone()
    split_in = dict(q=q, k=k, v=v, key_pool=a, value_pool=b, slot_ids=ids[0], past_len=ids[1], n_causal=ids[2])
    decls = plan.output_decls(contracts.BLOCK_ATTENTION_SPLIT, {n: tuple(t.shape) for n, t in split_in.items()},
                              attrs, num_sms=num_sms)
    acc, ml = (torch.full(d.shape, -7.0) for d in decls[:2])
    count = torch.full(decls[2].shape, -1, dtype=torch.int32)
    p = launch("BlockAttentionSplit", split_in, dict(acc=acc, ml=ml, splits=count, key_pool_out=a, value_pool_out=b),
               num_sms=num_sms)
    splits = p.grid[2]
    assert count.tolist() == [splits] and splits > 2 and acc.shape[0] > splits * B * T, (p.grid, acc.shape)
    o = torch.full_like(q, -7.0)
    launch("BlockAttentionMerge", dict(acc=acc, ml=ml, splits=count, q=q), dict(o=o))
    _close_attention((o, a, b), want, ids[2], Tc)
    return {"splits": splits}


def moe_case(B=2, Tc=3, N=5, D=32, E=8, I=16, k=2, top_p=0.9, coreset=True, fp8=False, ties=False, seed=0,
             hot=False):
    import torch

    from clover_export.model.moe import moe_core
    from clover_export.plugins.triton.ops import coreset_moe
    from clover_export.quantize.scales import dequantize, quantize_weight

    g = torch.Generator().manual_seed(seed)
    T = Tc + N
    x = torch.randn(B, T, D, generator=g)
    rw = torch.randn(E, D, generator=g) * 0.5
    if ties:  # identical router rows give identical probabilities: ties must go to the lower expert id
        rw[1::2] = rw[0::2]
    if hot:  # every token routes to expert 3: its pairs span several M tiles (parallel programs, M-block grid)
        x[..., 0] += 4.0
        rw[3, 0] = 3.0
    gu = torch.randn(E, 2 * I, D, generator=g) / D ** 0.5
    dn = torch.randn(E, D, I, generator=g) / I ** 0.5
    kw = {}
    if fp8:
        (gq, gs), (dq, ds) = quantize_weight(gu), quantize_weight(dn)
        gu, dn = dequantize(gq, gs), dequantize(dq, ds)  # the reference runs on the dequantized weights
        kw = dict(gate_up_scale=gs, down_scale=ds)
    want = moe_core(x, rw, gu, dn, k, top_p, coreset, N)
    got = coreset_moe(x, rw, gq if fp8 else gu, dq if fp8 else dn, k, top_p, coreset, N, **kw)
    _close(got[0], want[0], "routed")
    assert got[1].tolist() == want[1].tolist(), f"coreset_size {got[1].tolist()} != {want[1].tolist()}"
    plain = moe_core(x, rw, gu, dn, k, top_p, False, N)[1]
    info = {"coreset": want[1].tolist(), "plain": plain.tolist()}
    if hot:
        from clover_export.plugins.triton import launch
        from clover_export.plugins.triton.ops import moe_route

        idx = moe_route(x, rw, k, top_p, coreset, N)[0]
        info.update(hot_pairs=int((idx == 3).sum()), block_m=launch.moe_block_m(idx.numel(), E))
        assert info["hot_pairs"] > 2 * info["block_m"], info  # three or more tiles of one expert
    return info


def moe_shared_case(B=2, Tc=66, N=8, D=32, E=8, I=16, k=2, seed=15):
    """The whole MoE block with the shared expert as expert E of the grouped GEMMs (ops.moe_block) against
    `moe_core` + `SharedExpert` + `gated_residual`: 148 tokens, so the shared segment spans two place-kernel
    programs and several M tiles; one batch row has padding causal rows (no routed expert: the shared part only)."""
    import torch
    import torch.nn.functional as F

    from clover_export.model.functional import gated_residual, swiglu
    from clover_export.model.moe import moe_core
    from clover_export.plugins.triton.ops import moe_block

    g = torch.Generator().manual_seed(seed)
    T = Tc + N
    x = torch.randn(B, T, D, generator=g)
    rw = torch.randn(E, D, generator=g) * 0.5
    gu, dn = torch.randn(E, 2 * I, D, generator=g) / D ** 0.5, torch.randn(E, D, I, generator=g) / I ** 0.5
    sg, su, sd = torch.randn(I, D, generator=g) / D**0.5, torch.randn(I, D, generator=g), torch.randn(D, I, generator=g)
    gw = torch.randn(1, D, generator=g)
    routed, want_size = moe_core(x, rw, gu, dn, k, 0.9, True, N)
    shared = F.linear(swiglu(F.linear(x, sg), F.linear(x, su)), sd)
    want = gated_residual(routed, F.linear(x, gw), shared)
    nc = torch.tensor([Tc, 5], dtype=torch.int32)
    got, size = moe_block(x, rw, gu, dn, sg, su, sd, gw, k, 0.9, True, N, n_causal=nc)
    assert size.tolist() == want_size.tolist(), (size, want_size)
    _close(got[0], want[0], "batch row 0")
    _close(got[1, :5], want[1, :5], "batch row 1, causal rows")
    _close(got[1, Tc:], want[1, Tc:], "batch row 1, block rows")
    only_shared = torch.sigmoid(F.linear(x, gw)) * shared
    _close(got[1, 5:Tc], only_shared[1, 5:Tc], "batch row 1, padding rows: shared part only")
    return {"tokens": B * T}


def moe_fp8_f16_case(act_dtype="float32", seed=7, B=2, Tc=3, N=5, D=64, E=8, I=32, k=2):
    """FP8 experts on fp16 dots (F16_DOT, per-row power-of-two scaling): each routed row within fp16 rounding
    of the float64 reference, rows far outside fp16's range (1e6 x: overflow, 1e-3 x: subnormals) included."""
    import torch

    from clover_export.model.moe import moe_core
    from clover_export.plugins.triton.ops import coreset_moe
    from clover_export.quantize.scales import dequantize, quantize_weight

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, Tc + N, D, generator=g)
    rw = torch.randn(E, D, generator=g) * 0.5
    (gq, gs) = quantize_weight(torch.randn(E, 2 * I, D, generator=g) / D ** 0.5)
    (dq, ds) = quantize_weight(torch.randn(E, D, I, generator=g) / I ** 0.5)
    if act_dtype == "float32":
        x[0, 1] *= 1e6
        x[1, Tc + 2] *= 1e-3
    x = x.to(getattr(torch, act_dtype))
    want = moe_core(x.double(), rw.to(x.dtype).double(), dequantize(gq, gs).double(), dequantize(dq, ds).double(),
                    k, 0.9, True, N)
    got = coreset_moe(x, rw.to(x.dtype), gq, dq, k, 0.9, True, N, gate_up_scale=gs, down_scale=ds,
                      tiles=dict(F16_DOT=True))
    assert torch.isfinite(got[0]).all(), "fp16 overflow"
    rel = ((got[0].double() - want[0]).norm(dim=-1) / want[0].norm(dim=-1)).max().item()
    assert rel < 3e-3, f"worst row relative error {rel:.2e} (fp16 rounding is 4.9e-4)"
    assert got[1].tolist() == want[1].tolist()
    return {"worst_row_rel": rel}


def moe_w8a8_case(B=2, Tc=40, N=8, D=64, E=8, I=32, k=2, seed=13):
    """FP8 experts on e4m3 x e4m3 dots (tiles A8): equal to the sub-op chain run on the kernels' own quantized
    activations (x per token, h per pair); the quantizer equals torch's e4m3 cast of x / (amax / 448)."""
    import torch
    import torch.nn.functional as F

    from clover_export.model import moe_split as ms
    from clover_export.model.moe import moe_core
    from clover_export.plugins.triton.ops import act_quant, coreset_moe
    from clover_export.quantize.scales import dequantize, quantize_weight

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, Tc + N, D, generator=g) * torch.logspace(-2, 2, D)[torch.randperm(D, generator=g)]
    rw = torch.randn(E, D, generator=g) * 0.05
    (gq, gs), (dq, ds) = quantize_weight(torch.randn(E, 2 * I, D, generator=g)), quantize_weight(
        torch.randn(E, D, I, generator=g))
    gu, dn = dequantize(gq, gs), dequantize(dq, ds)
    got, size = coreset_moe(x, rw, gq, dq, k, 0.9, True, N, gate_up_scale=gs, down_scale=ds, tiles={"A8": True})

    def dq_rows(t):
        q, sc = act_quant(t.reshape(-1, t.shape[-1]))
        live = t.reshape(q.shape).abs().amax(1) > 0  # all-zero rows (h of unused pairs) stay zero
        assert q.dtype == torch.float8_e4m3fn and q.float().abs().amax(1)[live].eq(448).all(), "row max -> 448"
        rows = t.reshape(q.shape)
        assert torch.equal(q.float(), (rows / sc[:, None]).to(torch.float8_e4m3fn).float()), "not torch's e4m3 rounding"
        assert torch.equal(sc, rows.abs().amax(1) / 448), "scale"
        return (q.float() * sc[:, None]).reshape(t.shape)

    idx, w, distinct = ms.route_core(F.linear(x, rw), k, 0.9, True, N)
    offsets, order = ms.align_core(idx, E)
    h = ms.gate_up_core(dq_rows(x), gu, offsets, order)
    want = ms.combine_core(ms.down_core(dq_rows(h), dn, w, offsets, order), idx, E)
    # h is quantized from the kernel's own h, which differs from the chain's by fp32 rounding: an element at a
    # rounding tie may land one e4m3 step away (~1e-3 of a row's output); a wrong scale or row is O(1) off
    torch.testing.assert_close(got, want, atol=1e-3, rtol=2e-3, msg=lambda m: f"w8a8 routed: {m}")
    assert size.tolist() == distinct.tolist()
    exact = moe_core(x, rw, gu, dn, k, 0.9, True, N)[0]
    return {"rel_err_vs_weight_only": float((got - exact).norm() / exact.norm())}


def moe_align_case(seed=14, E=37, P=700):
    """The torch path's pair grouping (count + place kernels, several programs): the offsets of `align_core`,
    and each expert's segment holds exactly its pairs (their order inside a segment is free)."""
    import torch

    from clover_export.model.moe_split import align_core
    from clover_export.plugins.triton.ops import moe_align

    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, E + 1, (1, P, 1), generator=g, dtype=torch.int32)  # id E: unused slots
    idx[0, :150] = 5  # a hot expert spanning programs
    offsets, order = moe_align(idx, E)
    want = align_core(idx, E)[0]
    assert torch.equal(offsets, want), (offsets, want)
    flat = idx.view(-1)
    for e in range(E):
        seg = order[offsets[e]:offsets[e + 1]].long()
        assert torch.equal(seg.sort().values, (flat == e).nonzero().view(-1)), e


def moe_tie_case(top_p):
    """tests/coreset_tie_case.py: the coreset boundary on fp32 rounding (assumed.coreset_mask's rule)."""
    from coreset_tie_case import KEPT, K, N, tie_case

    from clover_export.model.moe import moe_core
    from clover_export.plugins.triton.ops import coreset_moe

    t = tie_case()
    want = moe_core(t["x"], t["router_w"], t["gate_up"], t["down"], K, top_p, True, N)
    got = coreset_moe(t["x"], t["router_w"], t["gate_up"], t["down"], K, top_p, True, N)
    assert want[1].tolist() == [KEPT[top_p]], f"reference coreset_size {want[1].tolist()}"
    assert got[1].tolist() == want[1].tolist(), f"coreset_size {got[1].tolist()} != {want[1].tolist()}"
    _close(got[0], want[0], "routed")
    return {"coreset": got[1].tolist()}


def glue_case(dtype="float32", seed=11):
    """The fused glue kernels (norms.py) against `functional`: strided q rows, partial RoPE, residual add."""
    import torch

    from clover_export.model import functional as F
    from clover_export.plugins.triton import ops

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, sc=1.0: (torch.randn(*s, generator=g) * sc).to(dt)  # noqa: E731
    B, T, H, hd, rot, D, eps = 2, 3, 3, 24, 8, 40, 1e-6
    h, res, w = r(B, T, D, sc=30.0), r(B, T, D), r(D, sc=0.2)
    q, _gate = r(B, T, H, 2 * hd).chunk(2, dim=-1)  # strided rows, as Attention's q and gate
    wq, o, z, wo = r(hd, sc=0.2), r(B, T, H, hd, sc=1e-3), r(B, T, H, hd), r(hd)
    cos, sin = (x.to(dt) for x in F.rope_cos_sin(torch.arange(B * T).view(B, T) * 7, rot, 1e4, torch.float32))
    if dtype == "float32":
        check = _close
    else:  # the interpreter narrows fp32 to bf16 by truncation (the GPU rounds to nearest): an ulp per rounding,
        # and RoPE's sum of two rounded products cancels (absolute error ~ an ulp of the operands)
        def check(got, want, what):
            torch.testing.assert_close(got.float(), want.float(), atol=2**-5, rtol=2**-6, msg=lambda m: f"{what}: {m}")

    check(ops.rms_norm(h, w, eps), F.rms_norm(h, w, eps), "rms_norm")
    check(ops.rms_norm(q, wq, eps), F.rms_norm(q, wq, eps), "rms_norm strided")
    for got, want, what in zip(ops.add_rms_norm(h, res, w, eps), F.add_rms_norm(h, res, w, eps), ("sum", "norm")):
        check(got, want, f"add_rms_norm {what}")
    check(ops.norm_rope(q, wq, eps, cos, sin), F.norm_rope(q, wq, eps, cos, sin), "norm_rope")
    check(ops.gated_rms_norm(o, z, wo, eps), F.gated_rms_norm(o, z, wo, eps), "gated_rms_norm")
    check(ops.sigmoid_gate(z, _gate), F.sigmoid_gate(z, _gate), "sigmoid_gate (strided gate rows)")
    g_, u_, sg = r(B, T, 2 * D, sc=3.0), r(B, T, 2 * D), r(B, T, 1, sc=2.0)
    check(ops.swiglu(g_, u_), F.swiglu(g_, u_), "swiglu")
    check(ops.gated_residual(h, sg, res), F.gated_residual(h, sg, res), "gated_residual")


def model_case():
    """A whole tiny step through `cuda_cores` (in-place twins), with the fused glue, and the functional ops,
    kernels on the CPU."""
    import dataclasses

    import torch

    from clover_export.model.model import CloverModel, allocate_pools, init_random_
    from clover_export.plugins import cuda_ops, torch_ops
    from clover_export.plugins.triton import ops
    from clover_export.tiny import tiny_config

    cfg = tiny_config(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                      shared_expert_intermediate_size=32)  # the routed experts' width: moe_block can fuse it
    model = init_random_(CloverModel(cfg, block_size=4), seed=3).eval()
    g = torch.Generator().manual_seed(5)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    inputs = dict(input_ids=torch.randint(0, cfg.vocab_size, (2, 7), generator=g, dtype=torch.int32),
                  n_causal=i32(3, 1), has_block=i32(1, 1), slot_ids=i32(1, 0), past_len=i32(0, 5),
                  logit_rows=i32([2, 0, 9], [0, 3, 5]))  # valid causal rows, block rows; 9 is clamped to 6
    pools = allocate_pools(cfg, 2, 16)
    for p in pools.values():
        p.copy_(torch.randn(p.shape, generator=g))
    with torch.no_grad():
        want = model.step(inputs, {n: p.clone() for n, p in pools.items()})
        model.cores = cuda_ops.cuda_cores("cpu")
        mine = {n: p.clone() for n, p in pools.items()}
        got = model.step(inputs, mine)
        # + the fused glue and the shared expert in the grouped GEMMs (the triton backend's Cores)
        model.cores = dataclasses.replace(cuda_ops.cuda_cores("cpu"), **ops.GLUE, moe_block=ops.moe_block)
        glued = {n: p.clone() for n, p in pools.items()}
        glue = model.step(inputs, glued)
        model.cores = torch_ops.export_cores()  # functional ops, CPU kernels registered above
        kept = {n: p.clone() for n, p in pools.items()}
        fun = model.step(inputs, kept)
    _close(got[0], want[0], "logits")
    assert got.causal_logits.shape == (2, 3, cfg.vocab_size)
    for res, what in ((got, "in-place"), (glue, "fused glue"), (fun, "functional")):
        _close(res.causal_logits, want.causal_logits, f"{what} causal_logits")
    assert torch.equal(got[1], want[1]), "coreset_size"
    for n in pools:
        _close(mine[n], want[2][n], f"in-place {n}")
        _close(fun[2][n], want[2][n], f"functional {n}")
        assert torch.equal(kept[n], pools[n]), f"the functional op changed its input pool {n}"
    _close(fun[0], want[0], "functional logits")
    _close(glue[0], want[0], "logits with the fused glue and MoE block")
    assert torch.equal(glue[1], want[1]), "coreset_size with the MoE block"
    for n in pools:
        _close(glued[n], want[2][n], f"fused glue {n}")


CASES = {
    "gdn_mixed": lambda: gdn_case(),
    "gdn_block_only": lambda: gdn_case(Tc=0, nc=(0, 0), seed=1),
    "gdn_prefill_no_block": lambda: gdn_case(N=0, Tc=7, nc=(7, 3), seed=2),
    "gdn_odd_dims_chunks": lambda: gdn_case(dk=24, dv=20, Hk=1, Hv=2, K=3, N=16, Tc=33, nc=(33, 1), seed=3),
    "gdn_fused_mixed": lambda: gdn_case(split=False),
    "gdn_fused_odd_dims_chunks": lambda: gdn_case(dk=24, dv=20, Hk=1, Hv=2, K=3, N=16, Tc=33, nc=(33, 1), seed=3,
                                                  split=False),
    "gdn_fused_trained_like": lambda: gdn_trained_like_case(split=False),
    "attention_mixed": lambda: attention_case(),
    "gdn_trained_like": gdn_trained_like_case,
    "attention_split": lambda: attention_case(splits=3, seed=1),
    "attention_block_only": lambda: attention_case(Tc=0, nc=(0, 0), past=(0, 39), seed=2),
    "attention_no_block_overflow": lambda: attention_case(N=0, Tc=6, past=(36, 3), nc=(5, 4), splits=2, seed=3),
    "attention_gqa_long": lambda: attention_case(hd=24, H=6, Hkv=1, L=200, past=(150, 3), splits=4, seed=4),
    "attention_fused_mixed": lambda: attention_case(kv_first=False),
    "attention_fused_split": lambda: attention_case(splits=3, seed=1, kv_first=False),
    # block rows of an empty prefix (visibility limit 0) beside padding causal rows
    "attention_empty_prefix_block_rows": lambda: attention_case(past=(0, 3), nc=(0, 2), L=40, seed=5),
    "attention_fused_empty_prefix": lambda: attention_case(past=(0, 3), nc=(0, 2), L=40, seed=5, kv_first=False),
    "attention_trt_split_plugins": attention_trt_split_case,
    "moe_coreset": lambda: moe_case(),
    "moe_plain": lambda: moe_case(coreset=False, seed=1),
    "moe_small_top_p": lambda: moe_case(top_p=0.5, E=16, k=3, seed=2),
    "moe_no_block": lambda: moe_case(N=0, Tc=4, seed=3),
    "moe_block_only_full_p": lambda: moe_case(Tc=0, N=7, top_p=1.0, seed=4),
    "moe_ties": lambda: moe_case(ties=True, top_p=0.6, seed=5),
    "moe_hot_expert_m_tiles": lambda: moe_case(Tc=90, N=8, hot=True, seed=9),
    "moe_hot_expert_fp8": lambda: moe_case(Tc=90, N=8, hot=True, fp8=True, seed=10),
    "moe_fp8": lambda: moe_case(fp8=True, seed=6),
    "moe_fp8_w8a8": moe_w8a8_case,
    "moe_align_atomic": moe_align_case,
    "moe_block_shared_expert": moe_shared_case,
    "moe_tie_full_p": lambda: moe_tie_case(1.0),
    "moe_tie_p_below_1": lambda: moe_tie_case(1 - 2.0**-24),
    "moe_fp8_f16_dot_extreme_rows": lambda: moe_fp8_f16_case(),
    "moe_fp8_f16_dot_fp16_acts": lambda: moe_fp8_f16_case("float16", seed=8),
    "glue_fp32": glue_case,
    "glue_bf16": lambda: glue_case("bfloat16", seed=12),
    "model_step": model_case,
}


def _child(names: list[str]) -> None:
    results = {}
    for name in names:
        try:
            info = CASES[name]()
            results[name] = {"ok": True, "info": info}
        except Exception:  # report every case, not just the first failure
            results[name] = {"ok": False, "error": traceback.format_exc(limit=4)}
    print("RESULTS " + json.dumps(results))


# ----------------------------------------------------------------- pytest side
@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, __file__, *CASES], env=env, capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")), None)
    assert line, f"the interpreter child failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(line[len("RESULTS "):])


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_core(results, case):
    r = results[case]
    assert r["ok"], r.get("error")


@pytest.mark.slow
def test_coreset_cases_exercise_the_coreset(results):
    """The coreset cases keep fewer experts than plain top-k would choose (else they test nothing)."""
    for case in ("moe_small_top_p", "moe_ties"):
        info = results[case]["info"]
        assert sum(info["coreset"]) < sum(info["plain"]), (case, info)


if __name__ == "__main__":
    _child(sys.argv[1:])
