"""Build the L-layer step graph from a traced prototype with one layer of each kind.

Tracing costs time per layer (torch.export + decompositions: ~0.7 s CPU per
layer here); the layers of one kind are the same code with other weights.
So `trace.py` traces a prototype whose layers are the distinct kinds in
order of first appearance (Clover: [GDN, attention]) and this module stamps
out the real layer list:

- nodes are assigned to prototype layer j by torch's name scope
  (`model.layers.{j}`); within layer j, the nodes that depend on its hidden
  state input, its weights (`model.layers.{j}.*`) or its pools
  (`past_key_values.{j}.*`) are *per-layer*; every other node (constants,
  masks and sizes computed from the step inputs) is shared and kept once;
- per-layer nodes are copied for each layer i of that kind with weights,
  pools and `present.*` outputs renamed to layer i and internal values
  suffixed `@L{i}`; layer i's hidden input is layer i-1's hidden output;
- after the layers: the final norm / lm_head reads the last layer's hidden
  output; the per-layer kept-set sizes (`coreset_size`) are stacked over all
  layers.

Anything unexpected raises `ReplicationError`; `trace.py` then traces the
whole model instead. Tests compare both graphs output for output.
"""

from __future__ import annotations

import ast
import re

import onnx

from clover_export.core import names
from clover_export.core.config import CloverConfig

SCOPE = "pkg.torch.onnx.name_scopes"
_LAYER = re.compile(r"model\.layers\.(\d+)$")
_SHAPE_OPS = {"Shape", "Size"}
_DROP_META = {"pkg.torch.onnx.stack_trace", "pkg.torch.onnx.fx_node"}


class ReplicationError(Exception):
    pass


def prototype_kinds(cfg: CloverConfig) -> tuple[str, ...]:
    return tuple(dict.fromkeys(cfg.layer_types))


def _layer_of(node) -> int | None:
    for p in node.metadata_props:
        if p.key == SCOPE:
            for s in ast.literal_eval(p.value):
                m = _LAYER.match(s)
                if m:
                    return int(m.group(1))
    return None


def replicate(proto: onnx.ModelProto, kinds: tuple[str, ...], cfg: CloverConfig) -> onnx.ModelProto:
    """The prototype graph (layers = `kinds`) turned into cfg's layer list (see the module docstring)."""
    g = proto.graph
    nodes = list(g.node)
    layer = [_layer_of(n) for n in nodes]
    producer = {o: k for k, n in enumerate(nodes) for o in n.output}
    graph_inputs = {v.name for v in g.input}
    # values that carry data from the tokens (sizes taken with Shape do not)
    data = {names.INPUT_IDS}
    for n in nodes:
        if n.op_type not in _SHAPE_OPS and any(i in data for i in n.input):
            data.update(n.output)

    per_layer: dict[int, list[int]] = {}  # prototype layer -> indices of its per-layer nodes
    h_in: dict[int, str] = {}
    for j in range(len(kinds)):
        own = [k for k, lj in enumerate(layer) if lj == j]
        external = {i for k in own for i in nodes[k].input if i and (i not in producer or layer[producer[i]] != j)}
        hidden = sorted(i for i in external if i in data and i not in graph_inputs)
        if len(hidden) != 1:
            raise ReplicationError(f"layer {j}: expected one hidden-state input, found {hidden}")
        h_in[j] = hidden[0]
        varying = {h_in[j]}
        w_prefix, p_prefix = names.layer(j), f"past_key_values.{j}."
        idx = []
        for k in own:
            n = nodes[k]
            if any(i in varying or i.startswith((w_prefix, p_prefix)) for i in n.input if i):
                varying.update(n.output)
                idx.append(k)
        per_layer[j] = idx
    replicated = {k for idx in per_layer.values() for k in idx}
    made_by = {o: j for j, idx in per_layer.items() for k in idx for o in nodes[k].output}

    # outputs of each prototype layer used after it: hidden state (next layer / final norm), kept-set size
    consumers: dict[str, list[int]] = {}
    for k, n in enumerate(nodes):
        for i in n.input:
            consumers.setdefault(i, []).append(k)
    h_out, sizes = {}, {}
    for j in range(len(kinds)):
        for v in (o for k in per_layer[j] for o in nodes[k].output):
            outside = [c for c in consumers.get(v, []) if c not in replicated or made_by.get(nodes[c].output[0]) != j]
            if not outside:
                continue
            if all(nodes[c].op_type == "Unsqueeze" and layer[c] is None for c in outside):
                sizes[j] = v
            elif (j + 1 < len(kinds) and v == h_in[j + 1]) or j + 1 == len(kinds):
                if j in h_out and h_out[j] != v:
                    raise ReplicationError(f"layer {j}: two hidden outputs {h_out[j]}, {v}")
                h_out[j] = v
    for j in range(len(kinds)):
        if j not in h_out or j not in sizes:
            raise ReplicationError(f"layer {j}: hidden output or kept-set size not found")
    if any(len(consumers[sizes[j]]) != 1 for j in range(len(kinds))):
        raise ReplicationError("a kept-set size is read by more than the stacking Unsqueeze")
    stack_parts = {consumers[sizes[j]][0]: j for j in range(len(kinds))}  # Unsqueeze node -> layer
    stack = {c for k in stack_parts for c in consumers.get(nodes[k].output[0], [])}
    if len(stack) != 1 or nodes[next(iter(stack))].op_type != "Concat":
        raise ReplicationError("the per-layer kept-set sizes do not meet in one Concat")
    stack_node = next(iter(stack))

    # --- assemble: shared nodes, the layers, then what reads the layers' outputs -------------
    tainted = set(made_by)
    tail = []
    for k, n in enumerate(nodes):
        if k not in replicated and any(i in tainted for i in n.input):
            tainted.update(n.output)
            tail.append(k)
    shared = [k for k in range(len(nodes)) if k not in replicated and k not in set(tail)]
    out_nodes = [_clean(nodes[k]) for k in shared]
    template = {kind: j for j, kind in enumerate(kinds)}
    hidden = h_in[0]
    unsqueezed = []
    for i, kind in enumerate(cfg.layer_types):
        j = template[kind]
        rename = {h_in[j]: hidden}
        out_nodes += [_copy(nodes[k], i, j, rename) for k in per_layer[j]]
        hidden = rename[h_out[j]]
        unsq = next(k for k, lj in stack_parts.items() if lj == j)
        out_nodes.append(_copy(nodes[unsq], i, j, {sizes[j]: rename[sizes[j]]}))
        unsqueezed.append(out_nodes[-1].output[0])
    final = h_out[len(kinds) - 1]  # what the final norm read in the prototype
    for k in tail:
        if k in stack_parts:
            continue
        n = _clean(nodes[k])
        if k == stack_node:
            del n.input[:]
            n.input.extend(unsqueezed)
        for pos, i in enumerate(n.input):
            if i == final:
                n.input[pos] = hidden
            elif producer.get(i) in replicated:
                raise ReplicationError(f"{n.op_type} after the layers reads {i}, an internal value of a layer")
        out_nodes.append(n)

    new = onnx.ModelProto()
    new.CopyFrom(proto)
    del new.graph.node[:]
    new.graph.node.extend(out_nodes)
    del new.graph.value_info[:]
    _io(new.graph, proto.graph, kinds, cfg)
    return new


