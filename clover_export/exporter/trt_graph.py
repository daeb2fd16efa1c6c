"""`model.trt.onnx`: the graph TensorRT parses, beside `model.onnx` (STEP_GRAPH.md 2, 4).

TensorRT's ONNX parser silently imports a custom node's model-local
function body when no plugin creator matches it (and always on TensorRT
< 10.7): the engine would build without our plugins, with no aliasing and
Scan/ScatterND bodies. So the graph handed to TensorRT differs from
`model.onnx` in four ways only:
- no FunctionProtos: a plugin that is not registered is a parse error;
- where the pools hold >= 2048 positions (`launch.attention_split_cap`), each
  BlockAttention node is BlockAttentionSplit + BlockAttentionMerge, the
  flash-decoding partials a graph tensor (an AOT plugin is one kernel with no
  workspace); the split count is a shape expression of B and T computed at
  build time for the GPU (`launch.attention_splits`), the partials' rows a
  monotone bound on it (`launch.attention_partial_rows`);
- each CoresetMoE / CoresetMoEFP8 node is split into single-kernel AOT
  sub-ops (contracts.MOE_SUBOPS) with the intermediates as graph tensors:
  router logits (Transpose + MatMul, as the Linear layers), MoERoute,
  MoEAlign, MoEGateUp(FP8), MoEDown(FP8), MoECombine;
- every plugin node carries `aot=1`, TensorRT's per-node choice of the AOT
  implementation (NVIDIA/TensorRT samples/python/quickly_deployable_plugins,
  "ONNX model with an AOT plugin").
Initializers keep the same external-data entries: both files read the same
weight files. Users can hand exactly this file to polygraphy or trtexec.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx
from onnx import helper

from clover_export.artifact.manifest import TrtGraph
from clover_export.plugins.contracts import (
    BLOCK_ATTENTION,
    BLOCK_ATTENTION_MERGE,
    BLOCK_ATTENTION_SPLIT,
    CORESET_MOE,
    CORESET_MOE_FP8,
    NAMESPACE,
    PLUGIN_VERSION,
    TRT_CONTRACTS,
)

TRT_GRAPH = "model.trt.onnx"
AOT_ATTR = "aot"
MOE_SPLIT = {  # CoresetMoE(FP8) -> its sub-ops, in launch order (the router MatMul comes first)
    CORESET_MOE.name: ("MoERoute", "MoEAlign", "MoEGateUp", "MoEDown", "MoECombine"),
    CORESET_MOE_FP8.name: ("MoERoute", "MoEAlign", "MoEGateUpFP8", "MoEDownFP8", "MoECombine"),
}


def _plugin_node(op: str, inputs: list[str], outputs: list[str], name: str, **attrs) -> onnx.NodeProto:
    return helper.make_node(op, inputs, outputs, name=name, domain=NAMESPACE, plugin_namespace=NAMESPACE,
                            plugin_version=PLUGIN_VERSION, **{AOT_ATTR: 1}, **attrs)


def split_moe(node: onnx.NodeProto, num_experts: int) -> list[onnx.NodeProto]:
    """The nodes replacing one CoresetMoE / CoresetMoEFP8 node (same graph inputs and outputs)."""
    fp8 = node.op_type == CORESET_MOE_FP8.name
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute
             if a.name in {s.name for s in CORESET_MOE.attributes}}
    n = node.name or node.output[0]
    x, router_w = node.input[0], node.input[1]
    routed, coreset_size = node.output
    t = {k: f"{n}/{k}" for k in ("router_wT", "logits", "idx", "w", "offsets", "order", "h", "y")}
    nodes = [
        helper.make_node("Transpose", [router_w], [t["router_wT"]], name=f"{n}/router_Transpose", perm=[1, 0]),
        helper.make_node("MatMul", [x, t["router_wT"]], [t["logits"]], name=f"{n}/router_MatMul"),
        _plugin_node("MoERoute", [t["logits"]], [t["idx"], t["w"], coreset_size], f"{n}/MoERoute", **attrs),
        _plugin_node("MoEAlign", [t["idx"]], [t["offsets"], t["order"]], f"{n}/MoEAlign", num_experts=num_experts),
    ]
    if fp8:
        gu, gus, dn, dns = node.input[2:6]
        nodes += [_plugin_node("MoEGateUpFP8", [x, gu, gus, t["offsets"], t["order"]], [t["h"]], f"{n}/MoEGateUpFP8"),
                  _plugin_node("MoEDownFP8", [t["h"], dn, dns, t["w"], t["offsets"], t["order"]], [t["y"]],
                               f"{n}/MoEDownFP8")]
    else:
        gu, dn = node.input[2:4]
        nodes += [_plugin_node("MoEGateUp", [x, gu, t["offsets"], t["order"]], [t["h"]], f"{n}/MoEGateUp"),
                  _plugin_node("MoEDown", [t["h"], dn, t["w"], t["offsets"], t["order"]], [t["y"]], f"{n}/MoEDown")]
    nodes.append(_plugin_node("MoECombine", [t["y"], t["idx"]], [routed], f"{n}/MoECombine", num_experts=num_experts))
    return nodes


def split_attention_node(node: onnx.NodeProto, max_splits: int) -> list[onnx.NodeProto]:
    """BlockAttention -> BlockAttentionSplit + BlockAttentionMerge (same graph inputs and outputs; the partials
    `<node>/acc`, `<node>/ml` and the split count `<node>/splits` are graph tensors)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute
             if a.name in {s.name for s in BLOCK_ATTENTION.attributes}}
    n = node.name or node.output[0]
    o, key_out, value_out = node.output
    acc, ml, splits = f"{n}/acc", f"{n}/ml", f"{n}/splits"
    return [_plugin_node(BLOCK_ATTENTION_SPLIT.name, list(node.input), [acc, ml, splits, key_out, value_out],
                         f"{n}/{BLOCK_ATTENTION_SPLIT.name}", **attrs, max_splits=max_splits),
            _plugin_node(BLOCK_ATTENTION_MERGE.name, [acc, ml, splits, node.input[0]], [o],
                         f"{n}/{BLOCK_ATTENTION_MERGE.name}")]


