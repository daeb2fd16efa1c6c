"""Every launch decision of the plugin kernels, as plain functions (STEP_GRAPH.md 4, 5).

No torch, triton or tensorrt import: the torch wrappers (`ops.py`), the AOT
compiler (`aot.py`) and the TensorRT registration (`plugins/trt`) all read
these, so the grid, the kernel argument list and the compile-time sizes have
one definition, tested without a GPU.

Kernel ABI (what TensorRT's AOT launch passes, in order): one pointer per
op input, then int32 scalars taken from input dimensions, then one pointer
per op output. Aliased outputs (the cache pools) get their own pointer; on
TensorRT and in the torch in-place path it is the input's buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from clover_export.plugins.contracts import (
    BLOCK_ATTENTION,
    BLOCK_ATTENTION_MERGE,
    BLOCK_ATTENTION_SPLIT,
    BLOCK_GDN,
    MOE_ALIGN,
    MOE_COMBINE,
    MOE_DOWN,
    MOE_DOWN_FP8,
    MOE_GATE_UP,
    MOE_GATE_UP_FP8,
    MOE_ROUTE,
    OpContract,
)

# dtype spellings: contract / torch name -> Triton signature type
TRITON_TYPES = {
    "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int32": "i32",
    "float8_e4m3fn": "fp8e4nv",
}
FP_FUSION = True  # passed explicitly to every AOT compile (Triton 3.10 flips the default)
PTX_VERSION = {80: 84, 89: 84, 90: 84, 100: 86}  # PTX ISA per target: 8.4 needs a CUDA 12.4+ driver, 8.6 (sm_100) 12.8+
ARCHS = (80, 89, 90, 100)
FP8_ARCHS = (89, 90, 100)  # e4m3 in hardware from Ada on
# other compute capabilities -> the ARCHS entry with as much shared memory per block (A10/A40 sm_86 and
# consumer/workstation Blackwell sm_120/121: ~99 KB as sm_89; Orin sm_87: 164 KB as sm_80; sm_103 as sm_100)
SAME_SHARED_MEMORY = {86: 89, 87: 80, 103: 100, 120: 89, 121: 89}


def tile_arch(arch: int) -> int:
    """The tile tables' column for a compute capability (unknown ones get the smallest shared memory, sm_89's)."""
    return arch if arch in ARCHS else SAME_SHARED_MEMORY.get(arch, 89)


# Dynamic shared memory per block: a kernel launched without cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_
# SHARED_SIZE_BYTES) may use 48 KiB; beyond that only after that opt-in, up to the GPU's per-block maximum
# (CUDA programming guide, compute capabilities table). Triton's own launcher opts in; whether TensorRT's AOT
# plugin launch does is not in its public sources (docs/tensorrt.md), so TensorRT's kernels keep to the default.
DEFAULT_SHARED_BYTES = 48 * 1024
OPTIN_SHARED_BYTES = {80: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024}
_MOE_GEMMS = ("moe_gate_up_kernel", "moe_gate_up_plain_kernel", "moe_gate_up_shared_kernel", "moe_gate_up_a8_kernel",
              "moe_down_kernel", "moe_down_plain_kernel", "moe_down_shared_kernel", "moe_down_a8_kernel")


def smaller_tiles(kernel: str, consts: dict, options: dict) -> tuple[dict, dict] | None:
    """The next configuration of `kernel` to try when its PTX needs more shared memory than allowed
    (`aot.fit_shared_memory`), or None when there is none: one pipelining stage fewer while there are several
    (each stage buffers every tile), then the largest of the tiles that size the buffers halved, down to 16
    (tl.dot's minimum; the first listed on ties): GDN's state columns BV and chunk rows CC, attention's key
    block BLOCK_N and query block BLOCK_M, the expert GEMMs' BLOCK_K and BLOCK_N. Grids follow the constexprs
    (plan.aot_plan)."""
    if options.get("num_stages", 1) > 1:
        return consts, dict(options, num_stages=options["num_stages"] - 1)
    tiles = {"block_gdn_kernel": ("BV", "CC"), "block_attention_kernel": ("BLOCK_N", "BLOCK_M"),
             "block_attention_split_kernel": ("BLOCK_N", "BLOCK_M")}.get(kernel)
    if tiles is None and kernel in _MOE_GEMMS:
        tiles = ("BLOCK_K", "BLOCK_N")
    name = max((t for t in tiles or () if consts[t] > 16), key=lambda t: consts[t], default=None)
    if name is None:
        return None
    c = dict(consts, **{name: consts[name] // 2})
    if name == "CC":
        c["LOG2_CC"] = consts["LOG2_CC"] - 1
    if name == "BLOCK_M" and c[name] <= 32:  # a 32-row query tile keeps 4 warps busy, not 8
        options = dict(options, num_warps=min(options["num_warps"], 4))
    return c, options


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a, b):
    return (a + b - 1) // b


class ShapeOps:
    """cdiv / min / max on ints or TensorRT shape expressions: plain Python where both sides are ints
    (tensorrt.plugin's cdiv, max and min raise ValueError on two ints; TensorRT 10.9-11.1 plugin/_top_level.py),
    the symbolic functions otherwise. Expressions must stay on the left of + - * // (no reflected operators)."""

    def __init__(self, cdiv=None, min=None, max=None):  # noqa: A002 (tensorrt.plugin's names)
        self._sym = dict(cdiv=cdiv, min=min, max=max)

    def _pick(self, name, a, b, plain):
        if isinstance(a, int) and isinstance(b, int):
            return plain(a, b)
        if self._sym[name] is None:
            raise TypeError(f"{name} of a shape expression needs tensorrt.plugin's {name} (ShapeOps({name}=...))")
        return self._sym[name](a, b)

    def cdiv(self, a, b):
        return self._pick("cdiv", a, b, cdiv)

    def min(self, a, b):
        return self._pick("min", a, b, min)

    def max(self, a, b):
        return self._pick("max", a, b, max)


INT_OPS = ShapeOps()


@dataclass(frozen=True)
class KernelABI:
    """A kernel's runtime parameters in launch order (constexprs excluded)."""

    kernel: str  # attribute name of the @triton.jit function in plugins/triton
    module: str  # module under clover_export.plugins.triton
    inputs: tuple[str, ...]  # pointer per op input
    scalars: tuple[tuple[str, str, int], ...]  # (name, input it is read from, dimension)
    outputs: tuple[str, ...]  # pointer per op output
    aliases: dict[str, str] = field(default_factory=dict)

    @property
    def params(self) -> tuple[str, ...]:
        return self.inputs + tuple(s[0] for s in self.scalars) + self.outputs

    def signature(self, dtypes: dict[str, str]) -> dict[str, str]:
        """Triton signature for tensor dtypes (contract dtype names, e.g. 'bfloat16') per op tensor name."""
        sig = {}
        for name in self.inputs + self.outputs:
            sig[name] = "*" + TRITON_TYPES[dtypes[name]]
        for name, _, _ in self.scalars:
            sig[name] = "i32"
        return {p: sig[p] for p in self.params}


def _abi(contract: OpContract, kernel: str, module: str, scalars) -> KernelABI:
    return KernelABI(kernel, module, tuple(t.name for t in contract.inputs), tuple(scalars),
                     tuple(t.name for t in contract.outputs), dict(contract.aliases))


GDN_PARAMS = ("conv_w", "conv_w_right", "A_log", "dt_bias", "block_scale", "block_gate")  # weights: model dtype or fp32
# Scalars also bound the index values the kernels read (TensorRT times plugins on garbage, docs/tensorrt.md): the
# pools' slot count S, the partials' rows, the pairs' B and T; each comes from a shape the plugin already has.
GDN_ABI = _abi(BLOCK_GDN, "block_gdn_kernel", "gdn", [("T", "mixed_qkv", 1), ("S", "conv_pool", 0)])
ATTENTION_ABI = _abi(BLOCK_ATTENTION, "block_attention_kernel", "attention",
                     [("T", "q", 1), ("L", "key_pool", 2), ("S", "key_pool", 0)])
ATTENTION_SPLIT_ABI = _abi(BLOCK_ATTENTION_SPLIT, "block_attention_split_kernel", "attention",
                           [("T", "q", 1), ("L", "key_pool", 2), ("S", "key_pool", 0)])
ATTENTION_MERGE_ABI = _abi(BLOCK_ATTENTION_MERGE, "attention_merge_kernel", "attention",
                           [("T", "q", 1), ("ROWS", "acc", 0)])


# ---------------------------------------------------------------- BlockGDN
def gdn_dot_precision(dtype: str) -> str:
    """fp32 tl.dot precision: TF32 for 16-bit models (register pressure: tf32x3 spills ~4 KB per thread on
    sm_90 at Clover sizes, tf32 under 1 KB), 3xTF32 (~fp32) for fp32 graphs."""
    return "tf32x3" if dtype == "float32" else "tf32"


def gdn_constexprs(num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, conv_kernel: int,
                   block_size: int, chunk: int = 32, bv: int = 64, dot_precision: str = "tf32") -> dict:
    """Compile-time sizes of `block_gdn_kernel` (padded to powers of two >= 16 for tl.dot)."""
    if num_v_heads % num_k_heads:
        raise ValueError(f"BlockGDN: value heads {num_v_heads} not a multiple of key heads {num_k_heads}")
    if not 2 <= conv_kernel <= 9:
        raise ValueError(f"BlockGDN: conv kernel {conv_kernel} outside 2..9")
    cc = max(16, next_pow2(chunk))
    return dict(
        HK=num_k_heads, HV=num_v_heads, DK=head_k_dim, DV=head_v_dim, KCONV=conv_kernel, N=block_size,
        DKP=max(16, next_pow2(head_k_dim)), BV=min(max(16, next_pow2(bv)), max(16, next_pow2(head_v_dim))),
        CC=cc, LOG2_CC=cc.bit_length() - 1, BN=max(16, next_pow2(block_size)),
        KM1P=next_pow2(conv_kernel - 1), Q_SCALE=float(head_k_dim) ** -0.5, DOT_PREC=dot_precision,
    )


def gdn_grid(B, num_k_heads: int) -> tuple:
    """One program per (batch row, k-head): it owns all conv channels of that k-head."""
    return (B, num_k_heads, 1)


def gdn_launch(consts: dict, num_warps: int | None = None) -> dict:
    """Warps by state-tile size; one stage (the chunk loop carries the state: nothing to prefetch)."""
    return dict(num_warps=num_warps or (8 if consts["DKP"] * consts["BV"] >= 8192 else 4), num_stages=1)


# The torch path's two-launch form (gdn.py: gdn_conv_kernel, then gdn_delta_kernel on the delta constexprs,
# which are gdn_constexprs').
GDN_CONV_ROWS = 32  # causal rows per conv tile


def gdn_conv_constexprs(consts: dict) -> dict:
    """`gdn_conv_kernel`'s sizes from `gdn_constexprs`: one channel tile covers a q, k or v head."""
    keys = ("HK", "HV", "DK", "DV", "KCONV", "N", "BN", "KM1P")
    return dict({k: consts[k] for k in keys}, CP=max(16, next_pow2(max(consts["DK"], consts["DV"]))),
                RT=GDN_CONV_ROWS)


def gdn_split_bv(B: int, num_v_heads: int, head_v_dim: int, num_sms: int) -> int:
    """dv tile of the delta-rule grid: 64, or 32 when 64 leaves SMs idle (B = 1: 32 v-heads x 2 tiles < 132)."""
    bv = min(64, max(16, next_pow2(head_v_dim)))
    if bv > 32 and B * num_v_heads * cdiv(head_v_dim, bv) < num_sms:
        bv = 32
    return bv


def gdn_split_grids(B, consts: dict) -> dict:
    """conv: (B, 2 Hk + Hv) heads, each program owning its channels; delta: (B, Hv, dv tiles)."""
    return {"conv": (B, 2 * consts["HK"] + consts["HV"], 1),
            "delta": (B, consts["HV"], cdiv(consts["DV"], consts["BV"]))}


def gdn_conv_launch(conv_consts: dict) -> dict:
    return dict(num_warps=8 if conv_consts["CP"] * conv_consts["RT"] >= 4096 else 4, num_stages=1)


# ---------------------------------------------------------------- row kernels (norms.py glue, moe.act_quant_kernel)
def row_tiles(width: int) -> tuple[dict, dict]:
    """(constexprs, launch options) of a kernel over rows of `width`: BLOCK_D covers a row; ROWS rows per
    program, ~4K elements per tile; 8 warps from 4K elements."""
    block_d = max(16, next_pow2(width))
    rows = max(1, min(16, 4096 // block_d))
    return dict(BLOCK_D=block_d, ROWS=rows), dict(num_warps=8 if block_d * rows >= 4096 else 4, num_stages=1)


# ---------------------------------------------------------------- BlockAttention
ATTENTION_TILES = {  # arch -> (BLOCK_M, BLOCK_N, num_warps, num_stages); sm_89 has ~99 KB of shared memory
    80: (64, 64, 8, 2), 89: (64, 32, 8, 2), 90: (64, 64, 8, 2), 100: (64, 64, 8, 2),
}
ATTENTION_TILES_FP32 = (32, 32, 4, 1)  # fp32 graphs (validation): half the tile bytes


def attention_constexprs(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, scale: float,
                         dtype: str, arch: int = 90, tiles: tuple | None = None) -> dict:
    """`tiles` (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the per-arch table (benchmark sweeps)."""
    if num_heads % num_kv_heads:
        raise ValueError(f"BlockAttention: heads {num_heads} not a multiple of kv heads {num_kv_heads}")
    bm, bn, _, _ = tiles or _attention_tiles(arch, dtype)
    return dict(
        H=num_heads, HKV=num_kv_heads, HD=head_dim, HDP=max(16, next_pow2(head_dim)), N=block_size,
        BN=max(16, next_pow2(block_size)), SCALE=float(scale), BLOCK_M=bm, BLOCK_N=bn,
        DOT_PREC="ieee" if dtype == "float32" else "tf32",
        KV_FIRST=False,  # the one-kernel form (TensorRT); the torch path writes K/V first (ops.block_attention)
    )


def _attention_tiles(arch: int, dtype: str) -> tuple:
    return ATTENTION_TILES_FP32 if dtype == "float32" else ATTENTION_TILES[tile_arch(arch)]


def attention_launch(arch: int = 90, dtype: str = "bfloat16", tiles: tuple | None = None) -> dict:
    _, _, warps, stages = tiles or _attention_tiles(arch, dtype)
    return dict(num_warps=warps, num_stages=stages)


# The split kernel also stores fp32 partials and (TensorRT's one-kernel form) runs the step's own block: two
# stages of its tiles overflow sm_80's 164 KB and sm_89's 99 KB of shared memory (PTX-checked, test_kernels_aot).
ATTENTION_SPLIT_STAGES = {80: 1, 89: 1}


def attention_split_launch(arch: int = 90, dtype: str = "bfloat16", tiles: tuple | None = None) -> dict:
    """block_attention_split_kernel's launch options: the one-kernel form's, fewer stages where memory is short."""
    opts = attention_launch(arch, dtype, tiles)
    column = tile_arch(arch)
    if tiles is None and column in ATTENTION_SPLIT_STAGES:
        opts["num_stages"] = min(opts["num_stages"], ATTENTION_SPLIT_STAGES[column])
    return opts


def attention_grid(B, T, consts: dict, splits: int = 1, cdiv=cdiv) -> tuple:
    """(query tiles of T * H/Hkv vectors, batch rows x kv-heads, prefix splits); `cdiv` may be TensorRT's."""
    rep = consts["H"] // consts["HKV"]
    return (cdiv(T * rep, consts["BLOCK_M"]), B * consts["HKV"], splits)


ATTENTION_MAX_SPLITS = 32
ATTENTION_SPLIT_MIN_POSITIONS = 1024  # pool positions per split at least: a split of the prefix is worth a launch
ATTENTION_MERGE_BLOCK_R = 16  # query rows per program of attention_merge_kernel
ATTENTION_MERGE_LAUNCH = dict(num_warps=4, num_stages=1)


def attention_split_cap(L: int) -> int:
    """The most splits a pool of L positions gets (1: the one-kernel form; L is static: the pools' capacity)."""
    return max(1, min(L // ATTENTION_SPLIT_MIN_POSITIONS, ATTENTION_MAX_SPLITS))


def attention_splits(B, T, L: int, consts: dict, num_sms: int, ops: ShapeOps = INT_OPS, cap: int | None = None):
    """Prefix splits (torch path and TensorRT's BlockAttentionSplit): the most that keep the programs under two
    waves, max(1, min(cdiv(2 SMs, programs) - 1, cap)), cap = attention_split_cap(L): 1 once the programs alone
    fill the GPU. On TensorRT, B and T are shape expressions (`ops`: ShapeOps of tensorrt.plugin's cdiv/min/max)
    and the pools' L is not a build-time int: `cap` comes from the node (its max_splits attribute); the count is
    then an expression, the grid's third dimension (the partials are sized by `attention_partial_rows`)."""
    cap = attention_split_cap(L) if cap is None else cap
    if cap <= 1:
        return 1
    tiles = attention_grid(B, T, consts, cdiv=ops.cdiv)[0]
    programs = (B * tiles if isinstance(tiles, int) else tiles * B) * consts["HKV"]  # expressions on the left
    return ops.max(ops.min(ops.cdiv(2 * num_sms, programs) - 1, cap), 1)


def attention_partial_rows(B, T, consts: dict, num_sms: int, ops: ShapeOps = INT_OPS):
    """Rows of BlockAttentionSplit's flattened partials: max(B T, cdiv(2 SMs x BLOCK_M, H)) >= S B T for every
    B and T (S = attention_splits with the same consts and SM count). Why: S >= 2 only where
    S <= cdiv(2 SMs, p) - 1 < 2 SMs / p, with p = cdiv(T H/Hkv, BLOCK_M) B Hkv >= B T H / BLOCK_M programs, so
    S B T < 2 SMs BLOCK_M / H. Monotone in B and T, unlike S B T: TensorRT's per-dimension upper bound over the
    profile is then the true worst case, not cap x max B x max T."""
    bt = T * B if isinstance(B, int) and not isinstance(T, int) else B * T  # expressions on the left
    return ops.max(bt, cdiv(2 * num_sms * consts["BLOCK_M"], consts["H"]))


def attention_merge_grid(B, T, num_heads: int, cdiv=cdiv) -> tuple:
    """attention_merge_kernel: (row tiles of T * H query rows, batch rows)."""
    return (cdiv(T * num_heads, ATTENTION_MERGE_BLOCK_R), B, 1)


def attention_merge_constexprs(num_heads: int, head_dim: int) -> dict:
    return dict(H=num_heads, HD=head_dim, HDP=max(16, next_pow2(head_dim)), BLOCK_R=ATTENTION_MERGE_BLOCK_R)


def attention_splits_waves(B: int, T: int, L: int, consts: dict, num_sms: int, max_splits: int = 32) -> int:
    """FlashAttention's rule for the split count, written from its description (a bench variant, not yet
    measured on a GPU): no split once the programs fill 80 % of the SMs; else, among split counts that change
    the key blocks per split, the fewest whose wave efficiency (programs / SMs, over its ceiling) is within
    85 % of the best."""
    base = attention_grid(B, T, consts)[0] * B * consts["HKV"]
    if base >= 0.8 * num_sms:
        return 1
    blocks = cdiv(L, consts["BLOCK_N"])
    top = max(1, min(max_splits, num_sms, blocks))

    def efficiency(s: int) -> float:
        if s > 1 and cdiv(blocks, s) == cdiv(blocks, s - 1):
            return 0.0  # the same blocks per split as s - 1: nothing gained
        waves = base * s / num_sms
        return waves / -(-waves // 1)

    best = max(efficiency(s) for s in range(1, top + 1))
    return next(s for s in range(1, top + 1) if efficiency(s) >= 0.85 * best)


# ---------------------------------------------------------------- CoresetMoE
MOE_TILES = {  # arch -> tiles and pipelining of the two grouped GEMMs
    80: dict(BLOCK_N1=64, BLOCK_K1=128, BLOCK_N2=64, BLOCK_K2=128, num_warps=4, num_stages=3),
    89: dict(BLOCK_N1=64, BLOCK_K1=128, BLOCK_N2=64, BLOCK_K2=128, num_warps=4, num_stages=2),
    90: dict(BLOCK_N1=64, BLOCK_K1=128, BLOCK_N2=128, BLOCK_K2=128, num_warps=4, num_stages=4),
    100: dict(BLOCK_N1=64, BLOCK_K1=128, BLOCK_N2=64, BLOCK_K2=128, num_warps=4, num_stages=4),
}
# sm_90 BLOCK_N2 128 (the down projection's output tile): on an H200, whole steps at Clover's size with the
# triton backend's kernels, BLOCK_N2 64 -> 128: B = 8 commit+denoise 38.57 -> 34.47 ms, B = 1 denoise 9.80 -> 9.61 ms
# (bench/step_bound.py, variant product_down_n128; bench/results/step_bound_h200_2026-12-04.json). FP8 experts take
# the same tile: B = 8 FP8 commit+denoise 31.24 -> 31.00 ms weight-only, 26.80 -> 26.40 ms w8a8
# (bench/results/step_bound_h200_2026-12-04_fp8_down.log).


# FP8 experts, measured on an H200 (`python bench/step_bound.py --fp8-variants`: the MoE op alone at B = 8
# commit+denoise, 256 experts; bf16 0.597 ms; bench/results/step_bound_h200_fp8_variants_2026-11-30.txt): the bf16
# tile table with e4m3 widened to bf16 in registers 0.531 ms (1.13x faster than bf16), the same tiles on fp16 dots
# (moe.py `_row_scale`) 0.581 ms, the K-256 tiles of the tile sweep on fp16 dots 0.850 ms and widened to bf16
# 1.020 ms. So FP8 keeps the bf16 tiles and the bf16 widening; fp16 dots stay an opt-in (tiles={"F16_DOT": True}).
FP8_F16_DOT = False
MOE_TILES_FP8 = dict(MOE_TILES)
# w8a8 (moe.py `act_quant_kernel` + e4m3 x e4m3 dots, as vLLM's fused MoE): the weights go to the MMA as stored,
# nothing is widened in the inner loop; the activations get one fp32 scale per row. Opt-in (tiles={"A8": True})
# until measured on a GPU (bench/step_bound.py --fp8-variants), token agreement included.
FP8_W8A8 = False


def moe_w8a8(fp8: bool, dtype: str, tiles: dict | None = None) -> bool:
    """Whether FP8 experts run w8a8. tiles={"A8": ...} decides (the interpreter tests run it on fp32
    activations); else FP8_W8A8, for 16-bit activations only (fp32 graphs keep fp32 dots)."""
    if not fp8:
        return False
    if tiles and "A8" in tiles:
        return bool(tiles["A8"])
    return FP8_W8A8 and dtype != "float32"


def moe_a8_block_m(pairs: int, num_experts: int, arch: int) -> int:
    """Pairs per tile of the w8a8 GEMMs: from sm_90 on, 64 (Triton gives e4m3 operands to wgmma only for 64-row
    tiles; at 16 it widens them to fp16 for mma.sync, the conversion w8a8 exists to avoid; checked in the PTX)."""
    return 64 if arch >= 90 else moe_block_m(pairs, num_experts)


MOE_ROUTE_LAUNCH = dict(num_warps=8, num_stages=1)  # [rows, E] fp32 tiles: 8 warps keep them out of local memory
MOE_SMALL_LAUNCH = dict(num_warps=4, num_stages=1)  # combine kernel; the torch path's align and write_kv kernels
MOE_ALIGN_BLOCK = 128  # pairs per program of moe_count_kernel / moe_place_kernel ([128, next_pow2(E + 1)] tiles)


def moe_route_constexprs(num_experts: int, top_k: int, block_size: int, top_p: float, coreset: bool) -> dict:
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"CoresetMoE: top_k {top_k} outside 1..{num_experts}")
    return dict(E=num_experts, EP=next_pow2(num_experts), K=top_k, KP=next_pow2(top_k), N=block_size,
                BNB=next_pow2(max(block_size, 1)), BT=16, TOP_P=float(top_p), CORESET=bool(coreset))


def moe_block_m(pairs: int, num_experts: int) -> int:
    """Pairs per tile: ~2x the mean pairs per expert, 16..64 (16 at decode: one tile per expert)."""
    return int(min(64, max(16, next_pow2(cdiv(2 * pairs, num_experts)))))


def moe_gemm_constexprs(hidden: int, inter: int, top_k: int, block_m: int, fp8: bool, dtype: str,
                        arch: int = 90, tiles: dict | None = None) -> tuple[dict, dict, dict]:
    """(gate_up constexprs, down constexprs, launch options); `tiles` overrides MOE_TILES(_FP8) entries.

    FP8 with 16-bit activations: F16_DOT (fp16 dots, moe.py `_row_scale`); fp32 activations keep fp32 dots."""
    table = MOE_TILES_FP8 if fp8 else MOE_TILES
    overrides = {k: v for k, v in (tiles or {}).items() if k != "A8"}  # A8 picks kernels (moe_w8a8), not tiles
    t = dict(table[tile_arch(arch)], **overrides)
    if dtype == "float32" and not overrides:  # fp32 graphs (validation): half the K tile, two stages
        t.update(BLOCK_K1=64, BLOCK_K2=64, num_stages=2)
    prec = "ieee" if dtype == "float32" else "tf32"
    bk1 = min(t["BLOCK_K1"], max(16, next_pow2(hidden)))
    bk2 = min(t["BLOCK_K2"], max(16, next_pow2(inter)))
    gu = dict(D=hidden, I=inter, K=top_k, HAS_SCALE=fp8, BLOCK_M=block_m,
              BLOCK_N=min(t["BLOCK_N1"], max(16, next_pow2(inter))), BLOCK_K=bk1, DOT_PREC=prec)
    dn = dict(D=hidden, I=inter, K=top_k, HAS_SCALE=fp8, BLOCK_M=block_m,
              BLOCK_N=min(t["BLOCK_N2"], max(16, next_pow2(hidden))), BLOCK_K=bk2, DOT_PREC=prec)
    gu["F16_DOT"] = dn["F16_DOT"] = fp8 and bool(t.get("F16_DOT", FP8_F16_DOT and dtype != "float32"))
    for d in (gu, dn):  # the expert grid; moe_m_grid() switches the torch path to the M-block grid
        d.update(M_GRID=False, NE=1, NEP=1)
    return gu, dn, dict(num_warps=t["num_warps"], num_stages=t["num_stages"])


def moe_m_grid(gu: dict, dn: dict, num_experts: int) -> tuple[dict, dict]:
    """The constexprs of the M-block grid (moe.py `_segment`): one program per (M tile, N tile)."""
    m = dict(M_GRID=True, NE=num_experts, NEP=next_pow2(num_experts))
    return dict(gu, **m), dict(dn, **m)


def moe_m_tiles(pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the M tiles: sum_e cdiv(p_e, BM) <= cdiv(P, BM) + (experts with pairs) (static: no sync)."""
    return cdiv(pairs, block_m) + min(num_experts, pairs)


def moe_route_grid(B: int, T: int, rc: dict) -> tuple:
    """(batch rows, 1 block-rows program + causal row tiles)."""
    return (B, 1 + cdiv(T - rc["N"], rc["BT"]), 1)


def moe_grids(num_experts: int, B: int, T: int, gu: dict, dn: dict, block_d: int = 256,
              pairs: int | None = None) -> dict:
    """`pairs`: the pair rows of the GEMMs when not B*T*K (ops.moe_experts' shared expert adds one per token)."""
    rows = num_experts  # expert grid: one program per expert (and N tile)
    if gu.get("M_GRID"):
        rows = moe_m_tiles(B * T * gu["K"] if pairs is None else pairs, num_experts, gu["BLOCK_M"])
    return {
        "gate_up": (rows, cdiv(gu["I"], gu["BLOCK_N"]), 1),
        "down": (rows, cdiv(dn["D"], dn["BLOCK_N"]), 1),
        "combine": (B * T, cdiv(dn["D"], block_d), 1),
    }


# ---------------------------------------------------------------- CoresetMoE as AOT sub-ops (model.trt.onnx)
# One kernel per sub-op, launched by TensorRT from PTX: inputs, int32 scalars, outputs (the contracts' order).
_PAIR_DIMS = [("B", "order", 0), ("T", "order", 1)]  # the expert GEMMs' bound on the offsets and order values
MOE_SUBOP_ABIS = {
    MOE_ROUTE.name: _abi(MOE_ROUTE, "moe_route_kernel", "moe", [("T", "logits", 1)]),
    MOE_ALIGN.name: _abi(MOE_ALIGN, "moe_align_kernel", "moe", [("B", "idx", 0), ("T", "idx", 1)]),
    MOE_GATE_UP.name: _abi(MOE_GATE_UP, "moe_gate_up_plain_kernel", "moe", _PAIR_DIMS),
    MOE_GATE_UP_FP8.name: _abi(MOE_GATE_UP_FP8, "moe_gate_up_kernel", "moe", _PAIR_DIMS),
    MOE_DOWN.name: _abi(MOE_DOWN, "moe_down_plain_kernel", "moe", _PAIR_DIMS),
    MOE_DOWN_FP8.name: _abi(MOE_DOWN_FP8, "moe_down_kernel", "moe", _PAIR_DIMS),
    MOE_COMBINE.name: _abi(MOE_COMBINE, "moe_combine_kernel", "moe", []),
}
MOE_AOT_BLOCK_M = 16  # pairs per tile in the engine (fixed at build time; decode has ~2 pairs per expert)
MOE_COMBINE_BLOCK_D = 256
MOE_ALIGN_LAUNCH = dict(num_warps=4, num_stages=1)


def moe_align_constexprs(num_experts: int, top_k: int) -> dict:
    """[BLOCK_P, next_pow2(E + 1)] int32 tiles of ~8K elements (one program: kept small, not fast)."""
    ep1 = next_pow2(num_experts + 1)
    return dict(E=num_experts, EP1=ep1, K=top_k, BLOCK_P=max(1, min(64, 8192 // ep1)))


def moe_combine_constexprs(hidden: int, num_experts: int, top_k: int, shared: bool = False) -> dict:
    return dict(D=hidden, E=num_experts, K=top_k, KP=next_pow2(top_k), BLOCK_D=MOE_COMBINE_BLOCK_D, SHARED=shared)


def moe_place_constexprs(num_experts: int, shared: bool = False) -> dict:
    """moe_place_kernel: offsets for E experts (+ the shared expert's segment), [BLOCK, EP1] tiles."""
    return dict(E=num_experts, EP1=next_pow2(num_experts + 1 + shared), BLOCK=MOE_ALIGN_BLOCK, SHARED=shared)


def moe_shared_fusable(routed_inter: int, shared_inter: int, fp8: bool) -> bool:
    """Whether the torch path runs the shared expert as one more expert of the grouped GEMMs (ops.moe_block):
    its gate/up/down have the routed experts' shapes (Qwen3.6-35B-A3B: 512 and 512) and dtype. FP8 routed
    experts keep it apart: the grouped GEMM reads one weight dtype, and the shared expert stays 16-bit."""
    return routed_inter == shared_inter and not fp8


def moe_subop_grid(op: str, B, T, num_experts: int, consts: dict, cdiv=cdiv) -> tuple:
    """Grid of a MoE sub-op; B and T may be TensorRT shape expressions, everything else is a build-time int.
    Expressions stay on the left of + - * // (tensorrt.plugin's SymIntExpr defines no reflected operators)."""
    if op == MOE_ROUTE.name:
        return (B, cdiv(T - consts["N"], consts["BT"]) + 1, 1)  # expression on the left: ShapeExpr has no __radd__
    if op == MOE_ALIGN.name:
        return (1, 1, 1)
    if op in (MOE_GATE_UP.name, MOE_GATE_UP_FP8.name):
        return (num_experts, cdiv(consts["I"], consts["BLOCK_N"]), 1)
    if op in (MOE_DOWN.name, MOE_DOWN_FP8.name):
        return (num_experts, cdiv(consts["D"], consts["BLOCK_N"]), 1)
    if op == MOE_COMBINE.name:
        return (B * T, cdiv(consts["D"], consts["BLOCK_D"]), 1)
    raise ValueError(f"clover::{op} is not a MoE sub-op")


def io_dtypes(contract: OpContract, model_dtype: str, param_dtype: str | None = None) -> dict[str, str]:
    """dtype of every input and output for one combination (contract dtype names).

    Fixed dtype rules (fp32 scales, e4m3 weights, int32 ids) come from the contract as they are.
    """
    d: dict[str, str] = {}
    for t in contract.inputs:
        if t.dtype == "float":
            d[t.name] = model_dtype
        elif t.dtype.startswith("like:"):
            d[t.name] = d[t.dtype[5:]]
        else:
            d[t.name] = t.dtype
    if contract is BLOCK_GDN and param_dtype:
        d.update({n: param_dtype for n in GDN_PARAMS})
    for t in contract.outputs:
        d[t.name] = d[t.dtype[5:]] if t.dtype.startswith("like:") else (model_dtype if t.dtype == "float" else t.dtype)
    return d