def _copy(n, i: int, j: int, rename: dict[str, str]):
    """Node n of prototype layer j as layer i: weights, pools, present.* renamed; internals suffixed."""
    c = _clean(n)
    c.name = f"L{i}/{n.name}"
    wj, wi = names.layer(j), names.layer(i)
    for pos, v in enumerate(c.input):
        if v in rename:
            c.input[pos] = rename[v]
        elif v.startswith(wj):
            c.input[pos] = wi + v[len(wj):]
        elif v.startswith(f"past_key_values.{j}."):
            c.input[pos] = f"past_key_values.{i}." + v[len(f"past_key_values.{j}."):]
    for pos, v in enumerate(c.output):
        new = f"present.{i}." + v[len(f"present.{j}."):] if v.startswith(f"present.{j}.") else f"{v}@L{i}"
        rename[v] = new
        c.output[pos] = new
    for p in c.metadata_props:
        p.value = re.sub(rf"model\.layers\.{j}(?!\d)", f"model.layers.{i}", p.value)
    return c


def _clean(n):
    c = onnx.NodeProto()
    c.CopyFrom(n)
    keep = [p for p in c.metadata_props if p.key not in _DROP_META]
    del c.metadata_props[:]
    c.metadata_props.extend(keep)
    return c


def _io(graph, proto_graph, kinds, cfg) -> None:
    """Graph inputs / outputs of the full layer list, typed like the prototype's."""
    template = {kind: j for j, kind in enumerate(kinds)}
    ins = {v.name: v for v in proto_graph.input}
    outs = {v.name: v for v in proto_graph.output}

    def renamed(vi, new_name):
        c = onnx.ValueInfoProto()
        c.CopyFrom(vi)
        c.name = new_name
        return c

    new_in = [ins[n] for n in names.STEP_INPUTS]
    new_out = [outs[names.LOGITS], outs[names.CORESET_SIZE]]
    for n in names.pool_names(cfg):
        i = int(n.split(".")[1])
        j = template[cfg.layer_types[i]]
        src = f"past_key_values.{j}." + n.split(".", 2)[2]
        new_in.append(renamed(ins[src], n))
        new_out.append(renamed(outs[names.present_name(src)], names.present_name(n)))
    new_out.append(outs[names.CAUSAL_LOGITS])
    new_out[1].type.tensor_type.shape.dim[1].dim_value = cfg.num_hidden_layers
    del graph.input[:]
    graph.input.extend(new_in)
    del graph.output[:]
    graph.output.extend(new_out)
