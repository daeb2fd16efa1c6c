"""The custom ops in ONNX: node emitters for torch.onnx and model-local functions (STEP_GRAPH.md 2, 4).

- `op_schema(contract)`: an `onnx.defs.OpSchema` made from the contract
  (not registered globally), so the emitter needs no hand-written onnxscript.
- `translation_table()`: torch op -> emitter, for `torch.onnx.export(...,
  custom_translation_table=...)`. The emitter writes one opaque node in
  domain `clover` carrying the op's attributes plus `plugin_namespace` /
  `plugin_version` (TensorRT's parser then uses the registered plugin).
- `function_protos()`: one FunctionProto per op, body in standard ops
  (`onnx_bodies.py`), attributes by reference; ONNX Runtime and
  `onnx.reference` run these.
"""

from __future__ import annotations

import onnx
from onnx import defs, helper

from clover_export.plugins.contracts import CONTRACTS, NAMESPACE, PLUGIN_VERSION, STEP_OPS, OpContract, TensorSpec

OPSET = 20  # standard-op opset of the bodies (STEP_GRAPH.md 1)
PLUGIN_ATTRS = {"plugin_namespace": NAMESPACE, "plugin_version": PLUGIN_VERSION}
_FLOAT_TYPES = ["tensor(float)", "tensor(bfloat16)", "tensor(float16)"]
_FIXED = {"float32": "tensor(float)", "int32": "tensor(int32)", "float8_e4m3fn": "tensor(float8e4m3fn)"}
_ATTR = {"int": defs.OpSchema.AttrType.INT, "float": defs.OpSchema.AttrType.FLOAT, "bool": defs.OpSchema.AttrType.INT}


def _root(contract: OpContract, spec: TensorSpec) -> TensorSpec:
    """Follow "like:" rules to the input that fixes the dtype."""
    while spec.dtype.startswith("like:"):
        spec = contract.input(spec.dtype.split(":", 1)[1])
    return spec


def op_schema(contract: OpContract) -> defs.OpSchema:
    type_vars: dict[str, str] = {}

    def type_str(spec: TensorSpec) -> str:
        root = _root(contract, spec)
        if root.dtype in _FIXED:
            return _FIXED[root.dtype]
        return type_vars.setdefault(root.name, f"T_{root.name}")

    ins = [defs.OpSchema.FormalParameter(t.name, type_str(t)) for t in contract.inputs]
    outs = [defs.OpSchema.FormalParameter(t.name, type_str(t)) for t in contract.outputs]
    attrs = [defs.OpSchema.Attribute(a.name, _ATTR[a.type], a.doc) for a in contract.attributes]
    attrs += [defs.OpSchema.Attribute(k, defs.OpSchema.AttrType.STRING, "TensorRT plugin lookup") for k in PLUGIN_ATTRS]
    return defs.OpSchema(
        contract.name, contract.namespace, int(contract.version), doc=contract.doc,
        inputs=ins, outputs=outs, attributes=attrs,
        type_constraints=[(v, _FLOAT_TYPES, "model float type") for v in type_vars.values()],
    )


def node_attributes(contract: OpContract, values: dict) -> dict:
    """The ONNX node's attributes: the op's own (bool as int 0/1) plus the plugin lookup pair."""
    out = {}
    for a in contract.attributes:
        v = values[a.name]
        out[a.name] = int(v) if a.type in ("int", "bool") else float(v)
    return {**out, **PLUGIN_ATTRS}


def emitter(contract: OpContract):
    """A torch.onnx translation function writing the contract's opaque node."""
    from onnxscript import values

    op = values.Op(values.Opset(contract.namespace, int(contract.version)), contract.name, op_schema(contract))
    n_in = len(contract.inputs)
    attr_names = [a.name for a in contract.attributes]

    def emit(*args, **kwargs):
        attrs = {**dict(zip(attr_names, args[n_in:])), **kwargs}
        return op(*args[:n_in], **node_attributes(contract, attrs))

    emit.__name__ = f"emit_{contract.name}"
    return emit


def translation_table() -> dict:
    """torch op overload -> emitter, for `custom_translation_table` (plus the Split fix below)."""
    import torch

    from clover_export.plugins.torch_ops import ops

    table = {ops()[name]: emitter(c) for name, c in CONTRACTS.items()}
    table[torch.ops.aten.split.Tensor] = _split
    table[torch.ops.aten.split_with_sizes.default] = _split_with_sizes
    return table


def _split_with_sizes(self, split_sizes, dim: int = 0):
    """`split` / `chunk` as Slices: torchlib's SplitToSequence/SequenceAt are not in TensorRT's parser."""
    from onnxscript import opset20 as op

    rank = len(self.shape)
    dim = dim % rank
    outs, start = [], 0
    for size in split_sizes:
        outs.append(op.Slice(self, op.Constant(value_ints=[start]), op.Constant(value_ints=[start + int(size)]),
                             op.Constant(value_ints=[dim])))
        start += int(size)
    return tuple(outs)


def _split(self, split_size, dim: int = 0):
    total = self.shape[dim]
    if not isinstance(total, int):
        raise NotImplementedError(f"split over a dynamic dimension ({total}) is not supported by the exporter")
    split_size = int(split_size)
    return _split_with_sizes(self, [min(split_size, total - s) for s in range(0, total, split_size)], dim)


def function_proto(contract: OpContract) -> onnx.FunctionProto:
    from clover_export.plugins.onnx_bodies import BODIES

    return helper.make_function(
        contract.namespace, contract.name,
        inputs=[t.name for t in contract.inputs],
        outputs=[t.name for t in contract.outputs],
        nodes=BODIES[contract.name](),
        opset_imports=[helper.make_opsetid("", OPSET)],
        attributes=[a.name for a in contract.attributes] + list(PLUGIN_ATTRS),
        doc_string=contract.doc,
    )


def function_protos(names=STEP_OPS) -> list[onnx.FunctionProto]:
    """The functions of the named ops (default: those of the exported step graph)."""
    return [function_proto(CONTRACTS[n]) for n in names]
