"""TensorRT plugin decisions without TensorRT (STEP_GRAPH.md 2, 4).

`plugins/trt` must import cleanly where TensorRT is absent; its plain
decisions (output descriptors, aliases, autotune dtype combinations, AOT
launch plans) are checked here. `register.py` (the only file that imports
`tensorrt.plugin`) is exercised only where TensorRT is installed: no
stand-in for TensorRT is used (a mock would prove nothing about TensorRT).
"""

from __future__ import annotations

import importlib

import pytest

from clover_export.plugins.contracts import (
    BLOCK_ATTENTION,
    BLOCK_GDN,
    CONTRACTS,
    CORESET_MOE,
    CORESET_MOE_FP8,
    MOE_SUBOPS,
    TRT_CONTRACTS,
)
from clover_export.plugins.triton import launch
from clover_export.plugins.trt import plan

GDN_SHAPES = {"mixed_qkv": (2, 64, 8192), "a": (2, 64, 32), "b": (2, 64, 32), "conv_w": (8192, 4),
              "conv_w_right": (8192, 4), "A_log": (32,), "dt_bias": (32,), "block_scale": (32,), "block_gate": (32,),
              "conv_pool": (5, 8192, 3), "rec_pool": (5, 32, 128, 128), "slot_ids": (2,), "n_causal": (2,)}
GDN_ATTRS = {"num_k_heads": 16, "head_k_dim": 128, "head_v_dim": 128, "block_size": 32}
ATT_SHAPES = {"q": (2, 64, 16, 256), "k": (2, 64, 2, 256), "v": (2, 64, 2, 256), "key_pool": (5, 2, 4096, 256),
              "value_pool": (5, 2, 4096, 256), "slot_ids": (2,), "past_len": (2,), "n_causal": (2,)}
ATT_ATTRS = {"block_size": 32, "scale": 0.0625}


def test_package_imports_without_tensorrt():
    import clover_export.plugins.trt as trt_plugins

    if importlib.util.find_spec("tensorrt") is None:
        assert trt_plugins.AVAILABLE is False and trt_plugins.REGISTERED == ()


def test_output_decls_alias_the_pools():
    decls = plan.output_decls(BLOCK_GDN, GDN_SHAPES, GDN_ATTRS)
    assert [(d.name, d.alias_of) for d in decls] == [("o", None), ("conv_pool_out", "conv_pool"),
                                                     ("rec_pool_out", "rec_pool")]
    assert decls[0].shape == (2, 64, 32, 128) and decls[0].dtype_of == "mixed_qkv"
    moe = plan.output_decls(CORESET_MOE, {"x": (1, 64, 2048), "router_w": (256, 2048), "gate_up": (256, 1024, 2048),
                                          "down": (256, 2048, 512)}, {"top_k": 8, "top_p": 0.9, "coreset": 1,
                                                                      "block_size": 32})
    assert [(d.shape, d.dtype_of, d.dtype) for d in moe] == [((1, 64, 2048), "x", None), ((1,), None, "int32")]
    fp8 = plan.output_decls(CORESET_MOE_FP8, {"x": (1, 64, 2048), "router_w": (256, 2048),
                                              "gate_up_fp8": (256, 1024, 2048), "gate_up_scale": (256, 1024),
                                              "down_fp8": (256, 2048, 512), "down_scale": (256, 2048)},
                            {"top_k": 8, "top_p": 0.9, "coreset": 1, "block_size": 32})
    assert fp8 == moe
    with pytest.raises(ValueError, match="dim I2"):  # scales must match the weights' output channels
        plan.output_decls(CORESET_MOE_FP8, {"x": (1, 64, 2048), "router_w": (256, 2048),
                                            "gate_up_fp8": (256, 1024, 2048), "gate_up_scale": (256, 512),
                                            "down_fp8": (256, 2048, 512), "down_scale": (256, 2048)},
                          {"top_k": 8, "top_p": 0.9, "coreset": 1, "block_size": 32})


