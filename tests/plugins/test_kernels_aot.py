"""Every plugin kernel compiles ahead of time to PTX for sm_80/89/90/100, with TensorRT's launch ABI
(STEP_GRAPH.md 4, 5).

TensorRT's AOT launch passes one pointer per input, the extra int32 scalars,
one pointer per output; Triton appends hidden scratch pointers, which
`strip_hidden_params` removes after checking they are unused. The PTX entry
must then list exactly the launch ABI. No GPU needed.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # explicit before triton is imported (default flips in 3.10)

import re  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from clover_export.core.config import CloverConfig  # noqa: E402
from clover_export.plugins.contracts import BLOCK_ATTENTION, BLOCK_GDN  # noqa: E402
from clover_export.plugins.triton import aot, launch  # noqa: E402
from clover_export.tiny import tiny_config  # noqa: E402

SMEM_LIMIT = {80: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024}  # opt-in max per block
REAL = CloverConfig(layer_types=("linear_attention",) * 3 + ("full_attention",), num_hidden_layers=4)

SYNTHETIC = """
.version 8.4
.target sm_90a
.address_size 64
.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0,
	.param .u32 k_param_1,
	.param .u64 .ptr .global .align 1 k_param_2,
	.param .u64 .ptr .global .align 1 k_param_3,
	.param .u64 .ptr .global .align 1 k_param_4
)
{
	ld.param.u64 %rd1, [k_param_0];
	ld.param.u32 %r1, [k_param_1];
	ld.param.u64 %rd2, [k_param_2];
	ret;
}
"""


def test_strip_hidden_params_removes_unused_trailing_pointers():
    ptx, hidden = aot.strip_hidden_params(SYNTHETIC, 3)
    assert [p for _, p in hidden] == ["k_param_3", "k_param_4"]
    name, params = aot.entry_params(ptx)
    assert name == "k" and params == [(".u64", "k_param_0"), (".u32", "k_param_1"), (".u64", "k_param_2")]
    assert "k_param_3" not in ptx and "k_param_2\n)" in ptx  # no dangling comma


def test_strip_hidden_params_refuses_used_or_odd_parameters():
    used = SYNTHETIC.replace("ret;", "ld.param.u64 %rd3, [k_param_4];\n\tret;")
    with pytest.raises(ValueError, match="used by the kernel"):
        aot.strip_hidden_params(used, 3)
    with pytest.raises(ValueError, match="not a scratch pointer"):
        aot.strip_hidden_params(SYNTHETIC, 1)  # param 1 is a .u32
    with pytest.raises(ValueError, match="fewer than"):
        aot.strip_hidden_params(SYNTHETIC, 6)


def test_launch_abi_is_inputs_scalars_outputs():
    assert launch.GDN_ABI.params == (tuple(t.name for t in BLOCK_GDN.inputs) + ("T", "S")
                                     + tuple(t.name for t in BLOCK_GDN.outputs))
    assert launch.ATTENTION_ABI.params == (tuple(t.name for t in BLOCK_ATTENTION.inputs) + ("T", "L", "S")
                                           + tuple(t.name for t in BLOCK_ATTENTION.outputs))
    assert launch.GDN_ABI.aliases == {"conv_pool_out": "conv_pool", "rec_pool_out": "rec_pool"}


def _check(c: aot.CompiledPTX, v: aot.Variant, arch: int):
    assert c.name == v.kernel
    assert [t for t, _ in c.params] == aot.expected_ptx_types(v.signature), v.key
    # Triton 3.5+ appends two scratch pointers (global, profile); both must have been unused and stripped
    assert [t for t, _ in c.hidden] == [".u64", ".u64"], (v.key, c.hidden)
    assert re.search(rf"^\.target sm_{arch}a?\b", c.ptx, re.M), v.key
    want = launch.PTX_VERSION[arch]
    assert re.search(rf"^\.version {want // 10}\.{want % 10}$", c.ptx, re.M), v.key
    assert 0 <= c.shared <= SMEM_LIMIT[arch], (v.key, c.shared)
    assert c.block == v.options["num_warps"] * 32


@pytest.mark.slow
def test_tiny_variants_compile_for_sm90():
    cfg = tiny_config()
    variants = aot.all_variants(cfg, 90)
    assert any(".fp8" in v.key for v in variants)
    for v in variants:
        _check(aot.compile_variant(v, 90), v, 90)


def _real_variants(arch: int) -> list[aot.Variant]:
    out = ([aot.gdn_variant(REAL), aot.attention_variant(REAL, arch=arch)] + aot.moe_variants(REAL, arch=arch)
           + aot.gdn_split_variants(REAL) + aot.attention_torch_variants(REAL, arch=arch)
           + aot.moe_shared_variants(REAL, arch=arch) + aot.attention_split_variants(REAL, arch=arch))
    if arch in launch.FP8_ARCHS:
        out += [v for v in aot.moe_variants(REAL, fp8=True, arch=arch) if ".fp8" in v.key]
    if arch == 90:  # the other dtype combinations TensorRT may ask for; the delta kernel's other dv tile
        out += aot.gdn_split_variants(REAL, bv=64)[1:]
        out += [aot.gdn_variant(REAL, "bfloat16", "float32"), aot.gdn_variant(REAL, "float32"),
                aot.attention_variant(REAL, "float32", arch=arch)]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("arch", launch.ARCHS)
def test_real_size_variants_compile(arch):
    for v in _real_variants(arch):
        _check(aot.compile_variant(v, arch), v, arch)


@pytest.mark.slow
def test_fp_fusion_is_passed_explicitly():
    """FMA contraction is chosen by launch.FP_FUSION, not by Triton's default (which flips in 3.10)."""
    v = aot.moe_variants(tiny_config())[3]  # the combine kernel: tiny and quick to compile
    default, fused, strict = (aot.compile_variant(v, 90, **kw).ptx for kw in ({}, {"fp_fusion": True},
                                                                               {"fp_fusion": False}))
    assert launch.FP_FUSION is True and default == fused
    assert "add.rn.f32" in strict and "add.rn.f32" not in fused  # .rn forbids ptxas from contracting into FMAs


