"""What the TensorRT plugins declare, as plain functions tested without TensorRT (STEP_GRAPH.md 2, 4).

For each plugin op of `model.trt.onnx` (`contracts.TRT_CONTRACTS`): the
output descriptors (shape and dtype rules from the contract, cache outputs
as aliases of the cache inputs), the dtype combinations offered to
`@trtp.autotune`, and how it runs: every op is one Triton kernel that
TensorRT launches from AOT PTX (`aot_plan`: kernel variant, grid, extra
int32 scalars), so no step calls back into Python. BlockGDN and
BlockAttention are one kernel each (BlockAttention's split-KV form is two:
BlockAttentionSplit and BlockAttentionMerge, the partials a graph tensor);
CoresetMoE(FP8) is not a plugin on TensorRT: `exporter/trt_graph.py` splits it into the MoE sub-ops (router
MatMul, MoERoute, MoEAlign, MoEGateUp(FP8), MoEDown(FP8), MoECombine).
"""

from __future__ import annotations

from dataclasses import dataclass

from clover_export.plugins.contracts import (
    BLOCK_ATTENTION,
    BLOCK_ATTENTION_MERGE,
    BLOCK_ATTENTION_SPLIT,
    BLOCK_GDN,
    MOE_SUBOPS,
    TRT_CONTRACTS,
    OpContract,
)
from clover_export.plugins.triton import launch
from clover_export.plugins.triton.launch import io_dtypes  # noqa: F401  (the combinations below; register, tests)

TRT_TYPE_NAMES = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16", "int32": "INT32",
                  "float8_e4m3fn": "FP8"}
AOT_OPS = tuple(TRT_CONTRACTS)  # one kernel each: TensorRT launches their PTX; ONNX nodes carry aot=1
PREVIEW_FEATURES = ("ALIASED_PLUGIN_IO_10_03",)  # builder preview feature for plugin outputs aliasing inputs (required)


@dataclass(frozen=True)
class OutputDecl:
    name: str
    alias_of: str | None  # input whose buffer the output is (cache pools)
    shape: tuple | None  # dims (ints or TensorRT expressions) when not an alias
    dtype_of: str | None  # input whose dtype the output takes
    dtype: str | None  # fixed dtype otherwise


def output_decls(contract: OpContract, shapes: dict[str, tuple], attrs: dict[str, object], arch: int = 90,
                 num_sms: int | None = None, shape_ops: launch.ShapeOps = launch.INT_OPS,
                 dtype_pass: bool = False) -> list[OutputDecl]:
    """Output descriptors; shapes may hold TensorRT shape expressions (only bound, never compared).
    BlockAttentionSplit's partials have `attention_partial_rows` rows (the build GPU's `arch` and `num_sms`).

    dtype_pass: TensorRT's dtype pass (tensorrt.plugin's get_output_data_types), whose dims are placeholders
    with no value ("fake" ShapeExprs, TensorRT 10.9-11.1 plugin/_plugin_class.py): only the outputs' dtypes and
    aliases are read there, so shapes that need values get a placeholder. Anywhere else such dims are an error."""
    from clover_export.plugins.contracts import output_dtype_source, output_shapes

    derived = None
    if contract is BLOCK_ATTENTION_SPLIT:
        if dtype_pass:
            derived = {"rows": shapes["q"][0]}  # a placeholder: never read
        else:
            derived = {"rows": attention_partial_rows(_static_heads(shapes), attrs, arch, _need_sms(num_sms),
                                                      shape_ops)}
    out_shapes = output_shapes(contract, shapes, attrs, derived)
    decls = []
    for spec, shape in zip(contract.outputs, out_shapes):
        alias = contract.aliases.get(spec.name)
        src = output_dtype_source(spec)
        decls.append(OutputDecl(spec.name, alias, None if alias else tuple(shape), src, None if src else spec.dtype))
    return decls


def combinations(contract: OpContract) -> list[dict[str, str]]:
    """The dtype combinations each plugin supports (BF16 engines; FP32 for validation).

    CoresetMoEFP8: FP8 weights and FP32 scales by contract, BF16 (or FP32) activations.
    """
    if contract is BLOCK_GDN:
        return [io_dtypes(contract, "bfloat16"), io_dtypes(contract, "bfloat16", "float32"),
                io_dtypes(contract, "float32")]
    return [io_dtypes(contract, "bfloat16"), io_dtypes(contract, "float32")]


def autotune_strings(contract: OpContract) -> list[str]:
    """`trtp.AutoTuneCombination` type strings: inputs then outputs, one combination each."""
    names = [t.name for t in contract.inputs] + [t.name for t in contract.outputs]
    return [", ".join(TRT_TYPE_NAMES[c[n]] for n in names) for c in combinations(contract)]


