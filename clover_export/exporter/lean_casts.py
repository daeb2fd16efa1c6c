"""What ONNX Runtime runs of an fp32 graph of a bf16 checkpoint: its weight casts kept small.

An fp32 graph of a bf16 checkpoint references the stored bf16 tensors and
casts them in the graph (`weights.py`: `<name>__bf16` -> Cast -> `<name>`).
As traced, every step then materialises whole fp32 copies it does not
need, which at full size cost seconds and GBs per step (profiled on the
full-width slice: `python bench/build_fullsize.py --only bf16`; figures in
bench/results/HISTORY.md):

- the embedding table (248 k rows x 2048) cast whole, then one row per
  token gathered: here the bf16 rows are gathered first and only they cast;
- `x @ Transpose(Cast(W))` of every linear layer (torch.onnx's `linear`):
  the fp32 transpose of the lm_head alone is 2 GiB and 6.5 s a step; here
  `Gemm(transB=1)` reads W as it is (x flattened to 2-D, reshaped back);
- the routed experts ([E, 2I, D], [E, D, I]) cast whole before the
  `CoresetMoE` node: its function body casts one expert at a time inside
  its expert Scan (`onnx_bodies.expert_loop`), so here the node gets the
  stored tensor.

The graph on disk stays as traced (it is what `quantize`, the FP8 twin
check and TensorRT read); `exporter.session.ort_session` applies `lean_graph` to
the copy it hands to ONNX Runtime. Graphs without such casts (fp32
checkpoints, bf16 graphs) come back unchanged.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from clover_export.exporter.onnx_graph import node_reads
from clover_export.plugins.contracts import NAMESPACE

_MOE_WEIGHT_INPUTS = {"CoresetMoE": (2, 3)}  # gate_up, down (contract order: x, router_w, gate_up, down)


def weight_casts(g: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """Cast output -> node, for the fp32 casts of stored-dtype weights (`weights.stored_name` -> its name)."""
    from clover_export.exporter.weights import logical_name

    return {n.output[0]: n for n in g.node if n.op_type == "Cast" and _int(n, "to", 0) == TensorProto.FLOAT
            and n.input[0] != n.output[0] and logical_name(n.input[0]) == n.output[0]}


def lean_graph(proto: onnx.ModelProto) -> bool:
    """Rewrite `proto` in place (module docstring); True when anything changed."""
    g = proto.graph
    casts = weight_casts(g)
    if not casts:
        return False
    shapes = {t.name: list(t.dims) for t in g.initializer}
    transposes = {n.output[0]: n for n in g.node if n.op_type == "Transpose" and n.input[0] in casts
                  and _ints(n, "perm") == [1, 0]}
    out = []
    for n in g.node:
        if n.op_type == "Gather" and n.input[0] in casts:
            rows = f"{n.output[0]}__stored_rows"
            out.append(helper.make_node("Gather", [casts[n.input[0]].input[0], n.input[1]], [rows],
                                        name=f"{n.name}/stored", axis=_int(n, "axis", 0)))
            out.append(helper.make_node("Cast", [rows], [n.output[0]], name=f"{n.name}/cast", to=TensorProto.FLOAT))
            continue
        if n.op_type == "MatMul" and n.input[1] in transposes:
            w = transposes[n.input[1]].input[0]
            shape = shapes.get(casts[w].input[0], [])
            if len(shape) == 2:
                out += _gemm(n, w, shape)
                continue
        if n.domain == NAMESPACE and n.op_type in _MOE_WEIGHT_INPUTS:
            for i in _MOE_WEIGHT_INPUTS[n.op_type]:
                if n.input[i] in casts:
                    n.input[i] = casts[n.input[i]].input[0]
        out.append(n)
    del g.node[:]
    g.node.extend(out)
    _drop_unread(g)  # the replaced transposes, then the casts only they read
    return True


def feed_weights(proto: onnx.ModelProto, weights: dict[str, tuple[int, list[int]]]) -> list[str]:
    """Turn the weight values `weights` (name -> (ONNX elem type, shape)) into graph inputs: the fp32 casts of
    stored tensors, or the bf16 per-expert Concat + Reshape the `CoresetMoE` node reads. The caller then feeds
    each once-prepared array with every run (no per-step 2 GiB lm_head cast or 2.4 GiB expert concat).
    Returns the stored initializers no node reads any more (removed from the graph)."""
    g = proto.graph
    producer = {o: n for n in g.node for o in n.output}
    for w, (elem, shape) in weights.items():
        g.node.remove(producer[w])
        g.input.append(helper.make_tensor_value_info(w, elem, shape))
    read = _drop_unread(g)  # the weight chains left unread (Concat pieces, shapes, casts)
    gone = [t.name for t in g.initializer if t.name not in read]
    kept = [t for t in g.initializer if t.name in read]
    del g.initializer[:]
    g.initializer.extend(kept)
    return gone


def _drop_unread(g: onnx.GraphProto) -> set[str]:
    """Remove the nodes whose outputs nothing reads (repeatedly: chains go whole); returns the names read."""
    outputs = {o.name for o in g.output}
    while True:
        read = {i for n in g.node for i in node_reads(n)} | outputs
        dead = [n for n in g.node if not any(o in read for o in n.output)]
        if not dead:
            return read
        for n in dead:
            g.node.remove(n)


def _gemm(n, w: str, shape: list[int]) -> list:
    """x @ W^T for x [..., K], W [N, K] as Reshape -> Gemm(transB) -> Reshape (ONNX Gemm is 2-D only)."""
    x, y, p = n.input[0], n.output[0], n.name or n.output[0]
    N, K = shape

    def const(name, vals):
        return helper.make_node("Constant", [], [name],
                                value=helper.make_tensor(name, TensorProto.INT64, [len(vals)], vals))

    return [
        const(f"{p}/k", [-1, K]), const(f"{p}/n", [N]),
        helper.make_node("Reshape", [x, f"{p}/k"], [f"{p}/x2"], name=f"{p}/x2"),
        helper.make_node("Gemm", [f"{p}/x2", w], [f"{p}/y2"], name=f"{p}/gemm", transB=1),
        helper.make_node("Shape", [x], [f"{p}/lead"], name=f"{p}/lead", end=-1),
        helper.make_node("Concat", [f"{p}/lead", f"{p}/n"], [f"{p}/shape"], name=f"{p}/shape", axis=0),
        helper.make_node("Reshape", [f"{p}/y2", f"{p}/shape"], [y], name=p),
    ]


def _ints(n, name):
    return next((list(a.ints) for a in n.attribute if a.name == name), [])


def _int(n, name, default):
    return next((a.i for a in n.attribute if a.name == name), default)