def test_autotune_combinations():
    for c in CONTRACTS.values():
        for s in plan.autotune_strings(c):
            assert len(s.split(", ")) == len(c.inputs) + len(c.outputs)
    gdn = plan.autotune_strings(BLOCK_GDN)
    names = [t.name for t in BLOCK_GDN.inputs] + [t.name for t in BLOCK_GDN.outputs]
    fp32_params = dict(zip(names, gdn[1].split(", ")))
    assert fp32_params["A_log"] == "FP32" and fp32_params["mixed_qkv"] == "BF16" and fp32_params["conv_pool"] == "BF16"
    assert fp32_params["rec_pool"] == fp32_params["rec_pool_out"] == "FP32" and fp32_params["slot_ids"] == "INT32"
    # FP8 expert weights come with per-channel scale inputs: FP8 appears exactly where those exist
    for c in CONTRACTS.values():
        has_scales = {"gate_up_scale", "down_scale"} <= {t.name for t in c.inputs}
        assert all(("FP8" in s) == has_scales for s in plan.autotune_strings(c)), c.name
    names = [t.name for t in CORESET_MOE_FP8.inputs] + [t.name for t in CORESET_MOE_FP8.outputs]
    fp8 = [dict(zip(names, s.split(", "))) for s in plan.autotune_strings(CORESET_MOE_FP8)]
    assert fp8[0] == {"x": "BF16", "router_w": "BF16", "gate_up_fp8": "FP8", "gate_up_scale": "FP32",
                      "down_fp8": "FP8", "down_scale": "FP32", "routed": "BF16", "coreset_size": "INT32"}
    assert [c["x"] for c in fp8] == ["BF16", "FP32"] and all(c["down_fp8"] == "FP8" for c in fp8)


