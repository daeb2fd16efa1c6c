"""The two FP8 graphs of a build are twins: `onnx-fp8` (fp32 activations, what ONNX Runtime measures) and
`onnx-fp8-bf16` (bf16 activations, what TensorRT builds the engine from; ONNX Runtime's CPU EP cannot run
it). Only the first is measured, so the second must be the same graph up to dtype:

  - the same nodes in the same order, with the same attributes and the same wiring, once Cast nodes
    (the only dtype-dependent ops the exporter and the FP8 rewrite add) are looked through;
  - the same graph inputs and outputs (names and shapes; float dtypes may differ);
  - inline initializers (weight scales, activation scales, constants) compared by value where the nodes
    use them: bit-equal, or equal after rounding to bf16 where one graph holds them in bf16 (their names
    follow activation names, which differ between the twins);
  - the same external initializers (weights) by name and shape; the e4m3 ones byte-equal, read from
    both folders' FP8 weight files (whole up to FULL_COMPARE_BYTES, else both ends of each tensor);
  - the same model-local functions (the custom ops' bodies), node for node.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from clover_export.core.errors import CloverError
from clover_export.exporter.weights import logical_name
from clover_export.quantize.weights import FP8_BIN

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


def _attr_key(a: onnx.AttributeProto, alias: dict, where: dict):
    """An attribute, dtype-blind: a tensor value compares rounded to bf16; a subgraph (Loop/Scan/If body)
    compares canonically, with names it takes from the enclosing graph resolved as there."""
    if a.ref_attr_name:  # a function body's reference to the caller's attribute
        return (a.name, "ref", a.ref_attr_name)
    v = helper.get_attribute_value(a)
    if isinstance(v, onnx.TensorProto):
        arr = numpy_helper.to_array(v)
        return (a.name, tuple(arr.shape), _bf16(arr).tobytes() if arr.dtype.kind == "f" else arr.tobytes())
    if isinstance(v, onnx.GraphProto):
        return (a.name, "graph", _canonical_graph(v, alias, where))
    if isinstance(v, list):
        if v and isinstance(v[0], onnx.GraphProto):
            return (a.name, "graphs", tuple(_canonical_graph(g, alias, where) for g in v))
        return (a.name, tuple(x.decode() if isinstance(x, bytes) else x for x in v))
    return (a.name, v.decode() if isinstance(v, bytes) else v)


def _canonical_graph(g: onnx.GraphProto, alias: dict, where: dict) -> tuple:
    inner = {**where, **{x.name: ("in", k) for k, x in enumerate(g.input)}}
    nodes, inner_where = _canonical(g.node, dict(alias), inner)
    outs = tuple(inner_where.get(alias.get(o.name, o.name), o.name) for o in g.output)
    return tuple(n[:4] for n in nodes), outs


def _bf16(arr: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even to bf16, kept as the upper 16 bits of float32 (exact for bf16 inputs)."""
    import torch

    t = torch.from_numpy(np.array(arr, dtype=np.float32))
    return t.to(torch.bfloat16).view(torch.int16).numpy()


def canonical_nodes(nodes, consts: dict | None = None) -> list[tuple]:
    """Each non-Cast node as (domain, op_type, attributes, inputs, name); an input that is a node output becomes
    (index of its producer among the kept nodes, output position), a Cast's output its Cast's input, and an
    inline initializer its value (`consts`: name -> key; their names follow activation names, which differ)."""
    return _canonical(nodes, {}, dict(consts or {}))[0]


def _const_key(t: onnx.TensorProto) -> tuple:
    if t.data_type == TensorProto.BFLOAT16:
        raw = np.frombuffer(t.raw_data, np.int16) if t.raw_data else np.array(t.int32_data, np.int32).astype(np.int16)
        return ("const", "bf16", tuple(t.dims), raw.tobytes())
    arr = numpy_helper.to_array(t)
    return ("const", str(arr.dtype), tuple(t.dims), arr.tobytes())


def _same_input(x, y) -> bool:
    """Equal wiring; an fp32 constant matches a bf16 one that is its bf16 rounding."""
    if x == y:
        return True
    if not (isinstance(x, tuple) and isinstance(y, tuple) and x[:1] == y[:1] == ("const",) and x[2] == y[2]):
        return False
    (f, fb), (b, bb) = sorted([(x[1], x[3]), (y[1], y[3])], key=lambda p: p[0] == "bf16")
    return f == "float32" and b == "bf16" and _bf16(np.frombuffer(fb, np.float32)).tobytes() == bb


