"""The two FP8 graphs of a build are twins: `onnx-fp8` (fp32 activations, what ONNX Runtime measures) and
`onnx-fp8-bf16` (bf16 activations, what TensorRT builds the engine from; ONNX Runtime's CPU EP cannot run
it). Only the first is measured, so the second must be the same graph up to dtype (issue 10):

  - the same nodes in the same order, with the same attributes and the same wiring, once Cast nodes
    (the only dtype-dependent ops the exporter and the FP8 rewrite add) are looked through;
  - the same graph inputs and outputs (names and shapes; float dtypes may differ);
  - the same initializer names and shapes; fp32 initializers of both graphs (weight scales, activation
    scales, constants) bit-equal, or equal after rounding to bf16 where one graph holds them in bf16;
    the e4m3 weights byte-equal (read from both folders' fp8 weight files);
  - the same model-local functions (the custom ops' bodies), node for node.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from clover_export.errors import CloverError

FULL_COMPARE_BYTES = 2 * 1024**3  # e4m3 weights up to this size are compared whole, larger ones at both ends
END_BYTES = 1 << 20
SHOWN = 5  # differences listed in an error


@dataclass
class TwinReport:
    nodes: int
    initializers: int
    fp8_bytes_compared: int
    differences: list[str]

    def __str__(self) -> str:
        if self.differences:
            return f"differs from its onnx-fp8 twin in {len(self.differences)} place(s): " + "; ".join(
                self.differences[:SHOWN]) + (" ..." if len(self.differences) > SHOWN else "")
        return (f"same graph as onnx-fp8 up to dtype: {self.nodes} nodes, {self.initializers} initializers, "
                f"{self.fp8_bytes_compared / 2**20:.1f} MiB of e4m3 weights byte-equal")


def _attr_key(a: onnx.AttributeProto):
    """An attribute, dtype-blind: a tensor value compares as float64 rounded to bf16, `to` of a Cast is dropped."""
    v = helper.get_attribute_value(a)
    if isinstance(v, onnx.TensorProto):
        arr = numpy_helper.to_array(v)
        return (a.name, tuple(arr.shape), _bf16(arr).tobytes() if arr.dtype.kind == "f" else arr.tobytes())
    if isinstance(v, (onnx.GraphProto, list)) and v and isinstance(v[0] if isinstance(v, list) else v, onnx.GraphProto):
        raise CloverError("fp8", f"attribute {a.name}: subgraphs are not compared")
    if isinstance(v, list):
        return (a.name, tuple(x.decode() if isinstance(x, bytes) else x for x in v))
    return (a.name, v.decode() if isinstance(v, bytes) else v)


def _bf16(arr: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even to bf16, kept as the upper 16 bits of float32 (exact for bf16 inputs)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    return t.to(torch.bfloat16).view(torch.int16).numpy()


def canonical_nodes(nodes) -> list[tuple]:
    """Each non-Cast node as (domain, op_type, attributes, inputs, name); an input that is a node output becomes
    (index of its producer among the kept nodes, output position), a Cast's output its Cast's input."""
    alias: dict[str, str] = {}
    where: dict[str, tuple[int, int]] = {}
    out = []
    for node in nodes:
        if node.op_type == "Cast" and node.domain in ("", "ai.onnx"):
            alias[node.output[0]] = alias.get(node.input[0], node.input[0])
            continue
        ins = []
        for x in node.input:
            x = alias.get(x, x)
            ins.append(where.get(x, x))
        attrs = tuple(sorted(_attr_key(a) for a in node.attribute))
        for j, o in enumerate(node.output):
            where[o] = (len(out), j)
        out.append((node.domain, node.op_type, attrs, tuple(ins), node.name or f"#{len(out)}"))
    return out


def _compare_nodes(what: str, a, b, diffs: list[str]) -> int:
    ca, cb = canonical_nodes(a), canonical_nodes(b)
    for i, (x, y) in enumerate(zip(ca, cb)):
        if x[:4] != y[:4]:
            field = next(f for f, u, v in zip(("domain", "op", "attributes", "inputs"), x, y) if u != v)
            diffs.append(f"{what} node {i} ({x[4]} vs {y[4]}): {field} {_short(x, field)} vs {_short(y, field)}")
            return len(ca)  # the wiring of everything after it is off too
    if len(ca) != len(cb):
        diffs.append(f"{what}: {len(ca)} vs {len(cb)} nodes (Casts aside)")
    return len(ca)


def _short(node, field) -> str:
    v = node[("domain", "op", "attributes", "inputs").index(field)]
    s = repr(v)
    return s if len(s) < 120 else s[:117] + "..."


def _values(t: onnx.TensorProto, folder: Path) -> np.ndarray | None:
    """Values of an inline initializer (None for external data, compared separately or not at all)."""
    if t.data_location == TensorProto.EXTERNAL:
        return None
    if t.data_type == TensorProto.BFLOAT16:
        raw = np.frombuffer(t.raw_data, np.int16) if t.raw_data else np.array(t.int32_data, np.int32).astype(np.int16)
        return raw.reshape(tuple(t.dims))
    return numpy_helper.to_array(t)


def _external_bytes(t: onnx.TensorProto, folder: Path, budget: bool) -> bytes:
    ext = {e.key: e.value for e in t.external_data}
    off, n = int(ext.get("offset", 0)), int(ext["length"])
    with open(folder / ext["location"], "rb") as f:
        if budget or n <= 2 * END_BYTES:
            f.seek(off)
            return f.read(n)
        f.seek(off)
        head = f.read(END_BYTES)
        f.seek(off + n - END_BYTES)
        return head + f.read(END_BYTES)


def compare_twins(fp8_dir: str | Path, fp8_bf16_dir: str | Path) -> TwinReport:
    """Every difference between the two FP8 graphs beyond dtype (see the module docstring)."""
    fp8_dir, bf_dir = Path(fp8_dir), Path(fp8_bf16_dir)
    a, b = (onnx.load(str(d / "model.onnx"), load_external_data=False) for d in (fp8_dir, bf_dir))
    diffs: list[str] = []
    nodes = _compare_nodes("graph", a.graph.node, b.graph.node, diffs)

    def io(vs):
        return [(v.name, tuple(d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim)) for v in vs]

    for kind, x, y in (("inputs", a.graph.input, b.graph.input), ("outputs", a.graph.output, b.graph.output)):
        if io(x) != io(y):
            diffs.append(f"graph {kind} differ: {sorted(set(io(x)) ^ set(io(y)))[:SHOWN]}")
    fa, fb = {f.name: f for f in a.functions}, {f.name: f for f in b.functions}
    if set(fa) != set(fb):
        diffs.append(f"functions differ: {sorted(set(fa) ^ set(fb))}")
    for name in sorted(set(fa) & set(fb)):
        _compare_nodes(f"function {name}", fa[name].node, fb[name].node, diffs)

    ia, ib = {t.name: t for t in a.graph.initializer}, {t.name: t for t in b.graph.initializer}
    if set(ia) != set(ib):
        diffs.append(f"initializers only on one side: {sorted(set(ia) ^ set(ib))[:SHOWN]}")
    fp8_names = [n for n in sorted(set(ia) & set(ib)) if ia[n].data_type == TensorProto.FLOAT8E4M3FN]
    total = sum(int(next((e.value for e in ia[n].external_data if e.key == "length"), 0)) for n in fp8_names)
    whole, compared = total <= FULL_COMPARE_BYTES, 0
    for n in sorted(set(ia) & set(ib)):
        ta, tb = ia[n], ib[n]
        if list(ta.dims) != list(tb.dims):
            diffs.append(f"initializer {n}: shape {list(ta.dims)} vs {list(tb.dims)}")
            continue
        if (ta.data_type == TensorProto.FLOAT8E4M3FN) != (tb.data_type == TensorProto.FLOAT8E4M3FN):
            diffs.append(f"initializer {n}: e4m3 on one side only")
            continue
        if ta.data_type == TensorProto.FLOAT8E4M3FN:
            if TensorProto.EXTERNAL in (ta.data_location, tb.data_location):
                xa, xb = _external_bytes(ta, fp8_dir, whole), _external_bytes(tb, bf_dir, whole)
            else:
                xa, xb = ta.raw_data, tb.raw_data
            compared += len(xa)
            if xa != xb:
                diffs.append(f"initializer {n}: e4m3 bytes differ")
            continue
        va, vb = _values(ta, fp8_dir), _values(tb, bf_dir)
        if va is None or vb is None:
            continue  # unquantised weights: external data of the two validated exports
        if ta.data_type == tb.data_type:
            same = va.dtype == vb.dtype and va.tobytes() == vb.tobytes()
        elif TensorProto.BFLOAT16 in (ta.data_type, tb.data_type):
            la, lb = (v if t.data_type == TensorProto.BFLOAT16 else _bf16(v) for v, t in ((va, ta), (vb, tb)))
            same = la.tobytes() == lb.tobytes()
        else:
            same = False
        if not same:
            diffs.append(f"initializer {n}: values differ" + (
                f" ({va.ravel()[:3].tolist()} vs {vb.ravel()[:3].tolist()})" if va.dtype == vb.dtype else ""))
    return TwinReport(nodes, len(ia), compared, diffs)


def require_twins(fp8_dir: str | Path, fp8_bf16_dir: str | Path) -> TwinReport:
    """`compare_twins`, raising a CloverError (the build's engine stage never sees a differing twin)."""
    rep = compare_twins(fp8_dir, fp8_bf16_dir)
    if rep.differences:
        raise CloverError("fp8", f"{Path(fp8_bf16_dir).name} (the graph TensorRT builds from) {rep}",
                          "only onnx-fp8 is measured; this is a bug in the FP8 rewrite or the bf16 export")
    return rep