def test_aot_plans():
    d = plan.io_dtypes(BLOCK_GDN, "bfloat16")
    p = plan.aot_plan("BlockGDN", GDN_SHAPES, GDN_ATTRS, d, 90)
    assert p.grid == (2, 16, 1) and p.scalars == (("mixed_qkv", 1), ("conv_pool", 0))
    assert p.variant.key == "BlockGDN.bf16.pbf16" and list(p.variant.signature)[:2] == ["mixed_qkv", "a"]
    p = plan.aot_plan("BlockAttention", ATT_SHAPES, ATT_ATTRS, plan.io_dtypes(BLOCK_ATTENTION, "bfloat16"), 90)
    assert p.grid == (64 * 8 // p.variant.constexprs["BLOCK_M"], 4, 1)
    assert p.scalars == (("q", 1), ("key_pool", 2), ("key_pool", 0)) and p.variant.constexprs["SCALE"] == 0.0625
    for op in (CORESET_MOE.name, CORESET_MOE_FP8.name):  # not TensorRT plugins: split by trt_graph.py
        with pytest.raises(ValueError, match="not a TensorRT plugin op"):
            plan.aot_plan(op, {}, {}, {}, 90)
    assert set(plan.AOT_OPS) == set(TRT_CONTRACTS)


# MoE sub-op shapes of one decode step at Clover-35B-A3B sizes (B 2, T 64, E 256, k 8, D 2048, I 512)
MOE_SHAPES = {"logits": (2, 64, 256), "idx": (2, 64, 8), "x": (2, 64, 2048), "gate_up": (256, 1024, 2048),
              "gate_up_fp8": (256, 1024, 2048), "gate_up_scale": (256, 1024), "offsets": (257,), "order": (2, 64, 8),
              "h": (2, 64, 8, 512), "down": (256, 2048, 512), "down_fp8": (256, 2048, 512), "down_scale": (256, 2048),
              "w": (2, 64, 8), "y": (2, 64, 8, 2048), "routed": (2, 64, 2048), "coreset_size": (2,)}
MOE_ATTRS = {"MoERoute": {"top_k": 8, "top_p": 0.9, "coreset": 1, "block_size": 32},
             "MoEAlign": {"num_experts": 256}, "MoECombine": {"num_experts": 256}}


def _moe_args(op):
    c = MOE_SUBOPS[op]
    return {t.name: MOE_SHAPES[t.name] for t in c.inputs}, MOE_ATTRS.get(op, {})


def _plan(op, shapes=None, cdiv=launch.cdiv):
    s, a = _moe_args(op)
    return plan.aot_plan(op, shapes or s, a, plan.io_dtypes(MOE_SUBOPS[op], "bfloat16"), 90,
                         shape_ops=launch.ShapeOps(cdiv=cdiv))


def test_moe_subop_plans_and_output_shapes():
    """Every MoE sub-op: its kernel takes exactly the contract's pointers (inputs, scalars, outputs), and its
    declared outputs are the tensors the next sub-op reads (the chain of model.trt.onnx)."""
    for op, c in MOE_SUBOPS.items():
        shapes, attrs = _moe_args(op)
        abi = launch.MOE_SUBOP_ABIS[op]
        assert list(_plan(op).variant.signature) == ([t.name for t in c.inputs] + [s[0] for s in abi.scalars]
                                                     + [t.name for t in c.outputs]), op
        for d in plan.output_decls(c, shapes, attrs):
            assert d.alias_of is None and d.shape == MOE_SHAPES[d.name], (op, d)
    grids = {op: _plan(op).grid for op in MOE_SUBOPS}
    assert grids["MoERoute"] == (2, 1 + (64 - 32 + 15) // 16, 1) and grids["MoEAlign"] == (1, 1, 1)
    tiles = launch.MOE_TILES[90]  # one program per (expert, output tile): intermediate 512, hidden 2048
    assert grids["MoEGateUp"] == (256, 512 // tiles["BLOCK_N1"], 1)
    assert grids["MoEDown"] == (256, 2048 // tiles["BLOCK_N2"], 1)
    assert _plan("MoEDownFP8").grid == (256, 2048 // launch.MOE_TILES_FP8[90]["BLOCK_N2"], 1)
    assert grids["MoECombine"] == (2 * 64, 2048 // 256, 1)
    fp8 = _plan("MoEGateUpFP8").variant
    assert fp8.signature["gate_up_fp8"] == "*fp8e4nv" and fp8.constexprs["HAS_SCALE"] is True


class Expr:
    """Records the arithmetic done on a TensorRT shape expression: + - * // with the expression on the left
    (tensorrt.plugin's SymIntExpr has no __radd__ / __rmul__, TensorRT 10.9-11.1 plugin/_tensor.py) and cdiv."""

    def __init__(self, s):
        self.s = s

    def _op(self, o, sym):
        return Expr(f"({self.s}{sym}{getattr(o, 's', o)})")

    def __add__(self, o):
        return self._op(o, "+")

    def __sub__(self, o):
        return self._op(o, "-")

    def __mul__(self, o):
        return self._op(o, "*")

    def __floordiv__(self, o):
        return self._op(o, "//")



def strict_cdiv(a, b):
    """`tensorrt.plugin.cdiv`'s contract (TensorRT 10.9-11.1, plugin/_top_level.py): ValueError on two ints."""
    if isinstance(a, int) and isinstance(b, int):
        raise ValueError("Both arguments cannot be 'int's")
    return Expr(f"cdiv({getattr(a, 's', a)},{getattr(b, 's', b)})")


def test_build_time_constants_never_reach_tensorrt_cdiv():
    """Static shapes (a profile with fixed T) and constants (experts, hidden sizes) are divided in Python;
    TensorRT's cdiv only ever sees a symbolic side."""
    p = plan.aot_plan("BlockAttention", ATT_SHAPES, ATT_ATTRS, plan.io_dtypes(BLOCK_ATTENTION, "bfloat16"), 90,
                      shape_ops=launch.ShapeOps(cdiv=strict_cdiv))
    assert p.grid == (64 * 8 // p.variant.constexprs["BLOCK_M"], 4, 1)
    for op in MOE_SUBOPS:
        assert all(isinstance(g, int) for g in _plan(op, cdiv=strict_cdiv).grid), op
    sym = {n: (Expr("B"), Expr("T"), *s[2:]) if n in ("q", "k", "v") else s for n, s in ATT_SHAPES.items()}
    g = plan.aot_plan("BlockAttention", sym, ATT_ATTRS, plan.io_dtypes(BLOCK_ATTENTION, "bfloat16"), 90,
                      shape_ops=launch.ShapeOps(cdiv=strict_cdiv)).grid
    assert g[0].s.startswith("cdiv((T*8),") and g[1].s == "(B*2)"
    route = _plan("MoERoute", {"logits": (Expr("B"), Expr("T"), 256)}, strict_cdiv).grid
    assert route[0].s == "B" and route[1].s == "(cdiv((T-32),16)+1)"
    combine = _plan("MoECombine", {"y": (Expr("B"), Expr("T"), 8, 2048), "idx": (Expr("B"), Expr("T"), 8)},
                    strict_cdiv).grid
    assert combine[0].s == "(B*T)" and combine[1] == 8


# ---------------------------------------------------------------- register.py with the real TensorRT
@pytest.mark.tensorrt
def test_register_with_real_tensorrt():
    """Only where TensorRT is installed: the plugins register under the contracts' names.

    No stand-in for TensorRT is used anywhere: without it this test is skipped, and
    register.py is only imported, never exercised.
    """
    if importlib.util.find_spec("tensorrt") is None:
        pytest.skip("TensorRT is not installed on this machine")
    from clover_export.plugins.trt import register

    assert set(register.register_all()) == {c.qualname for c in TRT_CONTRACTS.values()}


# ---------------------------------------------------------------- BlockAttention's split-KV form (two plugins)
@pytest.mark.parametrize("splits", [1, 3, 64])  # 64 splits of 40 positions: most are empty
def test_split_attention_references_compose_to_attention_core(splits):
    """split_core then merge_core (the contracts of BlockAttentionSplit / BlockAttentionMerge) equal
    attention_core, pools included, for any cut of the prefix; padding causal rows are don't-care."""
    import torch

    from clover_export.model.attention import attention_core
    from clover_export.model.attention_split import merge_core, split_core

    g = torch.Generator().manual_seed(3)
    B, H, Hkv, hd, N, Tc, S, L = 2, 4, 2, 16, 4, 5, 3, 40
    q, k, v = (torch.randn(B, Tc + N, h, hd, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv))
    kp, vp = (torch.randn(S, Hkv, L, hd, generator=g, dtype=torch.float64) for _ in range(2))
    ids = [torch.tensor(x, dtype=torch.int32) for x in ((2, 0), (7, 30), (5, 2))]
    want = attention_core(q, k, v, kp, vp, *ids, N, hd ** -0.5)
    acc, ml, count, k2, v2 = split_core(q, k, v, kp, vp, *ids, N, hd ** -0.5, splits)
    rows = splits * B * (Tc + N)
    assert acc.shape == (rows, H, hd) and ml.shape == (rows, H, 2) and count.tolist() == [splits]
    assert acc.dtype == ml.dtype == torch.float32 and count.dtype == torch.int32
    # the kernels' buffers may hold more rows (launch.attention_partial_rows): the merge reads S x B x T of them
    pad = lambda t: torch.cat([t, torch.full((5, *t.shape[1:]), float("nan"), dtype=t.dtype)])  # noqa: E731
    o = merge_core(pad(acc), pad(ml), count, q)
    live = torch.ones(B, Tc + N, dtype=torch.bool)
    live[1, 2:Tc] = False  # batch row 1 has 2 causal rows
    torch.testing.assert_close(o[live], want[0][live], atol=1e-5, rtol=1e-5)
    assert o.dtype == q.dtype and torch.equal(k2, want[1]) and torch.equal(v2, want[2])


def test_split_attention_plans_share_one_split_count():
    """BlockAttentionSplit's grid's third dimension is the split count (launch.attention_splits) and its declared
    partials hold that many splits (launch.attention_partial_rows), ints or TensorRT expressions; the merge takes
    its shapes from q and the count from the split kernel's `splits` output."""
    from clover_export.plugins.contracts import BLOCK_ATTENTION_MERGE, BLOCK_ATTENTION_SPLIT

    attrs = dict(ATT_ATTRS, max_splits=4)
    d = plan.io_dtypes(BLOCK_ATTENTION_SPLIT, "bfloat16")
    p = plan.aot_plan("BlockAttentionSplit", ATT_SHAPES, attrs, d, 90, num_sms=132)
    consts = launch.attention_constexprs(16, 2, 256, 32, 0.0625, "bfloat16", 90)
    assert p.grid[2] == launch.attention_splits(2, 64, 0, consts, 132, cap=4) == 4  # 32 programs: split
    assert launch.attention_splits(8, 64, 0, consts, 132, cap=4) == 2  # 128 programs: under two waves with 2
    assert launch.attention_splits(16, 64, 0, consts, 132, cap=4) == 1  # 256 programs fill the GPU
    one = {n: (1, 32, *s[2:]) if n in ("q", "k", "v") else ((1,) if len(s) == 1 else s) for n, s in ATT_SHAPES.items()}
    p1 = plan.aot_plan("BlockAttentionSplit", one, attrs, d, 90, num_sms=132)
    decls = plan.output_decls(BLOCK_ATTENTION_SPLIT, one, attrs, num_sms=132)
    assert p1.grid[2] == 4  # B = 1 decode: the cap
    assert [x.name for x in decls] == ["acc", "ml", "splits", "key_pool_out", "value_pool_out"]
    # rows: max(B T, cdiv(2 x 132 SMs x BLOCK_M 64, 16 heads)) = 1056 >= 4 splits x 1 x 32
    assert decls[0].shape == (1056, 16, 256) and decls[1].shape == (1056, 16, 2) and decls[2].shape == (1,)
    assert decls[2].dtype == "int32" and (decls[3].alias_of, decls[4].alias_of) == ("key_pool", "value_pool")
    assert list(p1.variant.signature) == [t.name for t in BLOCK_ATTENTION_SPLIT.inputs] + ["T", "L", "S"] + [
        t.name for t in BLOCK_ATTENTION_SPLIT.outputs]
    with pytest.raises(ValueError, match="SM count"):
        plan.output_decls(BLOCK_ATTENTION_SPLIT, one, attrs)
    m = plan.aot_plan("BlockAttentionMerge", {"acc": decls[0].shape, "ml": decls[1].shape, "splits": (1,),
                                              "q": one["q"]}, {}, plan.io_dtypes(BLOCK_ATTENTION_MERGE, "bfloat16"), 90)
    assert m.scalars == (("q", 1), ("acc", 0)) and m.grid == (32 * 16 // launch.ATTENTION_MERGE_BLOCK_R, 1, 1)
    assert list(m.variant.signature) == ["acc", "ml", "splits", "q", "T", "ROWS", "o"]
    # symbolic B and T (TensorRT): the same expression object sizes the partials and the grid
    ops = launch.ShapeOps(
        cdiv=strict_cdiv, min=lambda a, b: _strict("min", a, b), max=lambda a, b: _strict("max", a, b)
    )
    sym = {n: (Expr("B"), Expr("T"), *s[2:]) if n in ("q", "k", "v") else s for n, s in ATT_SHAPES.items()}
    ps = plan.aot_plan("BlockAttentionSplit", sym, attrs, d, 90, num_sms=132, shape_ops=ops)
    ds = plan.output_decls(BLOCK_ATTENTION_SPLIT, sym, attrs, num_sms=132, shape_ops=ops)
    assert ps.grid[2].s == "max(min((cdiv(264,((cdiv((T*8),64)*B)*2))-1),4),1)"
    assert ps.grid[1].s == "(B*2)" and ds[0].shape[0].s == "max((B*T),1056)" and ds[0].shape[1:] == (16, 256)


def test_split_attention_declares_dtypes_from_placeholder_dims():
    """TensorRT asks the shape function for output dtypes first, with placeholder dims that have no value (not
    even the static head counts): BlockAttentionSplit's declarations must not need them there."""
    from clover_export.plugins.contracts import BLOCK_ATTENTION_SPLIT

    fake = {n: tuple(Expr(f"{n}{i}") for i in range(len(s))) for n, s in ATT_SHAPES.items()}
    decls = plan.output_decls(BLOCK_ATTENTION_SPLIT, fake, dict(ATT_ATTRS, max_splits=4), num_sms=132,
                              dtype_pass=True)
    assert [(d.name, d.dtype, d.alias_of) for d in decls] == [
        ("acc", "float32", None), ("ml", "float32", None), ("splits", "int32", None),
        ("key_pool_out", None, "key_pool"), ("value_pool_out", None, "value_pool")]


@pytest.mark.parametrize("loose", [("q", 2), ("q", 3), ("k", 2)])
def test_split_attention_shape_pass_refuses_symbolic_heads(loose):
    """Outside the dtype pass the partials' rows are computed from q's heads and head size and k's heads: a
    symbolic one there is an error naming it, never a silent placeholder of B rows (the partials would be too
    small for what the split kernel writes)."""
    from clover_export.plugins.contracts import BLOCK_ATTENTION_SPLIT

    name, dim = loose
    shapes = dict(ATT_SHAPES, **{name: tuple(Expr("H") if i == dim else d for i, d in enumerate(ATT_SHAPES[name]))})
    ops = launch.ShapeOps(
        cdiv=strict_cdiv, min=lambda a, b: _strict("min", a, b), max=lambda a, b: _strict("max", a, b)
    )
    with pytest.raises(ValueError, match=f"{name} dim {dim} .*build-time constants"):
        plan.output_decls(BLOCK_ATTENTION_SPLIT, shapes, dict(ATT_ATTRS, max_splits=4), num_sms=132, shape_ops=ops)
    # the same shapes in the dtype pass: declared (placeholder rows, never read)
    assert plan.output_decls(BLOCK_ATTENTION_SPLIT, shapes, dict(ATT_ATTRS, max_splits=4), num_sms=132,
                             shape_ops=ops, dtype_pass=True)[0].dtype == "float32"


def test_partial_rows_bound_what_the_splits_write_and_grow_with_b_and_t():
    """launch.attention_partial_rows >= S x B x T for every B and T (S = attention_splits: the kernel writes S x
    B x T rows), and never shrinks as B or T grows: TensorRT sizes the partials from each dimension's upper
    bound over the profile, which is then the worst case (S x B x T itself is not monotone: the split count
    falls as B grows). Head layouts of Clover-35B-A3B (16 / 2) and a wide GQA one, H100/H200 and small GPUs."""
    Bs, Ts, worst = (1, 2, 3, 4, 5, 8, 13, 16, 33, 64), range(1, 200, 3), 0.0
    for h, hkv, hd in ((16, 2, 256), (32, 4, 128), (8, 8, 64)):
        consts = launch.attention_constexprs(h, hkv, hd, 32, hd ** -0.5, "bfloat16", 90)
        for sms in (16, 108, 132):
            rows = {(B, T): launch.attention_partial_rows(B, T, consts, sms) for B in Bs for T in Ts}
            for (B, T), r in rows.items():
                for cap in (2, 8, 32):
                    S = launch.attention_splits(B, T, 0, consts, sms, cap=cap)
                    assert S * B * T <= r, (h, hkv, sms, cap, B, T, S, r)
                    worst = max(worst, S * B * T / r)
            for B0, B1 in zip(Bs, Bs[1:]):
                for T0, T1 in zip(Ts, Ts[1:]):
                    assert rows[B0, T0] <= rows[B1, T0] and rows[B0, T0] <= rows[B0, T1], (B0, T0)
    assert worst > 0.5  # the bound is not loose everywhere


def _strict(name, a, b):
    """tensorrt.plugin's min / max: ValueError on two ints."""
    if isinstance(a, int) and isinstance(b, int):
        raise ValueError("Both arguments cannot be 'int's")
    return Expr(f"{name}({getattr(a, 's', a)},{getattr(b, 's', b)})")


def test_trt_split_attention_needs_long_pools():
    assert launch.attention_split_cap(1024) == launch.attention_split_cap(2047) == 1
    assert launch.attention_split_cap(4096) == 4 and launch.attention_split_cap(131072) == 32


# ---------------------------------------------------------------- shared memory of the AOT kernels (docs/tensorrt.md)
def test_aot_shared_budget_is_48_kib_unless_the_user_opts_in():
    env = plan.LARGE_SHARED_MEMORY_ENV
    assert plan.aot_shared_budget(90, {}) == plan.aot_shared_budget(80, {env: "0"}) == 48 * 1024
    assert (
        plan.aot_shared_budget(90, {env: "1"}) == 227 * 1024 and plan.aot_shared_budget(89, {env: "yes"}) == 99 * 1024
    )
    assert plan.aot_shared_budget(86, {env: "true"}) == 99 * 1024  # A10/A40: sm_89's shared memory, not sm_80's
    with pytest.raises(ValueError, match=f"{env}='maybe'"):
        plan.aot_shared_budget(90, {env: "maybe"})
    assert "at most 48 KiB" in plan.shared_memory_note(90, {}) and env in plan.shared_memory_note(None, {})
    assert "up to 227 KiB" in plan.shared_memory_note(90, {env: "1"})


def _tiles(c, o):
    return {k: c[k] for k in ("BV", "CC", "BLOCK_N", "BLOCK_M", "BLOCK_K") if k in c}, o["num_stages"], o["num_warps"]


@pytest.mark.parametrize("kernel, consts, options, first", [
    ("block_gdn_kernel", dict(BV=64, CC=32, LOG2_CC=5), dict(num_warps=8, num_stages=1), dict(BV=32, CC=32)),
    ("block_attention_kernel", dict(BLOCK_M=64, BLOCK_N=64), dict(num_warps=8, num_stages=2), None),
    ("block_attention_split_kernel", dict(BLOCK_M=64, BLOCK_N=64), dict(num_warps=8, num_stages=1),
     dict(BLOCK_M=64, BLOCK_N=32)),
    ("moe_gate_up_plain_kernel", dict(BLOCK_N=64, BLOCK_K=128), dict(num_warps=4, num_stages=4), None),
    ("moe_down_kernel", dict(BLOCK_N=64, BLOCK_K=128), dict(num_warps=4, num_stages=1), dict(BLOCK_N=64, BLOCK_K=64)),
])
def test_smaller_tiles_step_down_to_the_dot_minimum(kernel, consts, options, first):
    """Each step drops a pipelining stage, else halves one tile (never below 16, tl.dot's minimum); the chain
    ends (None) at stage 1 with every tile at 16; the chunk's log2 follows the chunk."""
    steps, c, o = [], consts, options
    while (nxt := launch.smaller_tiles(kernel, c, o)) is not None:
        before = _tiles(c, o)
        c, o = nxt
        after = _tiles(c, o)
        assert after != before and all(v >= 16 for v in after[0].values()) and after[1] >= 1, (before, after)
        assert after[1] < before[1] or sum(after[0].values()) < sum(before[0].values())
        steps.append(after)
        assert len(steps) < 20
    assert all(v == 16 for v in _tiles(c, o)[0].values()) and o["num_stages"] == 1
    if "CC" in c:
        assert 2 ** c["LOG2_CC"] == c["CC"]
    if "BLOCK_M" in c:
        assert o["num_warps"] <= 4  # a 16-row query tile on 8 warps would idle half of them
    if first is not None:
        assert steps[0][0] == first
    assert launch.smaller_tiles("moe_combine_kernel", dict(D=32), dict(num_warps=4, num_stages=1)) is None


def test_aot_plan_grid_follows_the_fitted_variant():
    """TensorRT's shared-memory fit may shrink the query tile: the grid must be computed from what is launched
    (each query tile one program), and the scalars and pointer list stay the ABI's."""
    import dataclasses

    def halve_m(v):
        return dataclasses.replace(v, constexprs=dict(v.constexprs, BLOCK_M=v.constexprs["BLOCK_M"] // 2))

    d = plan.io_dtypes(BLOCK_ATTENTION, "bfloat16")
    full = plan.aot_plan("BlockAttention", ATT_SHAPES, ATT_ATTRS, d, 90)
    small = plan.aot_plan("BlockAttention", ATT_SHAPES, ATT_ATTRS, d, 90, fit=halve_m)
    assert small.variant.constexprs["BLOCK_M"] * 2 == full.variant.constexprs["BLOCK_M"]
    assert small.grid == (full.grid[0] * 2, *full.grid[1:]) and small.scalars == full.scalars
    gu = plan.aot_plan("MoEGateUp", *_moe_args("MoEGateUp"), plan.io_dtypes(MOE_SUBOPS["MoEGateUp"], "bfloat16"), 90,
                       fit=lambda v: dataclasses.replace(v, constexprs=dict(v.constexprs, BLOCK_N=16)))
    assert gu.grid == (256, 512 // 16, 1)


# ---------------------------------------------------------------- BuilderFlag.FP8 (docs/tensorrt.md)
def test_fp8_builder_flag():
    """TensorRT 10.x strongly typed networks (ours: profiles.BuildSettings.network_flags) leave the flag unset,
    as trtexec does; a weakly typed 10.x network with FP8 plugins sets it; 11.x has no such flag; the user can
    force it on 10.x."""
    from clover_export.engines.builder import FP8_FLAG_ENV, fp8_builder_flag

    assert (
        fp8_builder_flag("10.9.0", True, True, {})[0] is False and fp8_builder_flag("10.16", True, True, {})[0] is False
    )
    assert "STRONGLY_TYPED" in fp8_builder_flag("10.12.0", True, True, {})[1]
    assert fp8_builder_flag("10.9.0", True, False, {})[0] is True
    assert fp8_builder_flag("10.9.0", True, True, {FP8_FLAG_ENV: "1"}) == (
        True,
        f"BuilderFlag.FP8 set ({FP8_FLAG_ENV}=1)",
    )
    assert fp8_builder_flag("10.9.0", False, True, {FP8_FLAG_ENV: "1"})[0] is False  # no FP8 plugin: nothing to enable
    for forced in ("0", "1"):
        assert fp8_builder_flag("11.1", True, True, {FP8_FLAG_ENV: forced})[0] is False
    with pytest.raises(ValueError, match=FP8_FLAG_ENV):
        fp8_builder_flag("10.9", True, True, {FP8_FLAG_ENV: "fp8"})


def test_doctor_reports_the_build_choices(monkeypatch):
    from clover_export.engines.builder import FP8_FLAG_ENV
    from clover_export.pipeline.doctor import Facts, report

    monkeypatch.delenv(FP8_FLAG_ENV, raising=False)
    monkeypatch.delenv(plan.LARGE_SHARED_MEMORY_ENV, raising=False)

    h200 = [{"name": "H200", "sm": (9, 0), "memory": 141 * 1024**3}]
    text = "\n".join(report(Facts(torch="2.13", tensorrt="10.9", gpus=h200)))
    assert "BuilderFlag.FP8 not set" in text and "at most 48 KiB" in text
    text = "\n".join(report(Facts(torch="2.13", tensorrt="11.1", gpus=h200)))
    assert "none in TensorRT 11" in text
    text = "\n".join(report(Facts(torch="2.13")))  # no TensorRT here: what 10.x would get
    assert "fp8 engines (TensorRT 10.x): BuilderFlag.FP8 not set" in text