def trt_graph(proto: onnx.ModelProto, num_experts: int, pool_len: int = 0) -> onnx.ModelProto:
    """`model.onnx` -> what TensorRT parses (see the module docstring); the input proto is not changed.
    `pool_len`: the pools' capacity the export was made for (its profiles'); 0: attention is not split."""
    from clover_export.plugins.triton.launch import attention_split_cap

    max_splits = attention_split_cap(pool_len)
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    del out.functions[:]
    nodes = []
    for node in out.graph.node:
        if node.domain != NAMESPACE:
            nodes.append(node)
        elif node.op_type in MOE_SPLIT:
            nodes += split_moe(node, num_experts)
        elif node.op_type == BLOCK_ATTENTION.name and max_splits > 1:
            nodes += split_attention_node(node, max_splits)
        else:
            if not any(a.name == AOT_ATTR for a in node.attribute):
                node.attribute.append(helper.make_attribute(AOT_ATTR, 1))
            nodes.append(node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def write_trt_graph(folder: Path, proto: onnx.ModelProto, num_experts: int, pool_len: int) -> TrtGraph:
    """Write FOLDER/model.trt.onnx from the folder's `model.onnx` proto; returns the manifest record."""
    g = trt_graph(proto, num_experts, pool_len)
    onnx.save_model(g, str(Path(folder) / TRT_GRAPH))
    return TrtGraph(TRT_GRAPH, dict(sorted(plugin_nodes(g).items())))


def plugin_nodes(proto: onnx.ModelProto) -> Counter:
    """Plugin op -> count of `clover` nodes: one TensorRT plugin layer each after parsing."""
    return Counter(n.op_type for n in proto.graph.node if n.domain == NAMESPACE)


def expected_plugin_layers(proto: onnx.ModelProto) -> int:
    """The number of plugin layers in namespace `clover` the parsed network must have."""
    return sum(plugin_nodes(proto).values())


def unknown_plugin_ops(proto: onnx.ModelProto) -> list[str]:
    return sorted(op for op in plugin_nodes(proto) if op not in TRT_CONTRACTS)
