"""The TensorRT-bound FP8 graph (`onnx-fp8-bf16`) is the measured `onnx-fp8` up to dtype (verify/twins.py).

The twins are made as `build` makes them (one calibration, both exports rewritten); each mutation
below is a difference between them that ONNX Runtime cannot see (it only runs onnx-fp8), and must be caught.
Slow: the twins take two exports and a calibration (~1 min here).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from clover_export.artifact.manifest import load_artifact
from clover_export.core.errors import CloverError
from clover_export.exporter.export import export
from clover_export.exporter.weights import logical_name
from clover_export.model.sizing import fp8_weight_names
from clover_export.quantize import calibration
from clover_export.quantize import graph as fp8
from clover_export.quantize.weights import FP8_BIN
from clover_export.verify.twins import compare_twins, find_twin, require_twins

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def twins(tiny_dir, tmp_path_factory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("twins")
    for dtype in ("fp32", "bf16"):
        export(tiny_dir, out / f"onnx-{dtype}", dtype=dtype, max_batch=2)
    block = load_artifact(out / "onnx-fp32").block_size
    amax = calibration.calibrate(
        tiny_dir, calibration.calibration_steps(tiny_dir, calibration.BUILTIN_PROMPTS[:4], block), block
    )
    fp8.quantize_graph(out / "onnx-fp32", out / "onnx-fp8", amax)
    fp8.quantize_graph(out / "onnx-bf16", out / "onnx-fp8-bf16", amax)
    return out / "onnx-fp8", out / "onnx-fp8-bf16"


def mutated(twins, tmp_path, change) -> Path:
    """A copy of the bf16 twin with `change(proto, folder)` applied to its graph."""
    bad = tmp_path / "onnx-fp8-bf16"
    shutil.copytree(twins[1], bad, symlinks=True)
    proto = onnx.load(str(bad / "model.onnx"), load_external_data=False)
    change(proto, bad)
    onnx.save(proto, str(bad / "model.onnx"))
    return bad


def test_the_build_twins_are_the_same_graph(twins):
    rep = compare_twins(*twins)
    assert not rep.differences, rep
    assert rep.nodes > 500 and rep.fp8_bytes_compared > 0, rep


def act_scale_times_10(proto, _):
    t = next(t for t in proto.graph.initializer if t.name.endswith(".act_scale"))
    t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * 10, t.name))


def weight_scale_nudged(proto, folder):
    t = next(t for t in proto.graph.initializer if t.name.endswith(".scale"))
    if t.data_location != TensorProto.EXTERNAL:
        a = numpy_helper.to_array(t).copy()
        a.flat[0] = np.nextafter(a.flat[0], np.float32(1))  # one ulp: byte-equality, not a tolerance
        t.CopyFrom(numpy_helper.from_array(a, t.name))
        return
    ext = {e.key: e.value for e in t.external_data}  # in the shared FP8 weight file: patch the copy's bytes
    path, off = folder / ext["location"], int(ext.get("offset", 0))
    data = bytearray(path.read_bytes())
    a = np.frombuffer(bytes(data[off:off + 4]), np.float32).copy()
    a[0] = np.nextafter(a[0], np.float32(1))
    data[off:off + 4] = a.tobytes()
    path.unlink()  # a hard link of the twin's file: write a new one
    path.write_bytes(bytes(data))


def e4m3_byte_flipped(proto, folder):
    t = next(t for t in proto.graph.initializer
             if t.data_type == TensorProto.FLOAT8E4M3FN and t.data_location == TensorProto.EXTERNAL)
    ext = {e.key: e.value for e in t.external_data}
    path = folder / ext["location"]
    data = bytearray(path.read_bytes())
    data[int(ext.get("offset", 0)) + 5] ^= 0x01
    path.unlink()  # a hard link to the build's file: write a new one
    path.write_bytes(bytes(data))


def qdq_dropped(proto, _):
    """An activation's Q/DQ pair bypassed: the GEMM reads the unquantized activation."""
    g = proto.graph
    q = next(n for n in g.node if n.op_type == "QuantizeLinear")
    dq = next(n for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0])
    for n in g.node:
        for i, x in enumerate(n.input):
            if x == dq.output[0]:
                n.input[i] = q.input[0]
    kept = [n for n in g.node if n is not q and n is not dq]
    del g.node[:]
    g.node.extend(kept)