def _same_node(x, y) -> bool:
    return x[:3] == y[:3] and len(x[3]) == len(y[3]) and all(map(_same_input, x[3], y[3]))


def _canonical(nodes, alias: dict, where: dict) -> tuple[list[tuple], dict]:
    where = dict(where)
    out = []
    for node in nodes:
        if node.op_type == "Cast" and node.domain in ("", "ai.onnx"):
            alias[node.output[0]] = alias.get(node.input[0], node.input[0])
            continue
        ins = tuple(where.get(alias.get(x, x), alias.get(x, x)) for x in node.input)
        attrs = tuple(sorted((_attr_key(a, alias, where) for a in node.attribute), key=repr))
        for j, o in enumerate(node.output):
            where[o] = (len(out), j)
        out.append((node.domain, node.op_type, attrs, ins, node.name or f"#{len(out)}"))
    return out, where


def _compare_nodes(what: str, a, b, diffs: list[str], consts=({}, {})) -> int:
    ca, cb = canonical_nodes(a, consts[0]), canonical_nodes(b, consts[1])
    for i, (x, y) in enumerate(zip(ca, cb)):
        if not _same_node(x, y):
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


def _in_fp8_file(t: onnx.TensorProto) -> bool:
    """Stored in the build's shared FP8 weight file (`quantize/weights.py`)."""
    return any(e.key == "location" and Path(e.value).name == FP8_BIN for e in t.external_data)


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
    # inline initializers by value; external ones (weights) by the tensor they hold: an fp32 graph reads the
    # checkpoint's bf16 tensor under `weights.stored_name` and casts it in the graph
    consts = [{t.name: _const_key(t) if t.data_location != TensorProto.EXTERNAL else ("ext", logical_name(t.name))
               for t in m.graph.initializer} for m in (a, b)]
    nodes = _compare_nodes("graph", a.graph.node, b.graph.node, diffs, consts)

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

    # external initializers (weights) by name; inline ones were compared by value where the nodes use them
    ia, ib = ({logical_name(t.name): t for t in m.graph.initializer if t.data_location == TensorProto.EXTERNAL}
              for m in (a, b))
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
        if ta.data_type == TensorProto.FLOAT8E4M3FN or _in_fp8_file(ta) or _in_fp8_file(tb):
            # the quantizer's output (e4m3 weights and their fp32 scales): byte-equal
            xa, xb = _external_bytes(ta, fp8_dir, whole), _external_bytes(tb, bf_dir, whole)
            compared += len(xa)
            if xa != xb:
                kind = "e4m3" if ta.data_type == TensorProto.FLOAT8E4M3FN else "fp8-file"
                diffs.append(f"initializer {n}: {kind} bytes differ")
        # unquantized weights: the external data of the two exports, each validated against the reference
    return TwinReport(nodes, len(ia), compared, diffs)


def require_twins(fp8_dir: str | Path, fp8_bf16_dir: str | Path) -> TwinReport:
    """`compare_twins`, raising a CloverError (the build's engine stage never sees a differing twin)."""
    rep = compare_twins(fp8_dir, fp8_bf16_dir)
    if rep.differences:
        raise CloverError("fp8", f"{Path(fp8_bf16_dir).name} (the graph TensorRT builds from) {rep}",
                          "only onnx-fp8 is measured; this is a bug in the FP8 rewrite or the bf16 export")
    return rep


def find_twin(bf16_dir: str | Path) -> Path:
    """The fp32-activation twin of an FP8 graph on bf16 activations: a sibling FP8 graph on fp32 activations of
    the same config (in a build: `onnx-fp8` beside `onnx-fp8-bf16`)."""
    from clover_export.artifact.manifest import MANIFEST, Manifest

    bf16_dir = Path(bf16_dir).absolute()
    mine = Manifest.load(bf16_dir, component="validate").config.fingerprint()
    found = []
    for d in sorted(bf16_dir.parent.iterdir()):
        try:
            m = Manifest.load(d) if (d / MANIFEST).is_file() else None
        except CloverError:  # not a graph of this version: not a twin
            continue
        if m is not None and m.quantization is not None and m.dtype == "fp32" and m.config.fingerprint() == mine:
            found.append(d)
    if len(found) != 1:
        raise CloverError("validate", f"{bf16_dir}: an FP8 graph on bf16 activations is validated through its "
                          f"fp32-activation twin, and {len(found)} candidates lie beside it "
                          f"({', '.join(d.name for d in found) or 'none'})",
                          "validate it inside its build folder (onnx-fp8 beside onnx-fp8-bf16)")
    return found[0]
