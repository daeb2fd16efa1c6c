"""One artifact writer for `export` and the FP8 rewrite (`exporter.writer.ArtifactWriter`): OUT claimed before
any work, the folder filled beside it and renamed into place whole; on any failure nothing at OUT changes
and no temporary folder is left."""

from __future__ import annotations

import errno
import json
import os

import pytest
from onnx import TensorProto, helper

from clover_export.artifact.manifest import FORMAT, GRAPH, MANIFEST, WEIGHT_MAP, Manifest, TrtGraph, Weights
from clover_export.core.config import load_config
from clover_export.core.errors import CloverError
from clover_export.exporter.trt_graph import TRT_GRAPH
from clover_export.exporter.writer import ArtifactWriter
from clover_export.model.loading import resolve_model_dir


def tiny_graph():
    node = helper.make_node("Relu", ["x"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    return helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 20)])


def manifest(tag: str) -> Manifest:
    """A manifest told apart by `created`; with a stale `tensorrt` entry, as a source export's manifest
    carries into its FP8 graph's."""
    cfg = load_config(resolve_model_dir("tiny"))
    return Manifest(config=cfg, model_dir="/nowhere", dtype="fp32", block_size=cfg.block_size, chunk=16, inputs=(),
                    outputs=(), profiles=(), weights=Weights("copy", {}), opset=20, ir_version=9, created=tag,
                    tensorrt=TrtGraph("stale", {}))


def write(out, tag: str, *, force=False, companions=None, tensorrt_pool_len=None, kind="export"):
    dest = ArtifactWriter(out, kind, command="export", what="the export", force=force)
    with dest:
        (dest.dir / "weights").mkdir()
        (dest.dir / "weights" / "w.bin").write_bytes(b"\0" * 8)
        n = dest.write(tiny_graph(), manifest(tag), {"mode": "copy", "tensors": {}}, companions or out.parent,
                       tensorrt_pool_len=tensorrt_pool_len)
        dest.commit()
    return n


def beside(path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}"))


def test_the_folder_appears_whole_with_the_usual_permissions(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    (model / "notes.txt").write_text("not a companion")
    out = tmp_path / "out"
    n = write(out, "first", companions=model)
    assert sorted(p.name for p in out.iterdir()) == sorted([GRAPH, MANIFEST, WEIGHT_MAP, "tokenizer.json", "weights"])
    assert n == sum((out / f).stat().st_size for f in (GRAPH, MANIFEST, WEIGHT_MAP))
    m = json.loads((out / MANIFEST).read_text())
    assert m["format"] == FORMAT and m["created"] == "first"
    assert "tensorrt" not in m  # no model.trt.onnx written: no entry for it
    assert json.loads((out / WEIGHT_MAP).read_text()) == {"mode": "copy", "tensors": {}}
    mask = os.umask(0)
    os.umask(mask)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~mask  # not mkdtemp's 0700
    assert beside(out) == []


def test_the_tensorrt_graph_is_written_and_recorded(tmp_path):
    out = tmp_path / "out"
    n = write(out, "trt", tensorrt_pool_len=64)
    m = json.loads((out / MANIFEST).read_text())
    assert m["tensorrt"] == {"graph": TRT_GRAPH, "plugin_nodes": {}} and (out / TRT_GRAPH).is_file()
    assert n == sum((out / f).stat().st_size for f in (GRAPH, MANIFEST, WEIGHT_MAP, TRT_GRAPH))


def test_a_failure_before_commit_changes_nothing_at_out(tmp_path):
    out = tmp_path / "out"
    write(out, "first")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    dest = ArtifactWriter(out, "export", command="export", what="the export", force=True)
    with pytest.raises(RuntimeError, match="check failed"):
        with dest:
            dest.write(tiny_graph(), manifest("second"), {"mode": "copy", "tensors": {}}, tmp_path)
            raise RuntimeError("check failed")
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert beside(out) == []
    write(out, "second", force=True)  # the same with a commit: replaced
    assert json.loads((out / MANIFEST).read_text())["created"] == "second" and beside(out) == []


def test_an_os_error_is_one_line_naming_the_file_and_nothing_is_written(tmp_path):
    out = tmp_path / "out"
    dest = ArtifactWriter(out, "fp8", command="quantize", what="the FP8 graph")
    with pytest.raises(CloverError) as e:
        with dest:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "weights/fp8.bin")
    assert str(e.value).splitlines()[0] == "[quantize] writing the FP8 graph failed: No space left on device " \
                                           "(weights/fp8.bin)"
    assert "nothing was written" in str(e.value)
    assert not out.exists() and beside(out) == []


def test_out_is_claimed_before_any_work(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    with pytest.raises(CloverError, match="is not empty"):
        ArtifactWriter(out, "export", command="export", what="the export", force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]


def test_the_fp8_rewrite_writes_through_it(tiny_fp32_export, tmp_path, monkeypatch):
    """`quantize_graph`'s failure while it places the FP8 weights: the writer's one line, nothing at OUT."""
    from clover_export.quantize import graph as fp8
    from clover_export.quantize import weights as fp8_weights

    def disk_full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "weights/fp8.bin")

    monkeypatch.setattr(fp8_weights, "quantize_weights", disk_full)
    with pytest.raises(CloverError, match=r"^\[quantize\] writing the FP8 graph failed: No space left on device"):
        fp8.quantize_graph(tiny_fp32_export, tmp_path / "fp8", {})
    assert list(tmp_path.iterdir()) == []
