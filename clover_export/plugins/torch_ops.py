"""`torch.library` custom ops made from the contracts (STEP_GRAPH.md 2, 4).

Each op's CPU (and any-device) implementation is the foundation's plain-torch
core; its fake kernel resolves output shapes from the contract, so meta /
fake tensors trace. `export_cores()` gives a `Cores` that calls the ops,
which the exporter sets as `model.cores`; the reference model itself keeps
the plain-torch cores.
"""

from __future__ import annotations

import importlib

import torch

from clover_export.plugins.contracts import CONTRACTS, FIXED_DTYPES, OpContract, output_dtype_source, output_shapes

_SCHEMA_TYPES = {"int": "int", "float": "float", "bool": "bool"}


def schema(contract: OpContract) -> str:
    """The torch.library schema string of a contract: inputs, then attributes, in the core's order."""
    args = [f"Tensor {t.name}" for t in contract.inputs]
    args += [f"{_SCHEMA_TYPES[a.type]} {a.name}" for a in contract.attributes]
    outs = ", ".join("Tensor" for _ in contract.outputs)
    return f"({', '.join(args)}) -> ({outs})"


def reference_core(contract: OpContract):
    module, func = contract.reference.split(":")
    return getattr(importlib.import_module(module), func)


def _fixed_dtype(rule: str) -> torch.dtype:
    if rule not in FIXED_DTYPES:
        raise ValueError(f"dtype rule {rule!r} is not a fixed dtype {FIXED_DTYPES}")
    return getattr(torch, rule)


def _define(contract: OpContract):
    core = reference_core(contract)
    n_in = len(contract.inputs)

    def impl(*args):
        out = core(*args)
        # custom ops may not return inputs (aliasing); the cores always build new tensors, but be safe
        return tuple(o.clone() if any(o is a for a in args[:n_in]) else o for o in out)

    def fake(*args):
        tensors = dict(zip((t.name for t in contract.inputs), args[:n_in]))
        attrs = dict(zip((a.name for a in contract.attributes), args[n_in:]))
        shapes = output_shapes(contract, {k: tuple(v.shape) for k, v in tensors.items()}, attrs)
        ref = args[0]
        outs = []
        for spec, shape in zip(contract.outputs, shapes):
            src = output_dtype_source(spec)
            dtype = tensors[src].dtype if src else _fixed_dtype(spec.dtype)
            outs.append(ref.new_empty(shape, dtype=dtype))
        return tuple(outs)

    lib_op = torch.library.custom_op(contract.qualname, impl, mutates_args=(), schema=schema(contract))
    lib_op.register_fake(fake)
    return lib_op


_DEFINED: dict[str, object] = {}


def ops() -> dict[str, object]:
    """Contract name -> `torch.ops.clover.<name>.default` (each op defined once per process)."""
    for name, contract in CONTRACTS.items():
        if name not in _DEFINED:
            _DEFINED[name] = _define(contract)
    return {name: getattr(getattr(torch.ops, c.namespace), name).default for name, c in CONTRACTS.items()}


def export_cores():
    """A `Cores` whose three functions are the custom ops (same argument order as the plain cores).

    `clover::CoresetMoEFP8` is not among them: only the FP8 graph rewrite (`quantize/graph.py`) produces it.
    """
    from clover_export.model.model import Cores

    o = ops()
    return Cores(gdn=o["BlockGDN"], attention=o["BlockAttention"], moe=o["CoresetMoE"])