def top_k_changed(proto, _):
    node = next(n for n in proto.graph.node if n.op_type == "CoresetMoEFP8")
    a = next(a for a in node.attribute if a.name == "top_k")
    a.i += 1


def matmul_inputs_swapped(proto, _):
    node = next(n for n in proto.graph.node if n.op_type == "Add")
    node.input[0], node.input[1] = node.input[1], node.input[0]


def function_body_changed(proto, _):
    f = next(f for f in proto.functions if f.name == "CoresetMoEFP8")
    node = next(n for n in f.node if n.op_type == "Softmax") if any(n.op_type == "Softmax" for n in f.node) \
        else next(n for n in f.node if n.op_type not in ("Cast", "Constant"))
    node.op_type = {"Softmax": "LogSoftmax"}.get(node.op_type, "Identity" if node.op_type != "Identity" else "Neg")


MUTATIONS = [act_scale_times_10, weight_scale_nudged, e4m3_byte_flipped, qdq_dropped, top_k_changed,
             matmul_inputs_swapped, function_body_changed]


@pytest.mark.parametrize("change", MUTATIONS, ids=lambda f: f.__name__)
def test_a_difference_between_the_twins_is_caught(twins, tmp_path, change):
    bad = mutated(twins, tmp_path, change)
    with pytest.raises(CloverError, match="differs from its onnx-fp8 twin") as e:
        require_twins(twins[0], bad)
    assert "onnx-fp8-bf16 (the graph TensorRT builds from)" in str(e.value)


# --- a fault in every kind of tensor, not only the first one the graph holds ------------------------------------
def kind_of(name: str) -> str:
    """An initializer's kind: its name without the layer index (and an activation scale's layer tag)."""
    return re.sub(r"layers\.\d+\.", "layers.N.", re.sub(r"@L\d+\.", "@LN.", name))