def _static_heads(shapes: dict[str, tuple]) -> dict[str, tuple]:
    """`shapes`, checked: the partials' rows need q's heads and head size and k's heads as build-time ints."""
    dims = {f"{n} dim {i}": shapes[n][i] for n, i in (("q", 2), ("q", 3), ("k", 2))}
    loose = [f"{what} ({v!r})" for what, v in dims.items() if not isinstance(v, int)]
    if loose:
        raise ValueError(f"BlockAttentionSplit: {', '.join(loose)} must be build-time constants to size the "
                         "partials (export the graph with static head counts and head size)")
    return shapes


def _need_sms(num_sms: int | None) -> int:
    if not num_sms:
        raise ValueError("BlockAttentionSplit: the split count needs the build GPU's SM count (num_sms)")
    return int(num_sms)


def attention_split_count(shapes: dict[str, tuple], attrs: dict[str, object], arch: int, num_sms: int,
                          shape_ops: launch.ShapeOps = launch.INT_OPS):
    """Prefix splits of a BlockAttentionSplit node (its grid's third dimension): `launch.attention_splits` of its
    shapes (B and T may be expressions). Counted on the 16-bit tiles whatever the dtype, so the partials' rows
    (`attention_partial_rows`, from the shape function, which may run before TensorRT fixes dtypes) bound what
    the launch writes."""
    s = shapes
    return launch.attention_splits(s["q"][0], s["q"][1], 0, _split_consts(s, attrs, arch), num_sms, shape_ops,
                                   cap=int(attrs["max_splits"]))


def attention_partial_rows(shapes: dict[str, tuple], attrs: dict[str, object], arch: int, num_sms: int,
                           shape_ops: launch.ShapeOps = launch.INT_OPS):
    """Rows of a BlockAttentionSplit node's partials: `launch.attention_partial_rows`, a monotone bound on what
    `attention_split_count` splits write (same tiles and SM count)."""
    s = shapes
    return launch.attention_partial_rows(s["q"][0], s["q"][1], _split_consts(s, attrs, arch), num_sms, shape_ops)


def _split_consts(s: dict[str, tuple], attrs: dict[str, object], arch: int) -> dict:
    return launch.attention_constexprs(int(s["q"][2]), int(s["k"][2]), int(s["q"][3]), int(attrs["block_size"]),
                                       float(attrs["scale"]), "bfloat16", arch)


@dataclass(frozen=True)
class AotPlan:
    variant: object  # aot.Variant
    grid: tuple  # (x, y, z), ints or TensorRT expressions
    scalars: tuple[tuple[str, int], ...]  # extra int32 args: (input name, dimension)


def aot_plan(op: str, shapes: dict[str, tuple], attrs: dict[str, object], dtypes: dict[str, str], arch: int,
             num_sms: int | None = None, shape_ops: launch.ShapeOps | None = None, fit=None) -> AotPlan:
    """Kernel variant, grid and extra scalars for an AOT op. Static dims must be ints; batch and step length
    may be TensorRT shape expressions. `shape_ops` (cdiv, min, max; default: `launch.cdiv` alone) is only
    called where one side is symbolic (`launch.ShapeOps`: TensorRT's own cdiv refuses two ints);
    BlockAttentionSplit's split count needs min and max too (and the build GPU's `num_sms`).
    `fit(variant) -> variant` may shrink the variant's tiles (TensorRT's shared-memory budget,
    `aot.fit_shared_memory`); the grid is computed from the variant it returns."""
    from clover_export.plugins.triton import aot

    ops = shape_ops or launch.ShapeOps(cdiv=launch.cdiv)
    cdiv = ops.cdiv
    s = shapes
    if op == BLOCK_GDN.name:
        v = aot.gdn_variant_for(int(attrs["num_k_heads"]), int(s["A_log"][0]), int(attrs["head_k_dim"]),
                                int(attrs["head_v_dim"]), int(s["conv_w"][1]), int(attrs["block_size"]),
                                dtypes["mixed_qkv"], dtypes["A_log"])
        grid = lambda c: launch.gdn_grid(s["mixed_qkv"][0], int(attrs["num_k_heads"]))  # noqa: E731
        abi = launch.GDN_ABI
    elif op == BLOCK_ATTENTION.name:
        v = aot.attention_variant_for(int(s["q"][2]), int(s["k"][2]), int(s["q"][3]), int(attrs["block_size"]),
                                      float(attrs["scale"]), dtypes["q"], arch)
        grid = lambda c: launch.attention_grid(s["q"][0], s["q"][1], c, cdiv=cdiv)  # noqa: E731
        abi = launch.ATTENTION_ABI
    elif op == BLOCK_ATTENTION_SPLIT.name:
        v = aot.attention_split_variants_for(int(s["q"][2]), int(s["k"][2]), int(s["q"][3]), int(attrs["block_size"]),
                                             float(attrs["scale"]), dtypes["q"], arch)[0]
        splits = attention_split_count(s, attrs, arch, _need_sms(num_sms), ops)  # default tiles: as output_decls
        grid = lambda c: launch.attention_grid(s["q"][0], s["q"][1], c, splits, cdiv=cdiv)  # noqa: E731
        abi = launch.ATTENTION_SPLIT_ABI
    elif op == BLOCK_ATTENTION_MERGE.name:
        v = aot.attention_merge_variant(int(s["q"][2]), int(s["q"][3]), dtypes["q"])
        grid = lambda c: launch.attention_merge_grid(s["q"][0], s["q"][1], int(s["q"][2]), cdiv=cdiv)  # noqa: E731
        abi = launch.ATTENTION_MERGE_ABI
    elif op in MOE_SUBOPS:
        E, K, D, I = moe_dims(op, shapes, attrs)
        first = s[MOE_SUBOPS[op].inputs[0].name]
        model_dtype = dtypes[MOE_SUBOPS[op].inputs[0].name]
        v = aot.moe_subop_variant(op, E, K, D, I, attrs, model_dtype, arch)
        grid = lambda c: launch.moe_subop_grid(op, first[0], first[1], E, c, cdiv=cdiv)  # noqa: E731
        abi = launch.MOE_SUBOP_ABIS[op]
    else:
        raise ValueError(f"clover::{op} is not a TensorRT plugin op (CoresetMoE is split by exporter/trt_graph.py)")
    if fit is not None:
        v = fit(v)
    return AotPlan(v, grid(v.constexprs), tuple((src, dim) for _, src, dim in abi.scalars))


