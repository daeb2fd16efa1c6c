"""What the TensorRT plugins declare, as plain functions tested without TensorRT (STEP_GRAPH.md 2, 4).

For each `clover::` op: the output descriptors (shape and dtype rules from
the contract, cache outputs as aliases of the cache inputs), the dtype
combinations offered to `@trtp.autotune`, and how it runs: BlockGDN and
BlockAttention are one Triton kernel each, launched by TensorRT from AOT PTX
(`aot_plan`: kernel variant, grid, extra int32 scalars); CoresetMoE and
CoresetMoEFP8 are several launches (routing, two grouped GEMMs, combine) and
a TensorRT AOT plugin is exactly one kernel with no workspace, so they run
through the Python JIT path (`@trtp.impl`) on the Triton implementation of
their torch ops (`cuda_ops.kernel`).
"""

from __future__ import annotations

from dataclasses import dataclass

from clover_export.plugins.contracts import (BLOCK_ATTENTION, BLOCK_GDN, CONTRACTS, CORESET_MOE, CORESET_MOE_FP8,
                                            OpContract)
from clover_export.plugins.triton import launch

TRT_TYPE_NAMES = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16", "int32": "INT32",
                  "float8_e4m3fn": "FP8"}
AOT_OPS = (BLOCK_GDN.name, BLOCK_ATTENTION.name)  # one kernel each: TensorRT launches their PTX
JIT_OPS = (CORESET_MOE.name, CORESET_MOE_FP8.name)  # several kernels: TensorRT calls back into Python
PREVIEW_FEATURES = ("ALIASED_PLUGIN_IO_10_03",)  # builder preview feature for plugin outputs aliasing inputs


@dataclass(frozen=True)
class OutputDecl:
    name: str
    alias_of: str | None  # input whose buffer the output is (cache pools)
    shape: tuple | None  # dims (ints or TensorRT expressions) when not an alias
    dtype_of: str | None  # input whose dtype the output takes
    dtype: str | None  # fixed dtype otherwise


def output_decls(contract: OpContract, shapes: dict[str, tuple], attrs: dict[str, object]) -> list[OutputDecl]:
    """Output descriptors; shapes may hold TensorRT shape expressions (only bound, never compared)."""
    from clover_export.plugins.contracts import output_dtype_source, output_shapes

    out_shapes = output_shapes(contract, shapes, attrs)
    decls = []
    for spec, shape in zip(contract.outputs, out_shapes):
        alias = contract.aliases.get(spec.name)
        src = output_dtype_source(spec)
        decls.append(OutputDecl(spec.name, alias, None if alias else tuple(shape), src, None if src else spec.dtype))
    return decls


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
        d.update({n: param_dtype for n in launch.GDN_PARAMS})
    for t in contract.outputs:
        d[t.name] = d[t.dtype[5:]] if t.dtype.startswith("like:") else (model_dtype if t.dtype == "float" else t.dtype)
    return d


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


@dataclass(frozen=True)
class AotPlan:
    variant: object  # aot.Variant
    grid: tuple  # (x, y, z), ints or TensorRT expressions
    scalars: tuple[tuple[str, int], ...]  # extra int32 args: (input name, dimension)


def aot_plan(op: str, shapes: dict[str, tuple], attrs: dict[str, object], dtypes: dict[str, str], arch: int,
             cdiv=launch.cdiv) -> AotPlan:
    """Kernel variant, grid and extra scalars for an AOT op. `shapes` static dims must be ints."""
    from clover_export.plugins.triton import aot

    if op == BLOCK_GDN.name:
        s = shapes
        v = aot.gdn_variant_for(int(attrs["num_k_heads"]), int(s["A_log"][0]), int(attrs["head_k_dim"]),
                                int(attrs["head_v_dim"]), int(s["conv_w"][1]), int(attrs["block_size"]),
                                dtypes["mixed_qkv"], dtypes["A_log"])
        grid = launch.gdn_grid(s["mixed_qkv"][0], int(attrs["num_k_heads"]))
        abi = launch.GDN_ABI
    elif op == BLOCK_ATTENTION.name:
        s = shapes
        v = aot.attention_variant_for(int(s["q"][2]), int(s["k"][2]), int(s["q"][3]), int(attrs["block_size"]),
                                      float(attrs["scale"]), dtypes["q"], arch)
        grid = launch.attention_grid(s["q"][0], s["q"][1], v.constexprs, cdiv=cdiv)
        abi = launch.ATTENTION_ABI
    else:
        raise ValueError(f"clover::{op} has no single-kernel AOT implementation (it runs through the JIT path)")
    return AotPlan(v, grid, tuple((src, dim) for _, src, dim in abi.scalars))


def contract(name: str) -> OpContract:
    return CONTRACTS[name]
