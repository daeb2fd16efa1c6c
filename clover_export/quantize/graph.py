"""The FP8 step graph (STEP_GRAPH.md 4): e4m3 weights + scales, Q/DQ around the standard GEMMs.

From an exported fp32 (or bf16) artifact, `quantize_graph` writes a new artifact folder:
- every GEMM weight W (attention/GDN projections, shared expert; lm_head
  optional) becomes an e4m3 initializer with fp32 per-output-channel scales,
  `DequantizeLinear(W8, s, axis=0)` feeding the graph's `Transpose -> MatMul`;
- each GEMM input x gets `QuantizeLinear -> DequantizeLinear` with a
  per-tensor scale from calibration (amax / 448), shared by the GEMMs that
  read the same x;
- the routed experts become e4m3 [E, out, in] + scales [E, out] fed to
  `clover::CoresetMoEFP8` (contract `plugins/contracts.py`, BF16
  activations; its function body dequantizes, then computes CoresetMoE, so
  ONNX Runtime runs it anywhere). Functions no node calls any more are dropped.
Weights are quantized once per build, streamed tensor by tensor from the
checkpoint (`quantize/weights.py`), into one `fp8.bin` that every FP8 graph of
the build links as `weights/fp8.bin`; nothing else is copied (the remaining
tensors keep pointing at the source's files). The Cast / Concat chains that
fed the replaced weights are dropped with them.

The graph itself is rewritten by `rewrite_fp8` (graph in, graph out, no disk); `quantize_graph` places
the weights, calls it and writes the folder through `exporter.writer.ArtifactWriter`, as `export` does.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from clover_export.artifact.manifest import COPY_BELOW, WEIGHTS_DIR, Quantization, load_artifact, read_weight_map
from clover_export.core.checkpoint import locate_tensors, plan_tensors
from clover_export.core.errors import CloverError
from clover_export.exporter.onnx_graph import node_reads
from clover_export.exporter.weights import copy_file, link_file
from clover_export.exporter.writer import ArtifactWriter
from clover_export.model.sizing import fp8_weight_names
from clover_export.plugins.contracts import CORESET_MOE, CORESET_MOE_FP8, NAMESPACE, manifest_entry
from clover_export.plugins.onnx_ops import function_proto
from clover_export.quantize import weights as fp8_weights
from clover_export.quantize.scales import activation_scale
from clover_export.quantize.weights import FP8_BIN

FP8_FILE = f"{WEIGHTS_DIR}/{FP8_BIN}"  # where every FP8 graph reads the shared weight file


@dataclass
class Fp8Report:
    gemms: int = 0
    expert_tensors: int = 0
    activations: dict[str, float] = field(default_factory=dict)  # activation tensor -> scale
    bytes_written: int = 0
    include_lm_head: bool = False

    def to_dict(self) -> dict:
        return {"gemms": self.gemms, "expert_tensors": self.expert_tensors, "activation_scales": self.activations,
                "bytes_written": self.bytes_written, "include_lm_head": self.include_lm_head,
                "weights": "e4m3fn, per-output-channel fp32 scales", "activations": "e4m3fn, per-tensor fp32 scales"}


# --- graph rewrite -----------------------------------------------------------
def _external(name: str, data_type: int, shape, location: str, offset: int, length: int) -> TensorProto:
    t = TensorProto(name=name, data_type=data_type, dims=list(shape))
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        t.external_data.add(key=k, value=v)
    return t


def _fp8_pair(name: str, entry: dict, location: str) -> tuple[TensorProto, TensorProto]:
    """The e4m3 weight and its fp32 scales, both read from the shared fp8.bin (`quantize.weights`)."""
    off, n = entry["fp8"]
    s_off, s_len, s_shape = entry["scale"]
    return (_external(f"{name}.fp8", TensorProto.FLOAT8E4M3FN, entry["shape"], location, off, n),
            _external(f"{name}.scale", TensorProto.FLOAT, s_shape, location, s_off, s_len))


def source_plans(art) -> dict:
    """The checkpoint tensor plans of an exported artifact (its manifest names the model folder)."""
    return plan_tensors(art.config, locate_tensors(art.model_dir), allow_qwen=True)


def quantize_graph(src_dir: Path, out_dir: Path, amax: dict[str, float], include_lm_head: bool = False,
                   force: bool = False, weights=None) -> Fp8Report:
    """Write the FP8 artifact of the exported folder `src_dir` into `out_dir` (atomically; `out_dir` new,
    empty, or with `force` an earlier FP8 graph: `clover_export.artifact.outdir`): the FP8 weights placed,
    the graph rewritten (`rewrite_fp8`), then written beside the source's remaining files (`ArtifactWriter`).

    `weights`: the build's shared `quantize.weights.Fp8Weights` (or its folder), linked into the new folder;
    without it the weights are quantized here (for this one graph)."""
    art = load_artifact(src_dir)
    dest = ArtifactWriter(out_dir, "fp8", command="quantize", what="the FP8 graph", force=force,
                          model_dirs=[art.dir])
    source, source_map = onnx.load(str(art.graph_path), load_external_data=False), read_weight_map(art)
    with dest:
        index, bytes_written = _place_fp8_weights(art, dest.dir, weights, include_lm_head)
        proto, report = rewrite_fp8(source, amax, index, art.dtype, include_lm_head=include_lm_head)
        report.bytes_written = bytes_written
        linked = _link_source_files(proto.graph, art.dir, dest.dir)
        manifest = art.manifest.replace(
            quantization=Quantization(str(art.dir.resolve()), report.to_dict()), ops=manifest_entry(custom_ops(proto)),
            weights=replace(art.manifest.weights, fp8_file=FP8_FILE, source_files=linked), engine=None)
        engine_bound = art.dtype != "fp32" and art.weights_mode != "map"
        pool_len = min(art.manifest.max_context, art.config.max_context)
        dest.write(proto, manifest, {"mode": art.weights_mode, "tensors": fp8_weight_map(proto, source_map)},
                   companions_from=art.dir, tensorrt_pool_len=pool_len if engine_bound else None)
        dest.commit()
    return report


def _place_fp8_weights(art, folder: Path, weights, include_lm_head: bool) -> tuple[dict[str, dict], int]:
    """FOLDER/weights/fp8.bin: the shared file linked (copied when small or on another filesystem), or
    this graph's own quantized here; returns its index and the bytes written."""
    (folder / WEIGHTS_DIR).mkdir()
    dst = folder / FP8_FILE
    if weights is None:
        own = fp8_weights.quantize_weights(source_plans(art), fp8_weight_names(art.config, include_lm_head),
                                           folder / ".fp8")
        (own.dir / FP8_BIN).rename(dst)
        shutil.rmtree(own.dir)
        return own.index, own.bytes_written
    weights = fp8_weights.load_fp8_weights(Path(weights)) if isinstance(weights, (str, Path)) else weights
    try:
        src = weights.bin.resolve()
        copied = link_file(src, dst, copy=src.stat().st_size <= COPY_BELOW) == "copy"
        return weights.index, dst.stat().st_size if copied else 0
    except OSError:  # another filesystem: one copy for this folder
        return weights.index, copy_file(weights.bin, dst)


