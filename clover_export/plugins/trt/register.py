"""`tensorrt.plugin` registration of the `clover::` plugin ops (imported only where TensorRT is installed).

Written to the `tensorrt.plugin` API of TensorRT >= 10.9 (`register`,
`autotune`, `aot_impl`, `KernelLaunchParams`, `SymIntExprs`, `cdiv`, `min`, `max`; checked
against NVIDIA/TensorRT python/packaging/bindings_wheel/tensorrt/plugin at
v10.9.0 and v11.1). Every op of `model.trt.onnx` (`TRT_CONTRACTS`) is AOT
only: TensorRT launches its PTX, nothing calls back into Python per step
(the ONNX nodes carry `aot=1`, samples/python/quickly_deployable_plugins/
README.md "ONNX model with an AOT plugin"). Every decision comes from
`plan.py` and `plugins/triton` (tested without TensorRT); this file only
translates descriptors. The registered functions get their signatures from
the op contracts (`__signature__`, which `inspect.signature` honours), so the
input and attribute lists are never retyped.

Attributes: ONNX carries the contract's bool as an int 0/1, so bools are
declared `int` here.

Each kernel's PTX keeps within `plan.aot_shared_budget` bytes of shared memory
per block (48 KiB unless the user opts in; `aot.fit_shared_memory` shrinks its
tiles), and the shape function tells TensorRT's dtype pass (placeholder dims,
`ShapeExpr.is_fake`) from the shape pass (docs/tensorrt.md).
"""

import inspect
from typing import List, Tuple, Union

import tensorrt as trt
import tensorrt.plugin as trtp

import clover_export.plugins.trt.plan as plan
from clover_export.plugins.contracts import BLOCK_ATTENTION_SPLIT, TRT_CONTRACTS, OpContract

_TRT_DTYPES = {"float32": trt.float32, "float16": trt.float16, "bfloat16": trt.bfloat16, "int32": trt.int32,
               "float8_e4m3fn": getattr(trt, "fp8", None)}
_ATTR_TYPES = {"int": int, "float": float, "bool": int}


def _dtype_name(dtype) -> str:
    for name, t in _TRT_DTYPES.items():
        if t is not None and t == dtype:
            return name
    raise ValueError(f"unsupported TensorRT dtype {dtype}")


def _static(expr):
    """An int for a constant TensorRT shape expression, else the expression."""
    if isinstance(expr, int):
        return expr
    try:
        if expr.is_constant:
            return int(expr.constant_value())
    except RuntimeError:  # a "fake" expression outside a shape context
        pass
    return expr


def _dims(desc) -> tuple:
    return tuple(_static(desc.shape_expr[i]) for i in range(desc.ndim))


def _dtype_pass(args, inputs) -> bool:
    """TensorRT's dtype pass (get_output_data_types) hands placeholder dims: `ShapeExpr.is_fake`."""
    return any(args[n].shape_expr[i].is_fake for n in inputs for i in range(args[n].ndim))


def _build_arch() -> int:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def _build_sms() -> int:
    import torch

    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def _shape_ops():
    from clover_export.plugins.triton import launch

    return launch.ShapeOps(cdiv=trtp.cdiv, min=trtp.min, max=trtp.max)


def _signed(fn, params: list[tuple[str, object]], ret, name: str):
    """`fn(arguments_dict)` exposed with an explicit signature (names and annotations)."""
    sig = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=a)
                             for n, a in params], return_annotation=ret)

    def wrapper(*args, **kwargs):
        return fn(sig.bind(*args, **kwargs).arguments)

    wrapper.__signature__ = sig
    wrapper.__name__ = wrapper.__qualname__ = name
    return wrapper


def _register(contract: OpContract) -> None:
    inputs = [t.name for t in contract.inputs]
    attrs = [(a.name, _ATTR_TYPES[a.type]) for a in contract.attributes]
    n_out = len(contract.outputs)
    desc_in = [(n, trtp.TensorDesc) for n in inputs]
    out_descs = Tuple[tuple([trtp.TensorDesc] * n_out)]

    def describe(args):
        shapes = {n: _dims(args[n]) for n in inputs}
        values = {a: args[a] for a, _ in attrs}
        outs = []
        split = contract is BLOCK_ATTENTION_SPLIT  # its partials' rows depend on the GPU
        sizing = dict(arch=_build_arch(), num_sms=_build_sms(), shape_ops=_shape_ops()) if split else {}
        for d in plan.output_decls(contract, shapes, values, dtype_pass=_dtype_pass(args, inputs), **sizing):
            if d.alias_of is not None:
                outs.append(args[d.alias_of].aliased())
                continue
            exprs = trtp.ShapeExprs(len(d.shape))
            for i, x in enumerate(d.shape):
                exprs[i] = x
            dtype = args[d.dtype_of].dtype if d.dtype_of else _TRT_DTYPES[d.dtype]
            outs.append(trtp.from_shape_expr(exprs, dtype=dtype))
        return tuple(outs)

    trtp.register(contract.qualname)(_signed(describe, desc_in + attrs, out_descs, f"{contract.name}_desc"))

    def tune(args):
        return [trtp.AutoTuneCombination(s) for s in plan.autotune_strings(contract)]

    trtp.autotune(contract.qualname)(_signed(tune, desc_in + [("outputs", out_descs)],
                                             List[trtp.AutoTuneCombination], f"{contract.name}_autotune"))

    def aot_impl(args):
        from clover_export.plugins.triton import aot

        arch = _build_arch()
        shapes = {n: _dims(args[n]) for n in inputs}
        dtypes = {n: _dtype_name(args[n].dtype) for n in inputs}
        budget = plan.aot_shared_budget(arch)  # 48 KiB unless the user opts in (plan.LARGE_SHARED_MEMORY_ENV)
        compiled = {}

        def fit(v):
            v, compiled["ptx"] = aot.fit_shared_memory(v, arch, budget)
            return v

        p = plan.aot_plan(contract.name, shapes, {a: args[a] for a, _ in attrs}, dtypes, arch, num_sms=_build_sms(),
                          shape_ops=_shape_ops(), fit=fit)
        c = compiled["ptx"]
        lp = trtp.KernelLaunchParams()
        lp.grid_x, lp.grid_y, lp.grid_z = p.grid
        lp.block_x = c.block
        lp.shared_mem = c.shared
        extra = trtp.SymIntExprs(len(p.scalars))
        for i, (src, dim) in enumerate(p.scalars):
            extra[i] = trtp.SymInt32(args[src].shape_expr[dim])
        return c.name, c.ptx, lp, extra

    ret = Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]
    trtp.aot_impl(contract.qualname)(_signed(aot_impl, desc_in + attrs + [("outputs", out_descs), ("tactic", int)],
                                             ret, f"{contract.name}_aot"))


_DONE: set[str] = set()


def register_all() -> tuple[str, ...]:
    """Register every contract's plugin once per process; returns the plugin ids."""
    for contract in TRT_CONTRACTS.values():
        if contract.qualname not in _DONE:
            _register(contract)
            _DONE.add(contract.qualname)
    return tuple(sorted(_DONE))