# ---------------------------------------------------------------- shared memory of the AOT kernels
LARGE_SHARED_MEMORY_ENV = "CLOVER_TRT_LARGE_SHARED_MEMORY"


def env_flag(name: str, environ=None) -> bool:
    """A yes/no environment variable: unset, "", 0, false, no, off -> False; 1, true, yes, on -> True."""
    import os

    value = (os.environ if environ is None else environ).get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={value!r}: expected 1 or 0 (true/false, yes/no, on/off)")


def aot_shared_budget(arch: int, environ=None) -> int:
    """Most dynamic shared memory per block a TensorRT AOT kernel may use: 48 KiB, what a launch gets without
    the opt-in attribute, unless the user opts in (LARGE_SHARED_MEMORY_ENV=1): then the GPU's per-block maximum.
    TensorRT's public sources do not say that its AOT launch opts in (docs/tensorrt.md)."""
    if env_flag(LARGE_SHARED_MEMORY_ENV, environ):
        return launch.OPTIN_SHARED_BYTES[launch.tile_arch(arch)]
    return launch.DEFAULT_SHARED_BYTES


def shared_memory_note(arch: int | None, environ=None) -> str:
    """One line for `doctor` and the engine build's log: the AOT kernels' shared-memory budget and why."""
    if env_flag(LARGE_SHARED_MEMORY_ENV, environ):
        most = f"{aot_shared_budget(arch, environ) // 1024} KiB (sm_{arch}'s maximum)" if arch else "the GPU's maximum"
        return (f"AOT plugin kernels: up to {most} of shared memory per block ({LARGE_SHARED_MEMORY_ENV}=1; works "
                "only if TensorRT's AOT launch opts kernels into more than 48 KiB, which its public sources do not "
                "say: a refused launch fails the build)")
    return (f"AOT plugin kernels: at most {launch.DEFAULT_SHARED_BYTES // 1024} KiB of shared memory per block, tiles "
            "shrunk to fit (TensorRT's public sources do not say its AOT launch opts kernels into more; "
            f"{LARGE_SHARED_MEMORY_ENV}=1 allows the GPU's maximum)")


def moe_dims(op: str, shapes: dict[str, tuple], attrs: dict[str, object]) -> tuple[int, int, int, int]:
    """(experts, top_k, hidden, intermediate) of a MoE sub-op from its static dims (0 where the op has none)."""
    s = shapes
    if op == "MoERoute":
        return int(s["logits"][2]), int(attrs["top_k"]), 0, 0
    if op == "MoEAlign":
        return int(attrs["num_experts"]), int(s["idx"][2]), 0, 0
    if op in ("MoEGateUp", "MoEGateUpFP8"):
        w = s["gate_up" if op == "MoEGateUp" else "gate_up_fp8"]
        return int(w[0]), int(s["order"][2]), int(w[2]), int(w[1]) // 2
    if op in ("MoEDown", "MoEDownFP8"):
        w = s["down" if op == "MoEDown" else "down_fp8"]
        return int(w[0]), int(s["order"][2]), int(w[1]), int(w[2])
    if op == "MoECombine":
        return int(attrs["num_experts"]), int(s["y"][2]), int(s["y"][3]), 0
    raise ValueError(f"clover::{op} is not a MoE sub-op")


def contract(name: str) -> OpContract:
    return TRT_CONTRACTS[name]
