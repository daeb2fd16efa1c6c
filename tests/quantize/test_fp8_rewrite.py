"""The FP8 rewrite alone (`quantize.graph.rewrite_fp8`, STEP_GRAPH.md 4): hand-made graphs in memory, no export,
no disk. The reference is computed here in torch from the same e4m3 bytes and scales."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from clover_export.plugins.contracts import CORESET_MOE, NAMESPACE
from clover_export.plugins.onnx_ops import OPSET, function_proto, node_attributes
from clover_export.quantize import graph as fp8
from clover_export.quantize.scales import dequantize, quantize, quantize_weight


def _gemm_graph(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """h [2, 4] -> h @ W.T for each weight, as torch.onnx traces `linear` (Transpose -> MatMul). "a.weight"
    comes out of a stored-dtype Cast, as an fp32 graph of a bf16 checkpoint reads it (`exporter.weights`)."""
    nodes = [helper.make_node("Cast", ["a.weight__f16"], ["a.weight"], to=TensorProto.FLOAT)]
    inits = [numpy_helper.from_array(weights["a.weight"].astype(np.float16), "a.weight__f16")]
    inits += [numpy_helper.from_array(w, n) for n, w in weights.items() if n != "a.weight"]
    outputs = []
    for i, name in enumerate(weights):
        nodes += [helper.make_node("Transpose", [name], [f"{name}.T"], perm=[1, 0]),
                  helper.make_node("MatMul", ["h", f"{name}.T"], [f"y{i}"])]
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [2, weights[name].shape[0]]))
    graph = helper.make_graph(nodes, "gemms", [helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, 4])],
                              outputs, initializer=inits)
    return helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", OPSET)])


def _fp8_blob(weights: dict[str, torch.Tensor]) -> tuple[dict[str, dict], bytes]:
    """An fp8.bin in memory and its index (`quantize.weights` layout: e4m3 bytes, then fp32 scales)."""
    blob, index = bytearray(), {}
    for name, w in weights.items():
        q, s = quantize_weight(w)
        at = len(blob)
        blob += q.view(torch.uint8).numpy().tobytes()
        s_at = len(blob)
        blob += s.numpy().astype(np.float32).tobytes()
        index[name] = {"shape": list(w.shape), "fp8": [at, w.numel()], "scale": [s_at, 4 * s.numel(), list(s.shape)]}
    return index, bytes(blob)


def _inline(proto: onnx.ModelProto, location: str, blob: bytes) -> onnx.ModelProto:
    """The external initializers reading `location` given their bytes from `blob` (run without a folder)."""
    for t in proto.graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        if t.data_location == TensorProto.EXTERNAL and ext["location"] == location:
            off, n = int(ext["offset"]), int(ext["length"])
            del t.external_data[:]
            t.data_location = TensorProto.DEFAULT
            t.raw_data = blob[off:off + n]
    return proto


def test_rewrite_alone_computes_qdq_gemms_and_leaves_its_input_alone():
    """`rewrite_fp8` on a hand-made graph: the GEMMs whose weight the index names read the e4m3 weight
    dequantized per output channel and their input quantized per tensor at amax / 448, one Q/DQ shared by
    the GEMMs reading the same input; the other GEMM, the input proto and the disk are untouched. The
    reference is computed here in torch from the same e4m3 bytes and scales."""
    g = torch.Generator().manual_seed(0)
    w = {n: torch.randn(rows, 4, generator=g).half().float() for n, rows in (("a.weight", 3), ("b.weight", 5),
                                                                           ("c.weight", 2))}
    proto = _gemm_graph({n: t.numpy() for n, t in w.items()})
    before = proto.SerializeToString()
    index, blob = _fp8_blob({n: w[n] for n in ("a.weight", "b.weight")})  # c.weight stays as it is
    amax = {"a.weight": 3.5, "b.weight": 3.5}
    new, report = fp8.rewrite_fp8(proto, amax, index, "fp32", location="mem/fp8.bin")

    assert proto.SerializeToString() == before
    assert report.gemms == 2 and report.expert_tensors == 0 and report.activations == {"h": 3.5 / 448}
    assert report.bytes_written == 0
    ops = [n.op_type for n in new.graph.node]
    assert ops.count("QuantizeLinear") == 1 and ops.count("DequantizeLinear") == 3 and "Cast" not in ops
    inits = {t.name for t in new.graph.initializer}
    assert {"a.weight.fp8", "a.weight.scale", "b.weight.fp8", "b.weight.scale", "c.weight"} <= inits
    assert not inits & {"a.weight__f16", "b.weight"}  # replaced weights and their Cast chain are gone
    onnx.checker.check_model(_inline(new, "mem/fp8.bin", blob), full_check=True)

    h = torch.randn(2, 4, generator=g) * 2
    got = ort.InferenceSession(new.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"h": h.numpy()})
    s_h = torch.tensor(3.5 / 448)
    h_dq = dequantize(quantize(h, s_h), s_h)
    for i, name in enumerate(w):
        if name in index:
            q, s = quantize_weight(w[name])
            want = h_dq @ dequantize(q, s).T
        else:
            want = h @ w[name].T
        np.testing.assert_allclose(got[i], want.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_rewrite_alone_turns_coreset_moe_into_its_fp8_op():
    """A `CoresetMoE` node becomes `CoresetMoEFP8` with the e4m3 experts and their scales in the FP8 contract's
    order; the FP8 function is attached, CoresetMoE's dropped; a bf16 graph's GEMM weights are cast back to
    bf16 after dequantization and its activations cast to fp32 around the Q/DQ."""
    E, D, I = 4, 4, 3
    g = torch.Generator().manual_seed(1)
    experts = {"gu": torch.randn(E, 2 * I, D, generator=g), "dn": torch.randn(E, D, I, generator=g),
               "r.weight": torch.randn(2, D, generator=g)}
    index, _ = _fp8_blob(experts)
    moe = helper.make_node(CORESET_MOE.name, ["h", "router", "gu", "dn"], ["routed", "size"], domain=NAMESPACE,
                           **node_attributes(CORESET_MOE, dict(top_k=2, top_p=0.9, coreset=True, block_size=2)))
    nodes = [moe, helper.make_node("Transpose", ["r.weight"], ["r.T"], perm=[1, 0]),
             helper.make_node("MatMul", ["routed", "r.T"], ["y"])]
    bf16 = TensorProto.BFLOAT16
    graph = helper.make_graph(
        nodes, "moe", [helper.make_tensor_value_info(n, bf16, None) for n in ("h", "router", "gu", "dn", "r.weight")],
        [helper.make_tensor_value_info(n, t, None) for n, t in (("y", bf16), ("size", TensorProto.INT32))])
    proto = helper.make_model(graph, ir_version=9, functions=[function_proto(CORESET_MOE)],
                              opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(NAMESPACE, 1)])
    new, report = fp8.rewrite_fp8(proto, {"r.weight": 2.0}, index, "bf16")

    assert report.expert_tensors == 2 and report.gemms == 1
    node = next(n for n in new.graph.node if n.domain == NAMESPACE)
    assert node.op_type == "CoresetMoEFP8" and list(node.input) == ["h", "router", "gu.fp8", "gu.scale",
                                                                     "dn.fp8", "dn.scale"]
    assert [f.name for f in new.functions] == ["CoresetMoEFP8"]
    assert fp8.custom_ops(new) == ["CoresetMoEFP8"]
    loc = {t.name: {e.key: e.value for e in t.external_data}["location"] for t in new.graph.initializer
           if t.data_location == TensorProto.EXTERNAL}
    assert set(loc) == {"gu.fp8", "gu.scale", "dn.fp8", "dn.scale", "r.weight.fp8", "r.weight.scale"}
    assert set(loc.values()) == {"weights/fp8.bin"}
    producer = {o: n for n in new.graph.node for o in n.output}
    transpose = producer["r.T"]
    assert transpose.input[0] == "r.weight.dq.cast" and producer["r.weight.dq.cast"].op_type == "Cast"
    matmul = producer["y"]
    assert matmul.input[0] == "routed.dq.cast"
    chain = ["Cast", "QuantizeLinear", "DequantizeLinear", "Cast"]  # bf16 -> fp32 -> e4m3 -> fp32 -> bf16
    x, seen = "routed.dq.cast", []
    while x != "routed":
        seen.append(producer[x].op_type)
        x = producer[x].input[0]
    assert seen[::-1] == chain
