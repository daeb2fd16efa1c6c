"""Ahead-of-time PTX of the plugin kernels, without a GPU (STEP_GRAPH.md 4, 5).

`triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))` gives
PTX for any architecture on a CPU machine. TensorRT's AOT plugin launch
passes exactly: one pointer per input, the extra int32 scalars, one pointer
per output. Triton (>= 3.3) appends hidden parameters after those: a global
scratch pointer and (>= 3.5) a profiler scratch pointer. Our kernels use no
scratch (checked: metadata sizes 0 and the parameters never loaded), so
`strip_hidden_params` removes them from the `.entry` and the PTX then takes
exactly TensorRT's argument list; `entry_params` reads the list back for
the tests and the GPU check.

Command line: `python -m clover_export.plugins.triton.aot --out DIR` writes
every variant's PTX and a manifest.json (launch ABI, grid rule, shared memory).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from clover_export.plugins.triton import launch

_ENTRY = re.compile(r"\.visible\s+\.entry\s+([A-Za-z_$][\w$]*)\s*\((.*?)\)", re.S)
_PARAM = re.compile(r"\.param\s+(\.\w+)(?:\s+\.ptr)?(?:\s+\.global)?(?:\s+\.align\s+\d+)?\s+([\w$]+)")


@dataclass(frozen=True)
class Variant:
    """One kernel specialisation: what `triton.compile` needs plus the expected runtime parameters."""

    key: str  # e.g. "BlockGDN.bf16"
    module: str
    kernel: str
    signature: dict[str, str]  # runtime params in launch order -> Triton type
    constexprs: dict[str, object]
    options: dict[str, int] = field(default_factory=dict)  # num_warps, num_stages
    grid: str = ""  # human-readable grid rule (launch.py computes it)

    @property
    def params(self) -> list[str]:
        return list(self.signature)


@dataclass
class CompiledPTX:
    key: str
    arch: int
    name: str
    ptx: str  # hidden parameters stripped
    params: list[tuple[str, str]]  # (ptx type, ptx name) of the stripped entry
    hidden: list[tuple[str, str]]  # what was stripped
    shared: int
    num_warps: int

    @property
    def block(self) -> int:
        return self.num_warps * 32

    def manifest(self) -> dict:
        d = asdict(self)
        d.pop("ptx")
        return d


def entry_params(ptx: str) -> tuple[str, list[tuple[str, str]]]:
    """(kernel name, [(type, name)]) of the single `.entry` of a PTX module."""
    found = _ENTRY.findall(ptx)
    if len(found) != 1:
        raise ValueError(f"expected one .entry in the PTX, found {len(found)}")
    name, body = found[0]
    return name, [(m.group(1), m.group(2)) for m in _PARAM.finditer(body)]


def _param_used(ptx: str, pname: str) -> bool:
    body = ptx[_ENTRY.search(ptx).end():]
    return re.search(r"\[\s*" + re.escape(pname) + r"\s*(\+\s*\d+\s*)?\]", body) is not None


def strip_hidden_params(ptx: str, n_user: int) -> tuple[str, list[tuple[str, str]]]:
    """Drop the entry parameters after the first `n_user` (Triton's scratch pointers); they must be unused."""
    name, params = entry_params(ptx)
    if len(params) < n_user:
        raise ValueError(f"{name}: PTX entry has {len(params)} parameters, fewer than the {n_user} of the launch ABI")
    hidden = params[n_user:]
    for typ, pname in hidden:
        if typ != ".u64":
            raise ValueError(f"{name}: unexpected trailing parameter {typ} {pname} (not a scratch pointer)")
        if _param_used(ptx, pname):
            raise ValueError(f"{name}: hidden parameter {pname} is used by the kernel (it needs scratch memory)")
    if not hidden:
        return ptx, []
    m = _ENTRY.search(ptx)
    lines = [ln for ln in m.group(2).split("\n") if ln.strip()]
    keep = [ln for ln in lines if not any(re.search(r"\b" + re.escape(p) + r"\b", ln) for _, p in hidden)]
    keep[-1] = keep[-1].rstrip().rstrip(",")
    new_head = ptx[m.start():m.start(2)] + "\n" + "\n".join(keep) + "\n"
    return ptx[:m.start()] + new_head + ptx[m.end(2):], hidden


def expected_ptx_types(signature: dict[str, str]) -> list[str]:
    return [".u64" if t.startswith("*") else ".f32" if t == "fp32" else ".u32" for t in signature.values()]


def compile_variant(v: Variant, arch: int, fp_fusion: bool = launch.FP_FUSION) -> CompiledPTX:
    """PTX for one variant and GPU architecture (e.g. 90), hidden parameters stripped, ABI checked."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(f"clover_export.plugins.triton.{v.module}"), v.kernel)
    runtime = [p.name for p in fn.params if not p.is_constexpr]
    if len(runtime) != len(v.signature):
        raise ValueError(
            f"{v.key}: kernel {v.kernel} takes {len(runtime)} runtime parameters, the ABI lists {len(v.signature)}"
        )
    sig = dict(zip(runtime, v.signature.values()))  # ABI names -> the kernel's own parameter names, by position
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs=dict(v.constexprs), attrs=attrs)
    opts = dict(v.options, enable_fp_fusion=fp_fusion, ptx_version=launch.PTX_VERSION.get(arch, 84))
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
    md = compiled.metadata
    for what in ("global_scratch_size", "profile_scratch_size"):
        if getattr(md, what, 0):
            raise ValueError(f"{v.key} sm_{arch}: needs {what}={getattr(md, what)} (TensorRT passes no scratch)")
    ptx, hidden = strip_hidden_params(compiled.asm["ptx"], len(v.signature))
    name, params = entry_params(ptx)
    got = [t for t, _ in params]
    want = expected_ptx_types(v.signature)
    if got != want:
        raise ValueError(f"{v.key} sm_{arch}: PTX entry types {got} != launch ABI {want}")
    return CompiledPTX(v.key, arch, name, ptx, params, hidden, int(md.shared), int(md.num_warps))


def fit_shared_memory(v: Variant, arch: int, budget: int | None) -> tuple[Variant, CompiledPTX]:
    """`v`, or the first of its smaller configurations (`launch.smaller_tiles`) whose PTX needs at most `budget`
    bytes of shared memory per block (None: any), with that PTX. Raises ValueError when even the smallest needs
    more. Same kernel and launch ABI: only constexprs and launch options change (and the grid with them)."""
    key = json.dumps([v.key, v.kernel, v.constexprs, v.options, arch, budget], sort_keys=True, default=str)
    if key in _FITTED:
        return _FITTED[key]
    while True:
        c = compile_variant(v, arch)
        if budget is None or c.shared <= budget:
            _FITTED[key] = v, c
            return v, c
        smaller = launch.smaller_tiles(v.kernel, v.constexprs, v.options)
        if smaller is None:
            raise ValueError(f"{v.key} sm_{arch}: {c.shared} bytes of shared memory per block at its smallest tiles, "
                             f"over the {budget} allowed (docs/tensorrt.md, shared memory)")
        v = Variant(v.key, v.module, v.kernel, v.signature, smaller[0], smaller[1], v.grid)


_FITTED: dict[str, tuple[Variant, CompiledPTX]] = {}  # per process: TensorRT asks once per layer and tactic


# ------------------------------------------------------------------ variants
def _dt(name: str) -> str:
    return launch.TRITON_TYPES[name]


def gdn_variant(cfg, dtype: str = "bfloat16", param_dtype: str | None = None, block_size: int | None = None,
                **kw) -> Variant:
    """BlockGDN for a config (`CloverConfig`-like: linear_* sizes); params (A_log, ...) default to `dtype`."""
    n = cfg.block_size if block_size is None else block_size
    return gdn_variant_for(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                           cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, n, dtype, param_dtype, **kw)


def gdn_variant_for(hk: int, hv: int, dk: int, dv: int, kconv: int, block_size: int, dtype: str = "bfloat16",
                    param_dtype: str | None = None, **kw) -> Variant:
    kw.setdefault("dot_precision", launch.gdn_dot_precision(dtype))
    consts = launch.gdn_constexprs(hk, hv, dk, dv, kconv, block_size, **kw)
    p = param_dtype or dtype
    dtypes = {t: dtype for t in launch.GDN_ABI.inputs + launch.GDN_ABI.outputs}
    dtypes.update({name: p for name in launch.GDN_PARAMS})
    dtypes.update({"rec_pool": "float32", "rec_pool_out": "float32", "slot_ids": "int32", "n_causal": "int32"})
    return Variant(f"BlockGDN.{_dt(dtype)}.p{_dt(p)}", "gdn", launch.GDN_ABI.kernel, launch.GDN_ABI.signature(dtypes),
                   consts, launch.gdn_launch(consts), "(B, Hk, 1)")


def gdn_split_variants(cfg, dtype: str = "bfloat16", block_size: int | None = None, bv: int = 32) -> list[Variant]:
    """The torch path's two-launch BlockGDN (ops.block_gdn split=True): conv kernel, delta-rule kernel."""
    n = cfg.block_size if block_size is None else block_size
    consts = launch.gdn_constexprs(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                   cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, n, bv=bv,
                                   dot_precision=launch.gdn_dot_precision(dtype))
    cc = launch.gdn_conv_constexprs(consts)
    a = _dt(dtype)
    conv = {"mixed_qkv": f"*{a}", "conv_w": f"*{a}", "conv_w_right": f"*{a}", "conv_pool": f"*{a}",
            "slot_ids": "*i32", "n_causal": "*i32", "T": "i32", "act": "*fp32", "conv_pool_out": f"*{a}"}
    delta = {"act": "*fp32", "a": f"*{a}", "b": f"*{a}", "A_log": f"*{a}", "dt_bias": f"*{a}", "block_scale": f"*{a}",
             "block_gate": f"*{a}", "rec_pool": "*fp32", "slot_ids": "*i32", "n_causal": "*i32", "T": "i32",
             "o": f"*{a}", "rec_pool_out": "*fp32"}
    return [Variant(f"BlockGDN.conv.{a}", "gdn", "gdn_conv_kernel", conv, cc, launch.gdn_conv_launch(cc),
                    "(B, 2 Hk + Hv, 1)"),
            Variant(f"BlockGDN.delta.{a}.bv{bv}", "gdn", "gdn_delta_kernel", delta, consts, launch.gdn_launch(consts),
                    "(B, Hv, cdiv(dv, BV))")]


def attention_variant(cfg, dtype: str = "bfloat16", block_size: int | None = None, arch: int = 90) -> Variant:
    n = cfg.block_size if block_size is None else block_size
    return attention_variant_for(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, n,
                                 cfg.head_dim ** -0.5, dtype, arch)


def attention_variant_for(h: int, hkv: int, hd: int, block_size: int, scale: float, dtype: str = "bfloat16",
                          arch: int = 90) -> Variant:
    consts = launch.attention_constexprs(h, hkv, hd, block_size, scale, dtype, arch)
    dtypes = {t: dtype for t in launch.ATTENTION_ABI.inputs + launch.ATTENTION_ABI.outputs}
    dtypes.update({"slot_ids": "int32", "past_len": "int32", "n_causal": "int32"})
    return Variant(f"BlockAttention.{_dt(dtype)}", "attention", launch.ATTENTION_ABI.kernel,
                   launch.ATTENTION_ABI.signature(dtypes), consts, launch.attention_launch(arch, dtype),
                   "(cdiv(T * H/Hkv, BLOCK_M), B * Hkv, 1)")


def attention_split_variants_for(h: int, hkv: int, hd: int, block_size: int, scale: float,
                                 dtype: str = "bfloat16", arch: int = 90) -> list[Variant]:
    """BlockAttention's split-KV form as TensorRT runs it (`clover::BlockAttentionSplit` + `BlockAttentionMerge`,
    the one-kernel form's tiles; split count = the grid's third dimension, from the shapes at run time)."""
    from clover_export.plugins.contracts import BLOCK_ATTENTION_SPLIT

    consts = launch.attention_constexprs(h, hkv, hd, block_size, scale, dtype, arch)
    split = launch.ATTENTION_SPLIT_ABI
    return [
        Variant(f"BlockAttentionSplit.{_dt(dtype)}", "attention", split.kernel,
                split.signature(launch.io_dtypes(BLOCK_ATTENTION_SPLIT, dtype)), consts,
                launch.attention_split_launch(arch, dtype),
                "(cdiv(T * H/Hkv, BLOCK_M), B * Hkv, splits)"),
        attention_merge_variant(h, hd, dtype),
    ]


def attention_merge_variant(h: int, hd: int, dtype: str = "bfloat16") -> Variant:
    from clover_export.plugins.contracts import BLOCK_ATTENTION_MERGE

    merge = launch.ATTENTION_MERGE_ABI
    return Variant(
        f"BlockAttentionMerge.{_dt(dtype)}",
        "attention",
        merge.kernel,
        merge.signature(launch.io_dtypes(BLOCK_ATTENTION_MERGE, dtype)),
        launch.attention_merge_constexprs(h, hd),
        dict(launch.ATTENTION_MERGE_LAUNCH),
        "(cdiv(T * H, BLOCK_R), B, 1)",
    )


def attention_split_variants(cfg, dtype: str = "bfloat16", arch: int = 90) -> list[Variant]:
    return attention_split_variants_for(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                        cfg.block_size, cfg.head_dim ** -0.5, dtype, arch)


def attention_torch_variants(cfg, dtype: str = "bfloat16", arch: int = 90) -> list[Variant]:
    """The torch path's BlockAttention (ops.block_attention kv_first=True): write_kv, then the pool-only pass."""
    v = attention_variant(cfg, dtype, arch=arch)
    a, c = _dt(dtype), v.constexprs
    write = Variant(f"BlockAttention.write_kv.{a}", "attention", "write_kv_kernel",
                    {"k": f"*{a}", "v": f"*{a}", "slot_ids": "*i32", "past_len": "*i32", "n_causal": "*i32", "T": "i32",
                     "L": "i32", "key_pool_out": f"*{a}", "value_pool_out": f"*{a}"},
                    dict(HKV=c["HKV"], HD=c["HD"], HDP=c["HDP"], BLOCK_N=c["BLOCK_N"]), launch.MOE_SMALL_LAUNCH,
                    "(B * Hkv, 1, 1)")
    split = attention_split_variants(cfg, dtype, arch)[0]
    return [write, Variant(f"BlockAttention.kv_first.{a}", v.module, v.kernel, v.signature,
                           dict(c, KV_FIRST=True), v.options, v.grid),
            Variant(f"BlockAttention.split_kv_first.{a}", split.module, split.kernel, split.signature,
                    dict(split.constexprs, KV_FIRST=True), split.options, split.grid)]


def moe_variants(cfg, dtype: str = "bfloat16", fp8: bool = False, block_size: int | None = None,
                 arch: int = 90, block_m: int = 16) -> list[Variant]:
    """The CoresetMoE kernels (the op is several launches: TensorRT runs it through its JIT path)."""
    n = cfg.block_size if block_size is None else block_size
    a, w = _dt(dtype), ("fp8e4nv" if fp8 else _dt(dtype))
    tag = f"{a}.{'fp8' if fp8 else a}"
    rc = launch.moe_route_constexprs(cfg.num_experts, cfg.num_experts_per_tok, n, cfg.moe_block_coreset_top_p,
                                     cfg.moe_block_coreset_enabled)
    gu, dn, opts = launch.moe_gemm_constexprs(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok,
                                              block_m, fp8, dtype, arch)
    return [
        Variant(f"CoresetMoE.route.{a}", "moe", "moe_route_kernel",
                {"logits": f"*{a}", "T": "i32", "idx": "*i32", "w": f"*{a}", "distinct": "*i32"}, rc,
                launch.MOE_ROUTE_LAUNCH, "(B, 1 + cdiv(T - N, BT), 1)"),
        Variant(f"CoresetMoE.gate_up.{tag}", "moe", "moe_gate_up_kernel",
                {"x": f"*{a}", "gate_up": f"*{w}", "gate_up_scale": "*fp32", "offsets": "*i32", "order": "*i32",
                 **_PAIR_SCALARS, "h": f"*{a}"}, gu, opts, "(E, cdiv(I, BLOCK_N), 1)"),
        Variant(f"CoresetMoE.down.{tag}", "moe", "moe_down_kernel",
                {"h": f"*{a}", "down": f"*{w}", "down_scale": "*fp32", "w": f"*{a}", "offsets": "*i32",
                 "order": "*i32", **_PAIR_SCALARS, "y": f"*{a}"}, dn, opts, "(E, cdiv(D, BLOCK_N), 1)"),
        Variant(f"CoresetMoE.combine.{a}", "moe", "moe_combine_kernel",
                {"y": f"*{a}", "idx": "*i32", "out": f"*{a}"},
                launch.moe_combine_constexprs(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok),
                launch.MOE_SMALL_LAUNCH, "(B*T, cdiv(D, 256), 1)"),
        Variant("CoresetMoE.count", "moe", "moe_count_kernel",
                {"idx": "*i32", "P": "i32", "counts": "*i32", "rank": "*i32"},
                dict(E=cfg.num_experts, BLOCK=launch.MOE_ALIGN_BLOCK), launch.MOE_SMALL_LAUNCH,
                "(cdiv(P, BLOCK), 1, 1)"),
        Variant("CoresetMoE.place", "moe", "moe_place_kernel", _PLACE_SIG, launch.moe_place_constexprs(cfg.num_experts),
                launch.MOE_SMALL_LAUNCH, "(cdiv(P, BLOCK), 1, 1)"),
    ]


_PAIR_SCALARS = {"B": "i32", "T": "i32"}  # the expert GEMMs' bound on the pair indices they read (moe._pair_range)
_PLACE_SIG = {"idx": "*i32", "P": "i32", "R": "i32", "counts": "*i32", "rank": "*i32", "offsets": "*i32",
              "order": "*i32"}


def moe_shared_variants(cfg, dtype: str = "bfloat16", arch: int = 90, pairs: int = 4096) -> list[Variant]:
    """The torch path's MoE block with the shared expert as expert E of the grouped GEMMs (ops.moe_block):
    place (its segment), gate_up / down on the M-block grid, combine (its row)."""
    a = _dt(dtype)
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    rows = pairs // K
    block_m = launch.moe_block_m(pairs + rows, E + 1)
    gu, dn, opts = launch.moe_gemm_constexprs(cfg.hidden_size, cfg.moe_intermediate_size, K, block_m, False, dtype,
                                              arch)
    gu, dn = launch.moe_m_grid(gu, dn, E + 1)
    return [
        Variant("CoresetMoE.place_shared", "moe", "moe_place_kernel", _PLACE_SIG,
                launch.moe_place_constexprs(E, shared=True), launch.MOE_SMALL_LAUNCH, "(cdiv(P, BLOCK), 1, 1)"),
        Variant(f"CoresetMoE.gate_up_shared.{a}", "moe", "moe_gate_up_shared_kernel",
                {"x": f"*{a}", "gate_up": f"*{a}", "shared_gate": f"*{a}", "shared_up": f"*{a}", "offsets": "*i32",
                 "order": "*i32", **_PAIR_SCALARS, "h": f"*{a}"}, gu, opts, "(M tiles, cdiv(I, BLOCK_N), 1)"),
        Variant(f"CoresetMoE.down_shared.{a}", "moe", "moe_down_shared_kernel",
                {"h": f"*{a}", "down": f"*{a}", "shared_down": f"*{a}", "w": f"*{a}", "offsets": "*i32",
                 "order": "*i32", **_PAIR_SCALARS, "y": f"*{a}"}, dn, opts, "(M tiles, cdiv(D, BLOCK_N), 1)"),
        Variant(f"CoresetMoE.combine_shared.{a}", "moe", "moe_combine_kernel",
                {"y": f"*{a}", "idx": "*i32", "out": f"*{a}"},
                launch.moe_combine_constexprs(cfg.hidden_size, E, K, shared=True), launch.MOE_SMALL_LAUNCH,
                "(B*T, cdiv(D, 256), 1)"),
    ]


def moe_a8_variants(cfg, dtype: str = "bfloat16", arch: int = 90, pairs: int = 4096) -> list[Variant]:
    """The torch path's w8a8 FP8 experts (launch.moe_w8a8): activation quantizer, then e4m3 x e4m3 GEMMs on the
    M-block grid (tiles for `pairs` routed pairs: B = 8 commit+denoise by default)."""
    a = _dt(dtype)
    block_m = launch.moe_a8_block_m(pairs, cfg.num_experts, arch)
    gu, dn, opts = launch.moe_gemm_constexprs(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok,
                                              block_m, True, dtype, arch)
    gu, dn = launch.moe_m_grid(gu, dn, cfg.num_experts)
    out = []
    for what, width in (("x", cfg.hidden_size), ("h", cfg.moe_intermediate_size)):
        c, o = launch.row_tiles(width)
        out.append(Variant(f"CoresetMoE.act_quant_{what}.{a}", "moe", "act_quant_kernel",
                           {"x": f"*{a}", "xq": "*fp8e4nv", "xs": "*fp32", "R": "i32"}, dict(c, D=width), o,
                           "(cdiv(R, ROWS), 1, 1)"))
    out += [
        Variant(f"CoresetMoE.gate_up_a8.{a}.fp8", "moe", "moe_gate_up_a8_kernel",
                {"xq": "*fp8e4nv", "xs": "*fp32", "gate_up": "*fp8e4nv", "gate_up_scale": "*fp32", "offsets": "*i32",
                 "order": "*i32", **_PAIR_SCALARS, "h": f"*{a}"}, gu, opts, "(M tiles, cdiv(I, BLOCK_N), 1)"),
        Variant(f"CoresetMoE.down_a8.{a}.fp8", "moe", "moe_down_a8_kernel",
                {"hq": "*fp8e4nv", "hs": "*fp32", "down": "*fp8e4nv", "down_scale": "*fp32", "w": f"*{a}",
                 "offsets": "*i32", "order": "*i32", **_PAIR_SCALARS, "y": f"*{a}"}, dn, opts,
                "(M tiles, cdiv(D, BLOCK_N), 1)"),
    ]
    return out


def glue_variants(cfg, dtype: str = "bfloat16") -> list[Variant]:
    """The torch path's fused glue (norms.py) at the config's row widths."""
    a = _dt(dtype)
    tiles = launch.row_tiles
    out = []
    for res in (False, True):
        c, o = tiles(cfg.hidden_size)
        out.append(Variant(f"Glue.{'add_' if res else ''}rms_norm.{a}", "norms", "rms_norm_kernel",
                           {"x": f"*{a}", "r": f"*{a}", "w": f"*{a}", "y": f"*{a}", "s": f"*{a}", "R": "i32",
                            "x_stride": "i32", "r_stride": "i32", "eps": "fp32"},
                           dict(c, D=cfg.hidden_size, HAS_RES=res), o, "(cdiv(R, ROWS), 1, 1)"))
    c, o = tiles(cfg.head_dim)
    out.append(Variant(f"Glue.norm_rope.{a}", "norms", "norm_rope_kernel",
                       {"x": f"*{a}", "w": f"*{a}", "cos": f"*{a}", "sin": f"*{a}", "y": f"*{a}", "R": "i32",
                        "x_stride": "i32", "H": "i32", "eps": "fp32"},
                       dict(c, D=cfg.head_dim, ROT=cfg.rotary_dim), o, "(cdiv(R, ROWS), 1, 1)"))
    c, o = tiles(cfg.linear_value_head_dim)
    out.append(Variant(f"Glue.gated_rms_norm.{a}", "norms", "gated_rms_norm_kernel",
                       {"o": f"*{a}", "z": f"*{a}", "w": f"*{a}", "y": f"*{a}", "R": "i32", "eps": "fp32"},
                       dict(c, D=cfg.linear_value_head_dim), o, "(cdiv(R, ROWS), 1, 1)"))
    c, o = tiles(cfg.head_dim)
    out.append(Variant(f"Glue.sigmoid_gate.{a}", "norms", "sigmoid_gate_kernel",
                       {"o": f"*{a}", "g": f"*{a}", "y": f"*{a}", "R": "i32", "g_stride": "i32"},
                       dict(c, D=cfg.head_dim), o, "(cdiv(R, ROWS), 1, 1)"))
    c, o = tiles(cfg.shared_expert_intermediate_size)
    out.append(Variant(f"Glue.swiglu.{a}", "norms", "swiglu_kernel",
                       {"g": f"*{a}", "u": f"*{a}", "y": f"*{a}", "R": "i32"},
                       dict(c, D=cfg.shared_expert_intermediate_size), o, "(cdiv(R, ROWS), 1, 1)"))
    c, o = tiles(cfg.hidden_size)
    out.append(Variant(f"Glue.gated_residual.{a}", "norms", "gated_residual_kernel",
                       {"r": f"*{a}", "sg": f"*{a}", "s": f"*{a}", "y": f"*{a}", "R": "i32"},
                       dict(c, D=cfg.hidden_size), o, "(cdiv(R, ROWS), 1, 1)"))
    return out


def moe_subop_variant(op: str, num_experts: int, top_k: int, hidden: int, inter: int, attrs: dict,
                      dtype: str = "bfloat16", arch: int = 90) -> Variant:
    """One MoE sub-op of `model.trt.onnx` (contracts.MOE_SUBOPS) as a TensorRT AOT kernel.

    attrs: the routing attributes (top_p, coreset, block_size) for MoERoute; ignored otherwise.
    """
    from clover_export.plugins.contracts import MOE_SUBOPS

    abi = launch.MOE_SUBOP_ABIS[op]
    fp8 = op.endswith("FP8")
    if op == "MoERoute":
        consts = launch.moe_route_constexprs(num_experts, top_k, int(attrs["block_size"]), float(attrs["top_p"]),
                                             bool(attrs["coreset"]))
        opts = launch.MOE_ROUTE_LAUNCH
    elif op == "MoEAlign":
        consts, opts = launch.moe_align_constexprs(num_experts, top_k), launch.MOE_ALIGN_LAUNCH
    elif op == "MoECombine":
        consts, opts = launch.moe_combine_constexprs(hidden, num_experts, top_k), launch.MOE_SMALL_LAUNCH
    else:
        gu, dn, opts = launch.moe_gemm_constexprs(hidden, inter, top_k, launch.MOE_AOT_BLOCK_M, fp8, dtype, arch)
        consts = gu if "GateUp" in op else dn
    sig = abi.signature(launch.io_dtypes(MOE_SUBOPS[op], dtype))
    tag = _dt(dtype) + (".fp8" if fp8 else "")
    return Variant(f"{op}.{tag}", abi.module, abi.kernel, sig, consts, dict(opts), op)


def moe_subop_variants(cfg, dtype: str = "bfloat16", fp8: bool = False, block_size: int | None = None,
                       arch: int = 90) -> list[Variant]:
    """The five kernels of one CoresetMoE(FP8) on TensorRT: route, align, gate_up, down, combine."""
    n = cfg.block_size if block_size is None else block_size
    attrs = dict(top_p=cfg.moe_block_coreset_top_p, coreset=cfg.moe_block_coreset_enabled, block_size=n)
    ops = ["MoERoute", "MoEAlign", "MoEGateUpFP8" if fp8 else "MoEGateUp", "MoEDownFP8" if fp8 else "MoEDown",
           "MoECombine"]
    return [moe_subop_variant(op, cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                              cfg.moe_intermediate_size, attrs, dtype, arch) for op in ops]


def trt_variants(cfg, arch: int) -> list[Variant]:
    """Every kernel TensorRT launches from PTX for a BF16 (and, where the GPU has e4m3, FP8) engine."""
    out = ([gdn_variant(cfg, "bfloat16"), gdn_variant(cfg, "bfloat16", "float32"),
            attention_variant(cfg, "bfloat16", arch=arch)] + attention_split_variants(cfg, "bfloat16", arch)
           + moe_subop_variants(cfg, "bfloat16", arch=arch))
    if arch in launch.FP8_ARCHS:
        out += [v for v in moe_subop_variants(cfg, "bfloat16", True, arch=arch) if v.key.endswith(".fp8")]
    return out


def all_variants(cfg, arch: int) -> list[Variant]:
    out = (trt_variants(cfg, arch) + moe_variants(cfg, "bfloat16", False, arch=arch) + gdn_split_variants(cfg)
           + glue_variants(cfg) + attention_torch_variants(cfg, arch=arch) + moe_shared_variants(cfg, arch=arch))
    if arch in launch.FP8_ARCHS:
        out += [v for v in moe_variants(cfg, "bfloat16", True, arch=arch) if ".fp8" in v.key]
        out += moe_a8_variants(cfg, arch=arch)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Write the plugin kernels' AOT PTX (hidden params stripped) and a manifest."
    )
    ap.add_argument("--out", required=True, type=Path, help="output folder")
    ap.add_argument("--arch", type=int, action="append", help="SM architecture(s), e.g. 90 (default: all supported)")
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny config instead of Clover-35B-A3B sizes")
    ap.add_argument(
        "--trt-only", action="store_true", help="only the kernels TensorRT launches from PTX (model.trt.onnx)"
    )
    args = ap.parse_args(argv)
    from clover_export.core.config import CloverConfig

    if args.tiny:
        from clover_export.tiny import tiny_config
        cfg = tiny_config()
    else:
        cfg = CloverConfig(layer_types=("linear_attention",) * 3 + ("full_attention",), num_hidden_layers=4)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = []
    for arch in args.arch or launch.ARCHS:
        for v in (trt_variants(cfg, arch) if args.trt_only else all_variants(cfg, arch)):
            c = compile_variant(v, arch)
            fname = f"{v.key}.sm{arch}.ptx"
            tmp = args.out / (fname + ".tmp")
            tmp.write_text(c.ptx)
            tmp.replace(args.out / fname)
            manifest.append(dict(c.manifest(), file=fname, signature=v.signature, constexprs=v.constexprs,
                                 options=v.options, grid=v.grid))
            print(f"sm_{arch} {v.key}: {c.name} params={len(c.params)} stripped={len(c.hidden)} shared={c.shared}")
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
