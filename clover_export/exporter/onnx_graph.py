"""What a node of an ONNX graph reads: shared by the export's node order, the lean copy and the FP8 rewrite."""

from __future__ import annotations

import onnx


def node_reads(node: onnx.NodeProto) -> list[str]:
    """The names a node reads, in order: its inputs (empty optional inputs left out), then every name its
    subgraphs' nodes read (If / Loop / Scan bodies; a superset of the outer-scope names they use)."""
    names = [i for i in node.input if i]
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            for n in g.node:
                names += node_reads(n)
    return names