def rewrite_fp8(proto: onnx.ModelProto, amax: dict[str, float], index: dict[str, dict], dtype: str,
                include_lm_head: bool = False, location: str = FP8_FILE) -> tuple[onnx.ModelProto, Fp8Report]:
    """The FP8 graph of an exported step graph (module docstring), without touching the disk or `proto`.

    amax: calibrated input range by weight name (`calibrate`); index: the FP8 weights' offsets in fp8.bin
    by weight name (`quantize.weights.Fp8Weights.index`: the weights it names are the ones replaced);
    dtype: the source graph's ("fp32" | "bf16"); location: where the new initializers read fp8.bin,
    relative to the graph. Returns the new graph and its report (bytes_written left 0)."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    g = out.graph
    report = Fp8Report(include_lm_head=include_lm_head)
    producer = {o: n for n in g.node for o in n.output}
    new_nodes: list[onnx.NodeProto] = []
    weight_nodes: list[onnx.NodeProto] = []  # weight DQ (+ Cast): first, their Transpose comes before the MatMul
    qdq_of: dict[str, str] = {}  # activation -> its DQ output
    g.initializer.append(helper.make_tensor("fp8_zero_point", TensorProto.FLOAT8E4M3FN, [], [0]))
    for node in g.node:
        if node.op_type == "MatMul" and node.input[1] in producer and producer[node.input[1]].op_type == "Transpose":
            tr = producer[node.input[1]]
            wname = tr.input[0]
            if wname in index:
                w8, s = _fp8_pair(wname, index[wname], location)
                g.initializer.extend([w8, s])
                weight_nodes.append(helper.make_node("DequantizeLinear", [w8.name, s.name], [f"{wname}.dq"],
                                                     axis=0, name=f"{wname}.DequantizeLinear"))
                if dtype != "fp32":
                    weight_nodes.append(helper.make_node("Cast", [f"{wname}.dq"], [f"{wname}.dq.cast"],
                                                         to=TensorProto.BFLOAT16))
                tr.input[0] = f"{wname}.dq" if dtype == "fp32" else f"{wname}.dq.cast"
                x = node.input[0]
                if x not in qdq_of:
                    qdq_of[x] = _activation_qdq(new_nodes, g, x, amax[wname], report, dtype)
                node.input[0] = qdq_of[x]
                report.gemms += 1
        if node.op_type == CORESET_MOE.name and node.domain == NAMESPACE:
            args = []
            for wname in node.input[2:4]:
                if wname not in index:
                    raise CloverError("fp8", f"{node.name}: no FP8 weights for {wname}", "an exporter bug")
                w8, s = _fp8_pair(wname, index[wname], location)
                g.initializer.extend([w8, s])
                args += [w8.name, s.name]
                report.expert_tensors += 1
            node.op_type = CORESET_MOE_FP8.name  # same attributes; inputs in the FP8 contract's order
            del node.input[2:]
            node.input.extend(args)
        new_nodes.append(node)
    _replace_nodes(g, _live(weight_nodes + new_nodes, [o.name for o in g.output]))
    read = {i for n in g.node for i in node_reads(n)}
    kept = [i for i in g.initializer if i.name in read]
    del g.initializer[:]
    g.initializer.extend(kept)
    _attach_functions(out, function_proto(CORESET_MOE_FP8))
    return out, report


def fp8_weight_map(proto: onnx.ModelProto, source_map: dict[str, dict]) -> dict[str, dict]:
    """The FP8 graph's weight map: the source's entries its initializers still read, plus the new
    external ones (e4m3 weights and fp32 scales in fp8.bin)."""
    read = {i for n in proto.graph.node for i in node_reads(n)}
    out = {k: v for k, v in source_map.items() if k in read}
    for t in proto.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL and t.name not in out:
            ext = {e.key: e.value for e in t.external_data}
            out[t.name] = {"file": ext["location"], "offset": int(ext["offset"]), "length": int(ext["length"]),
                           "dtype": "F8_E4M3" if t.data_type == TensorProto.FLOAT8E4M3FN else "F32",
                           "shape": list(t.dims)}
    return out


def custom_ops(proto: onnx.ModelProto) -> list[str]:
    """The `clover` ops the graph's nodes call, sorted."""
    return sorted({n.op_type for n in proto.graph.node if n.domain == NAMESPACE})