def test_grids_and_sizes():
    c = launch.gdn_constexprs(16, 32, 128, 128, 4, 32)
    assert (c["DKP"], c["BV"], c["CC"], c["LOG2_CC"], c["BN"], c["KM1P"]) == (128, 64, 32, 5, 32, 4)
    assert launch.gdn_grid(8, 16) == (8, 16, 1)
    # the torch path's split form: a program per (row, head) for the conv, per (row, v-head, dv tile) for the
    # delta rule; at B = 1 the dv tile halves so the 132 SMs of an H200 get >= 128 programs
    assert launch.gdn_split_bv(1, 32, 128, 132) == 32 and launch.gdn_split_bv(8, 32, 128, 132) == 64
    split = launch.gdn_split_grids(1, launch.gdn_constexprs(16, 32, 128, 128, 4, 32, bv=32))
    assert split == {"conv": (1, 64, 1), "delta": (1, 32, 4)}
    cc = launch.gdn_conv_constexprs(launch.gdn_constexprs(2, 4, 24, 20, 3, 5))
    assert (cc["CP"], cc["RT"], cc["KM1P"]) == (32, launch.GDN_CONV_ROWS, 2)
    small = launch.gdn_constexprs(2, 4, 24, 20, 3, 5)
    assert (small["DKP"], small["BV"], small["BN"], small["KM1P"]) == (32, 32, 16, 2)
    with pytest.raises(ValueError, match="multiple"):
        launch.gdn_constexprs(3, 4, 16, 16, 4, 8)
    a = launch.attention_constexprs(16, 2, 256, 32, 256 ** -0.5, "bfloat16", 90)
    assert launch.attention_grid(1, 64, a) == (64 * 8 // 64, 2, 1)
    assert launch.attention_grid(3, 65, a, splits=4) == (9, 6, 4)
    assert launch.attention_splits(1, 64, 65536, a, 132) > 1  # batch 1, long prefix: split it
    assert launch.attention_splits(8, 544, 65536, a, 132) == 1  # enough programs already
    assert launch.attention_splits(1, 64, 1024, a, 132) == 1  # short pool: not worth a second launch
    # FlashAttention's wave rule (a bench variant): 16 programs at B = 1 -> 7 splits = 112 of 132 SMs (the
    # fewest within 85 % of the best wave efficiency); B = 8's 128 programs already fill 80 %: no split
    assert launch.attention_splits_waves(1, 64, 65536, a, 132) == 7
    assert launch.attention_splits_waves(8, 64, 65536, a, 132) == 1
    assert launch.attention_splits_waves(1, 64, 64, a, 132) == 1  # one key block: nothing to split


def test_other_compute_capabilities_get_tiles_that_fit_their_shared_memory():
    """A10/A40 (sm_86) and sm_120 have sm_89's ~99 KB of shared memory per block, not sm_90's 227 KB: they get
    sm_89's tiles and the split kernel's single stage (sm_90's two stages need 196 KB, PTX-checked), the
    MoE GEMMs sm_89's stages; Orin (sm_87) gets sm_80's."""
    for arch, like in ((86, 89), (120, 89), (87, 80), (103, 100), (75, 89)):
        assert launch.tile_arch(arch) == like
        assert launch.attention_split_launch(arch) == launch.attention_split_launch(like)
        assert launch.attention_launch(arch) == launch.attention_launch(like)
        assert launch.attention_constexprs(16, 2, 256, 32, 0.0625, "bfloat16", arch) == \
            launch.attention_constexprs(16, 2, 256, 32, 0.0625, "bfloat16", like)  # BLOCK_N 32 on sm_89
        assert launch.moe_gemm_constexprs(2048, 512, 8, 16, False, "bfloat16", arch) == \
            launch.moe_gemm_constexprs(2048, 512, 8, 16, False, "bfloat16", like)
    assert launch.attention_split_launch(86)["num_stages"] == 1
    assert [launch.tile_arch(a) for a in launch.ARCHS] == list(launch.ARCHS)
    assert launch.moe_block_m(64 * 8, 256) == 16 and launch.moe_block_m(8 * 544 * 8, 256) == 64


def test_grid_accepts_symbolic_sizes():
    """TensorRT passes shape expressions and its own cdiv; the grid rule must only use + * // and cdiv."""

    class Expr:
        def __init__(self, s):
            self.s = s

        def __mul__(self, o):
            return Expr(f"({self.s}*{o})")

        __rmul__ = __mul__

    a = launch.attention_constexprs(16, 2, 256, 32, 0.0625, "bfloat16", 90)
    g = launch.attention_grid(Expr("B"), Expr("T"), a, cdiv=lambda x, y: Expr(f"cdiv({x.s},{y})"))
    assert (g[0].s, g[1].s, g[2]) == ("cdiv((T*8),64)", "(B*2)", 1)


def _subop_variants(arch: int) -> list[aot.Variant]:
    out = aot.moe_subop_variants(REAL, arch=arch)
    if arch in launch.FP8_ARCHS:
        out += [v for v in aot.moe_subop_variants(REAL, fp8=True, arch=arch) if v.key.endswith(".fp8")]
    return out


def test_moe_subop_variants_reuse_the_routing_and_combine_kernels():
    """MoERoute and MoECombine are the CoresetMoE route / combine kernels with the same signature and sizes
    (compiled by test_real_size_variants_compile); the other sub-ops are compiled below."""
    sub = {v.key.split(".")[0]: v for v in aot.moe_subop_variants(REAL)}
    old = {v.key.split(".")[1]: v for v in aot.moe_variants(REAL)}
    for new, base in (("MoERoute", "route"), ("MoECombine", "combine")):
        assert (sub[new].kernel, list(sub[new].signature.values()), sub[new].constexprs) == (
            old[base].kernel, list(old[base].signature.values()), old[base].constexprs), new
    assert sub["MoEAlign"].signature == {"idx": "*i32", "B": "i32", "T": "i32", "offsets": "*i32", "order": "*i32"}


@pytest.mark.slow
@pytest.mark.parametrize("arch", launch.ARCHS)
def test_moe_subops_compile_for_tensorrt(arch):
    """The MoE as TensorRT AOT plugins (model.trt.onnx): align, gate_up, down (FP8 where the GPU has e4m3)."""
    vs = [v for v in _subop_variants(arch) if not v.key.startswith(("MoERoute", "MoECombine"))]
    assert len(vs) == (5 if arch in launch.FP8_ARCHS else 3)
    for v in vs:
        _check(aot.compile_variant(v, arch), v, arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch", launch.FP8_ARCHS)
def test_fp8_expert_gemms_use_fp16_dots(arch, monkeypatch):
    """FP8 experts with bf16 activations on the opt-in fp16 path (launch.FP8_F16_DOT): e4m3 widens to fp16 in
    one instruction and the MMAs take fp16; the BF16 kernels keep bf16 MMAs."""
    monkeypatch.setattr(launch, "FP8_F16_DOT", True)
    for op in ("MoEGateUpFP8", "MoEDownFP8", "MoEGateUp"):
        v = aot.moe_subop_variant(op, REAL.num_experts, REAL.num_experts_per_tok, REAL.hidden_size,
                                  REAL.moe_intermediate_size, {}, "bfloat16", arch)
        ptx = aot.compile_variant(v, arch).ptx
        mma = set(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)\S*", ptx))
        assert mma, f"{op} sm_{arch}: no MMA instruction"
        if op.endswith("FP8"):
            assert "cvt.rn.f16x2.e4m3x2" in ptx, f"{op} sm_{arch}: e4m3 not widened to fp16 directly"
            assert all(".f16.f16" in m for m in mma), f"{op} sm_{arch}: {mma}"
        else:
            assert all(".bf16.bf16" in m for m in mma), f"{op} sm_{arch}: {mma}"


@pytest.mark.slow
def test_fp8_expert_gemms_widen_to_bf16_by_default():
    """The default FP8 path (the faster one measured on the H200): e4m3 widened to bf16, bf16 MMAs."""
    v = aot.moe_subop_variant("MoEGateUpFP8", REAL.num_experts, REAL.num_experts_per_tok, REAL.hidden_size,
                              REAL.moe_intermediate_size, {}, "bfloat16", 90)
    mma = set(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)\S*", aot.compile_variant(v, 90).ptx))
    assert mma and all(".bf16.bf16" in m for m in mma), mma


@pytest.mark.slow
@pytest.mark.parametrize("arch", launch.FP8_ARCHS)
def test_w8a8_expert_gemms_feed_e4m3_to_the_mma(arch):
    """The w8a8 path exists to skip widening: its MMAs take e4m3 operands and no e4m3 -> f16/bf16 conversion is
    left (sm_90 needs the 64-row tiles of launch.moe_a8_block_m: at 16 rows Triton widens to fp16)."""
    for v in aot.moe_a8_variants(REAL, arch=arch):
        c = aot.compile_variant(v, arch)
        _check(c, v, arch)
        if "_a8" not in v.key:
            continue
        mma = set(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync|tcgen05\.mma)\S*", c.ptx))
        assert mma and all("e4m3" in m or "f8f6f4" in m for m in mma), (v.key, arch, mma)
        assert not re.search(r"cvt\.\S*(f16|bf16)\S*\.e4m3", c.ptx), (v.key, arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch", launch.ARCHS)
def test_fused_glue_compiles(arch):
    for v in aot.glue_variants(REAL):
        _check(aot.compile_variant(v, arch), v, arch)


def test_m_block_grid_covers_every_tile():
    """The M-block grid's static row count bounds the tiles of any routing (no host sync to size it)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.integers(0, 300), min_size=1, max_size=64), st.sampled_from([16, 32, 64]))
    def check(counts, bm):
        P, E = sum(counts), len(counts)
        need = sum(launch.cdiv(c, bm) for c in counts)
        assert need <= launch.moe_m_tiles(P, E, bm)
        gu, dn, _ = launch.moe_gemm_constexprs(64, 32, 1, bm, False, "bfloat16")
        gu, dn = launch.moe_m_grid(gu, dn, E)
        assert launch.moe_grids(E, 1, P, gu, dn)["gate_up"][0] == launch.moe_m_tiles(P, E, bm)

    check()


def test_shared_expert_joins_the_grouped_gemms_where_it_can():
    """The triton backend runs the shared expert as expert E of the grouped GEMMs (ops.moe_block) when it has the
    routed experts' width and dtype: Clover-35B-A3B yes; FP8 experts or the tiny default (64 vs 32) no."""
    import torch

    from clover_export.backends.fp8_experts import Fp8Experts
    from clover_export.backends.triton_backend import KernelMoE, kernel_cores
    from clover_export.plugins.triton import ops

    assert REAL.moe_intermediate_size == REAL.shared_expert_intermediate_size == 512
    assert kernel_cores(KernelMoE(None), REAL).moe_block is not None
    assert kernel_cores(KernelMoE(Fp8Experts()), REAL).moe_block is None
    assert kernel_cores(KernelMoE(None), tiny_config()).moe_block is None
    assert kernel_cores(KernelMoE(None)).moe_block is None
    x, idx, w = torch.zeros(1, 2, 8), torch.zeros(1, 2, 1, dtype=torch.int32), torch.ones(1, 2, 1)
    gu, dn = torch.zeros(3, 8, 8), torch.zeros(3, 8, 4)
    bad = {"width": (torch.zeros(8, 8), torch.zeros(8, 8), torch.zeros(8, 8), w[..., 0]),
           "dtype": (torch.zeros(4, 8).half(), torch.zeros(4, 8), torch.zeros(8, 4), w[..., 0])}
    for what, shared in bad.items():
        with pytest.raises(ValueError, match="shared expert"):
            ops.moe_experts(x, idx, w, gu, dn, shared=shared)


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 90])  # mma.sync and wgmma tiles (the others follow the same steps)
def test_tensorrt_kernels_fit_the_default_shared_memory(arch):
    """Without the user's opt-in every kernel TensorRT launches from PTX needs at most 48 KiB of shared memory per
    block (TensorRT's AOT launch is not known to opt kernels into more, docs/tensorrt.md). At Clover-35B-A3B sizes
    the default tiles of GDN, attention and the expert GEMMs need more on sm_90 (72, 192 and 108 KiB), so
    aot.fit_shared_memory shrinks them; the kernel and its launch ABI stay the same."""
    from clover_export.plugins.trt.plan import aot_shared_budget

    budget = aot_shared_budget(arch, {})
    assert budget == 48 * 1024
    shrunk = []
    for v in aot.trt_variants(REAL, arch):
        fitted, c = aot.fit_shared_memory(v, arch, budget)
        _check(c, fitted, arch)
        assert c.shared <= budget and (fitted.kernel, fitted.signature) == (v.kernel, v.signature), v.key
        if fitted != v:
            shrunk.append(v.key)
    if arch == 90:
        assert {"BlockGDN.bf16.pbf16", "BlockAttention.bf16", "BlockAttentionSplit.bf16", "MoEGateUp.bf16",
                "MoEDown.bf16", "MoEGateUpFP8.bf16.fp8"} <= set(shrunk), shrunk