def layer_of(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.|@L(\d+)\.", name)
    return int(next(g for g in m.groups() if g is not None)) if m else -1


def last_of_each_kind(proto, select) -> dict[str, onnx.TensorProto]:
    """kind -> its instance in the last layer that has one (the first is where a skipped check shows up least)."""
    out: dict[str, onnx.TensorProto] = {}
    for t in proto.graph.initializer:
        if select(t) and layer_of(t.name) >= layer_of(out.get(kind_of(t.name), t).name):
            out[kind_of(t.name)] = t
    return out


def in_fp8_file(t: onnx.TensorProto) -> bool:
    return t.data_location == TensorProto.EXTERNAL and any(
        e.key == "location" and Path(e.value).name == FP8_BIN for e in t.external_data)


def in_checkpoint(t: onnx.TensorProto) -> bool:
    return t.data_location == TensorProto.EXTERNAL and not in_fp8_file(t)


def rewrite_tensor_bytes(folder: Path, t: onnx.TensorProto, change) -> None:
    """change(bytearray) on the bytes of external tensor `t` in `folder`'s copy of its file."""
    ext = {e.key: e.value for e in t.external_data}
    path, off, n = folder / ext["location"], int(ext.get("offset", 0)), int(ext["length"])
    data = bytearray(path.read_bytes())
    chunk = bytearray(data[off:off + n])
    change(chunk)
    data[off:off + n] = chunk
    path.unlink()  # possibly a hard link of the twin's file: write a new one
    path.write_bytes(bytes(data))


def flip_middle_byte(chunk: bytearray) -> None:
    chunk[len(chunk) // 2] ^= 0x01


def nudge_middle_float(chunk: bytearray) -> None:
    a = np.frombuffer(bytes(chunk), np.float32).copy()
    a[len(a) // 2] = np.nextafter(a[len(a) // 2], np.float32(np.inf))  # one ulp: byte-equality, not a tolerance
    chunk[:] = a.tobytes()


def reported_initializers(rep) -> set[str]:
    return {m.group(1) for d in rep.differences if (m := re.match(r"initializer (\S+): ", d))}


def test_a_fault_in_every_fp8_weight_and_scale_kind_is_caught(twins, tmp_path, tiny_dir):
    """One fault in the middle of the last layer's tensor of every kind the FP8 weight file holds: the e4m3
    weights of every GEMM, the routed experts' included, and their fp32 scales. Every one is reported."""
    from clover_export.core.config import load_config

    faulted: list[str] = []

    def change(proto, folder):
        for t in last_of_each_kind(proto, in_fp8_file).values():
            fp8_bytes = t.data_type == TensorProto.FLOAT8E4M3FN
            rewrite_tensor_bytes(folder, t, flip_middle_byte if fp8_bytes else nudge_middle_float)
            faulted.append(logical_name(t.name))

    bad = mutated(twins, tmp_path, change)
    gemms = {kind_of(n) for n in fp8_weight_names(load_config(tiny_dir))}  # independent: what FP8 quantizes
    assert {kind_of(n) for n in faulted} == {g + sfx for g in gemms for sfx in (".fp8", ".scale")}
    assert any(".mlp.experts." in n for n in faulted)
    rep = compare_twins(twins[0], bad)
    assert reported_initializers(rep) == set(faulted) and len(rep.differences) == len(faulted), rep.differences


def test_a_changed_activation_scale_of_every_kind_is_caught(twins, tmp_path):
    """Each kind of inline activation scale, doubled in its last layer (exact in fp32 and bf16): a difference."""
    base = onnx.load(str(twins[1] / "model.onnx"), load_external_data=False)
    kinds = last_of_each_kind(base, lambda t: t.name.endswith(".act_scale"))
    assert len(kinds) >= 4, sorted(kinds)
    for i, (kind, chosen) in enumerate(sorted(kinds.items())):
        def doubled(proto, _):
            t = next(t for t in proto.graph.initializer if t.name == chosen.name)
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * 2, t.name))

        (tmp_path / str(i)).mkdir()
        assert compare_twins(twins[0], mutated(twins, tmp_path / str(i), doubled)).differences, kind


def test_a_reshaped_checkpoint_weight_of_every_kind_is_caught(twins, tmp_path):
    """The weights both twins read from the checkpoint (norms, router, GDN, embedding, lm_head): compared by name
    and shape (their values are validated against the reference model with each export)."""
    faulted: list[str] = []

    def change(proto, _):
        for t in last_of_each_kind(proto, in_checkpoint).values():
            t.dims[0] += 1
            faulted.append(logical_name(t.name))

    bad = mutated(twins, tmp_path, change)
    assert {kind_of(n) for n in faulted} >= {"model.layers.N.mlp.gate.weight", "model.norm.weight", "lm_head.weight"}
    rep = compare_twins(twins[0], bad)
    assert reported_initializers(rep) == set(faulted), rep.differences


def test_extra_casts_are_not_a_difference(twins, tmp_path):
    """Dtype-only nodes are looked through: a Cast round trip inserted before a GEMM changes nothing."""
    def cast_round_trip(proto, _):
        g = proto.graph
        mm = next(n for n in g.node if n.op_type == "MatMul")
        x = mm.input[0]
        casts = [helper.make_node("Cast", [x], [f"{x}.c1"], to=TensorProto.FLOAT),
                 helper.make_node("Cast", [f"{x}.c1"], [f"{x}.c2"], to=TensorProto.BFLOAT16)]
        mm.input[0] = f"{x}.c2"
        nodes = list(g.node)
        i = nodes.index(mm)
        del g.node[:]
        g.node.extend(nodes[:i] + casts + nodes[i:])

    assert not compare_twins(twins[0], mutated(twins, tmp_path, cast_round_trip)).differences


def test_validate_judges_the_bf16_twin_through_its_fp32_twin(twins, tmp_path):
    assert find_twin(twins[1]) == twins[0]
    lonely = tmp_path / "alone" / "onnx-fp8-bf16"
    shutil.copytree(twins[1], lonely, symlinks=True)
    with pytest.raises(CloverError, match="0 candidates"):
        find_twin(lonely)