def _live(nodes: list[onnx.NodeProto], outputs: list[str]) -> list[onnx.NodeProto]:
    """Nodes some graph output depends on (the Cast / Concat chains of replaced weights go), in order."""
    needed, keep = set(outputs), []
    for n in reversed(nodes):
        if any(o in needed for o in n.output):
            keep.append(n)
            needed.update(node_reads(n))
    return keep[::-1]


def _activation_qdq(nodes, g, x: str, amax: float, report: Fp8Report, dtype: str) -> str:
    scale = activation_scale(amax)
    report.activations[x] = scale
    g.initializer.append(numpy_helper.from_array(np.array(scale, np.float32), f"{x}.act_scale"))
    src = x
    if dtype != "fp32":  # opset 20 Q/DQ take fp32 scales with fp32 data: cast around them
        nodes.append(helper.make_node("Cast", [x], [f"{x}.f32"], to=TensorProto.FLOAT))
        src = f"{x}.f32"
    nodes.append(helper.make_node("QuantizeLinear", [src, f"{x}.act_scale", "fp8_zero_point"], [f"{x}.q"]))
    nodes.append(helper.make_node("DequantizeLinear", [f"{x}.q", f"{x}.act_scale", "fp8_zero_point"], [f"{x}.dq"]))
    if dtype == "fp32":
        return f"{x}.dq"
    nodes.append(helper.make_node("Cast", [f"{x}.dq"], [f"{x}.dq.cast"], to=TensorProto.BFLOAT16))
    return f"{x}.dq.cast"


def _attach_functions(proto: onnx.ModelProto, fp8: onnx.FunctionProto) -> None:
    """Attach the CoresetMoEFP8 function, keep only the functions some node calls."""
    used = set(custom_ops(proto))
    kept = [f for f in proto.functions if f.domain == NAMESPACE and f.name in used and f.name != fp8.name]
    del proto.functions[:]
    proto.functions.extend(kept + ([fp8] if fp8.name in used else []))


def _replace_nodes(g, nodes) -> None:
    del g.node[:]
    g.node.extend(nodes)


def _link_source_files(g, src_dir: Path, dst_dir: Path) -> dict[str, str]:
    """Give the new folder every in-folder file the remaining initializers read: reflink, else (all of them
    together up to `COPY_BELOW`, as export decides) copy, else hard link, else (another filesystem) copy.
    ONNX and ONNX Runtime only read external data inside the model's folder."""
    locs = []
    for t in g.initializer:
        if t.data_location != TensorProto.EXTERNAL:
            continue
        loc = next(e.value for e in t.external_data if e.key == "location")
        if loc not in locs and loc != FP8_FILE and (src_dir / loc).exists():
            locs.append(loc)  # absent: a `map` entry, fed from the checkpoint by `ort_session`
    small = sum((src_dir / loc).stat().st_size for loc in locs) <= COPY_BELOW
    how = {}
    for loc in locs:
        dst = dst_dir / loc
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            how[loc] = link_file((src_dir / loc).resolve(), dst, copy=small)
        except OSError:
            copy_file((src_dir / loc).resolve(), dst)
            how[loc] = "copy"
    return how
