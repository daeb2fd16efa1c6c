"""A small helper that writes ONNX nodes by hand (for the custom ops' function bodies).

`FunctionBuilder.op("MatMul", a, b)` appends a node and returns its output
name(s); `attr_int("block_size")` is a Constant whose value refers to the
function attribute of that name (`ref_attr_name`), so one FunctionProto
serves every call site. Subgraphs (Scan bodies) are built with a nested
builder and `graph()`.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

F32 = TensorProto.FLOAT
I64 = TensorProto.INT64


class FunctionBuilder:
    def __init__(self, prefix: str = "t"):
        self.nodes: list[onnx.NodeProto] = []
        self.prefix = prefix
        self._n = 0

    def _name(self, hint: str) -> str:
        self._n += 1
        return f"{self.prefix}{self._n}_{hint}"

    def op(self, op_type: str, *inputs: str, outputs: int = 1, **attrs):
        """Append one node; returns its output name (or a list when outputs > 1)."""
        outs = [self._name(op_type) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, **attrs))
        return outs[0] if outputs == 1 else outs

    # --- constants ----------------------------------------------------------
    def const(self, value, dtype=np.int64) -> str:
        """A Constant node holding `value` (numpy-convertible)."""
        arr = np.asarray(value, dtype=dtype)
        return self.op("Constant", value=numpy_helper.from_array(arr))

    def ints(self, *values: int) -> str:
        return self.const(list(values), np.int64)

    def f32(self, value: float) -> str:
        return self.const(value, np.float32)

    def _attr_const(self, attr: str, field: str, kind: int) -> str:
        out = self._name(attr)
        node = helper.make_node("Constant", [], [out])
        node.attribute.append(helper.make_attribute_ref(field, kind))
        node.attribute[-1].ref_attr_name = attr
        self.nodes.append(node)
        return out

    def attr_int(self, attr: str) -> str:
        """int64 scalar from the function attribute `attr`."""
        return self._attr_const(attr, "value_int", AttributeProto.INT)

    def attr_float(self, attr: str) -> str:
        """float32 scalar from the function attribute `attr`."""
        return self._attr_const(attr, "value_float", AttributeProto.FLOAT)

    # --- shorthands -----------------------------------------------------------
    def dim(self, x: str, axis: int) -> str:
        """1-D int64 [x.shape[axis]]."""
        if axis == -1:
            return self.op("Shape", x, start=-1)
        return self.op("Shape", x, start=axis, end=axis + 1)

    def vec(self, scalar: str) -> str:
        """int64 scalar -> 1-D [scalar]."""
        return self.op("Reshape", scalar, self.ints(1))

    def cat(self, *xs: str, axis: int = 0) -> str:
        return self.op("Concat", *xs, axis=axis)

    def f(self, x: str) -> str:
        return self.op("Cast", x, to=F32)

    def i64(self, x: str) -> str:
        return self.op("Cast", x, to=I64)

    def t(self, x: str, perm) -> str:
        return self.op("Transpose", x, perm=list(perm))

    def slice(self, x: str, start: str, end: str, axis: int) -> str:
        """x[start:end] along `axis`; start/end are 1-D int64 names."""
        return self.op("Slice", x, start, end, self.ints(axis))

    def unsq(self, x: str, *axes: int) -> str:
        return self.op("Unsqueeze", x, self.ints(*axes))

    def sum(self, x: str, axis: int, keepdims: int = 0) -> str:
        return self.op("ReduceSum", x, self.ints(axis), keepdims=keepdims)

    def silu(self, x: str) -> str:
        return self.op("Mul", x, self.op("Sigmoid", x))

    def graph(self, name: str, inputs: dict[str, int], outputs: dict[str, int], elem_type=F32) -> onnx.GraphProto:
        """The nodes so far as a subgraph; inputs / outputs: name -> rank (sizes unknown, type `elem_type`)."""

        def info(n: str, rank: int):
            return helper.make_tensor_value_info(n, elem_type, [None] * rank)

        return helper.make_graph(
            self.nodes, name, [info(n, r) for n, r in inputs.items()], [info(n, r) for n, r in outputs.items()]
        )
