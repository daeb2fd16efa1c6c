"""Exports the standard tools load, per weights placement (docs/exports.md, STEP_GRAPH.md 3).

Each placement `export` can produce is made from the embedded `tiny` model as an fp32 graph (the one
ONNX Runtime runs on a CPU) and handed to what users run: `onnx.load(path)`,
`onnx.checker.check_model(path, full_check=True)`, ONNX Runtime's `InferenceSession(path)` and the
Polygraphy CLI with the commands the README documents. What each tool does is compared with the table
`export` and `check` report (`weights.READERS` / `REFUSED_BY`): the table is a claim about the installed
onnx, ONNX Runtime and Polygraphy, checked here. TensorRT's row comes from its parser's source
(docs/exports.md); no TensorRT runs here.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner

from clover_export.artifact import manifest as A
from clover_export.cli import main
from clover_export.exporter import weights as W
from clover_export.exporter.check import check_folder
from clover_export.exporter.export import export

SMALL = dict(dtype="fp32", chunk=16, max_batch=2, slots=3)  # small profiles: a cheap validate / polygraphy run


def no_reflinks(m: pytest.MonkeyPatch) -> None:
    """A filesystem without reflinks (ext4), whatever the test machine's filesystem is."""

    def unsupported(src, dst):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    m.setattr(W, "reflink", unsupported)


def reflink_by_copy(src: Path, dst: Path) -> None:
    """Stands in for FICLONE where the filesystem has no reflinks: to every reader a reflink is what a
    copy is, a regular file with one link. Used for the exporter's choice only, never to claim that a
    real reflink loads (`test_real_reflink_export_loads_everywhere` does that where it can)."""
    shutil.copyfile(src, dst)


@pytest.fixture(scope="module")
def exports(tiny_dir, tmp_path_factory) -> dict[str, tuple[Path, W.WeightReport]]:
    """name -> (folder, weight report): the default `link` on this machine, `copy`, `map`, and `link` on a
    filesystem without reflinks for a checkpoint above `COPY_BELOW` (hard links) and one with reflinks."""
    root = tmp_path_factory.mktemp("loaders")
    out = {}

    def make(name, weights="link", **patch):
        with pytest.MonkeyPatch.context() as m:
            if patch.get("large"):
                m.setattr(A, "COPY_BELOW", 0)
            if patch.get("reflink") is False:
                no_reflinks(m)
            if patch.get("reflink") is True:
                m.setattr(W, "reflink", reflink_by_copy)
            res = export(tiny_dir, root / name, weights=weights, **SMALL)
        out[name] = (root / name, res.weights)

    make("default")  # the filesystem as it is: a copy on ext4, a reflink on btrfs / xfs
    make("copy", weights="copy")
    make("map", weights="map")
    make("hardlink", reflink=False, large=True)
    make("reflink", reflink=True, large=True)
    return out


# --- what each tool does with each placement ---------------------------------------------
def polygraphy(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The Polygraphy CLI of this environment, as a user runs it."""
    exe = Path(sys.executable).with_name("polygraphy")
    exe = str(exe) if exe.exists() else shutil.which("polygraphy")
    assert exe, "polygraphy is not installed (it is in the test extra)"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def loads(tool: str, folder: Path) -> tuple[bool, str]:
    """(accepted, error text) of one tool on DIR/model.onnx, with its external data."""
    path = str(folder / A.GRAPH)
    try:
        if tool == "onnx.load":
            onnx.load(path)
        elif tool == "onnx.checker":
            onnx.checker.check_model(path, full_check=True)
        elif tool == "onnxruntime":
            ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        elif tool == "polygraphy inspect model":
            r = polygraphy("inspect", "model", path)
            return r.returncode == 0, r.stdout + r.stderr
    except Exception as e:  # each library raises its own types
        return False, str(e)
    return True, ""


TABLE_KEY = {"onnx.load": "onnx", "onnx.checker": "onnx", "onnxruntime": "onnxruntime",
             "polygraphy inspect model": "polygraphy-onnx"}


@pytest.mark.parametrize("tool", list(TABLE_KEY))
@pytest.mark.parametrize("name", ["default", "copy", "hardlink", "map"])
def test_each_tool_loads_what_the_table_says(exports, name, tool):
    folder, report = exports[name]
    placement = report.placement
    ok, why = loads(tool, folder)
    assert ok == (TABLE_KEY[tool] not in W.REFUSED_BY[placement]), f"{tool} on a {placement} export: {why[-600:]}"
    if placement == "hardlink" and not ok:
        assert "hardlink attack" in why  # the error a user meets, and why it is named in export's warning


def test_default_export_loads_with_plain_onnx(exports):
    """Acceptance: the default mode, on this machine's filesystem, gives a folder plain onnx loads in full."""
    folder, report = exports["default"]
    assert report.mode == "link" and report.placement in ("reflink", "copy")
    graph = onnx.load(str(folder / A.GRAPH), load_external_data=False)
    lengths = {t.name: int(next(e.value for e in t.external_data if e.key == "length"))
               for t in graph.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    model = onnx.load(str(folder / A.GRAPH))
    loaded = {t.name: len(t.raw_data) for t in model.graph.initializer if t.name in lengths}
    assert len(lengths) > 100 and loaded == lengths  # every weight read, in full
    onnx.checker.check_model(str(folder / A.GRAPH), full_check=True)


@pytest.mark.parametrize("name", ["copy", "hardlink", "map"])
def test_polygraphy_replays_validate_io_in_onnxruntime(exports, name, tmp_path):
    """README: `clover-export validate DIR --save-io io.json`, then `polygraphy run DIR/model.onnx --onnxrt
    --load-inputs io.inputs.json --load-outputs io.json`. ONNX Runtime reads hard links, so a hard-linked
    folder replays like a copy, matching the reference model's and ONNX Runtime's saved outputs; a map
    folder validates (through clover's loader) but plain ONNX Runtime cannot find its weights."""
    folder, report = exports[name]
    r = CliRunner().invoke(main, ["validate", str(folder), "--steps", "1", "--save-io", str(tmp_path / "io.json")])
    assert r.exit_code == 0, r.output
    p = polygraphy("run", str(folder / A.GRAPH), "--onnxrt", "--load-inputs", "io.inputs.json",
                   "--load-outputs", "io.json", "--atol", "1e-2", "--rtol", "1e-2", cwd=tmp_path)
    log = p.stdout + p.stderr
    if "onnxruntime" in W.REFUSED_BY[report.placement]:
        assert p.returncode != 0 and "External data path" in log, log[-2000:]
        return
    assert p.returncode == 0 and "PASSED" in log, log[-2000:]
    assert log.count("Pass Rate: 100.00%") == 2  # against reference-torch and onnxruntime-cpu


def test_polygraphy_ignores_external_data_of_a_hardlinked_export(exports):
    """The remedy `check` names for inspecting a hard-linked folder's graph."""
    folder, _ = exports["hardlink"]
    r = polygraphy("inspect", "model", str(folder / A.GRAPH), "--ignore-external-data")
    assert r.returncode == 0 and "Node(s)" in r.stdout, (r.stdout + r.stderr)[-2000:]
    graph = onnx.load(str(folder / A.GRAPH), load_external_data=False)  # the other remedy, in Python
    assert any(n.op_type == "BlockGDN" for n in graph.graph.node)


# --- the exporter's choice and what it says ------------------------------------------------
def test_link_prefers_reflinks_then_copies_small_checkpoints_then_hardlinks(exports, tiny_dir):
    shard = next(tiny_dir.glob("*.safetensors")).resolve()
    placed = {name: exports[name][1] for name in ("reflink", "hardlink")}
    assert placed["reflink"].placement == "reflink" and placed["reflink"].weight_bytes_written == 0
    assert placed["hardlink"].placement == "hardlink" and placed["hardlink"].weight_bytes_written == 0
    assert os.path.samefile(exports["hardlink"][0] / "weights" / shard.name, shard)
    copied = exports["copy"][1]
    assert copied.placement == "copy" and copied.bytes_copied == shard.stat().st_size
    for name in ("reflink", "copy"):
        assert not os.path.samefile(exports[name][0] / "weights" / shard.name, shard)
        assert (exports[name][0] / "weights" / shard.name).read_bytes() == shard.read_bytes()


@pytest.mark.parametrize("reflink_ok, hardlink_ok, large, placement, mode", [
    (True, True, True, "reflink", "link"),
    (True, False, False, "reflink", "link"),
    (False, True, False, "copy", "link"),  # small: a copy loads everywhere
    (False, True, True, "hardlink", "link"),  # large: zero copy, with a warning
    (False, False, False, "copy", "link"),  # another filesystem, small: still a self-contained folder
    (False, False, True, "mapped", "map"),  # another filesystem, large: the checkpoint in place
])
def test_link_decision(tmp_path, monkeypatch, reflink_ok, hardlink_ok, large, placement, mode):
    shard = tmp_path / "src" / "model.safetensors"
    shard.parent.mkdir()
    shard.write_bytes(b"\0" * 4096)

    def fails(src, dst):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(W, "reflink", reflink_by_copy if reflink_ok else fails)
    monkeypatch.setattr(W, "hardlink", W.hardlink if hardlink_ok else fails)
    size = shard.stat().st_size
    monkeypatch.setattr(A, "COPY_BELOW", size - 1 if large else size)  # the boundary: `size` itself is small
    writer = W.WeightWriter(tmp_path / "out", "link", torch.float32, checkpoint_bytes=size)
    writer._place(shard)
    writer.close()
    rep = writer.report
    assert (rep.placement, rep.mode) == (placement, mode)
    assert rep.bytes_copied == (size if placement == "copy" else 0)
    assert bool(rep.warnings) == (placement in ("hardlink", "mapped"))


def test_hardlinked_export_warns_once_with_the_remedy(exports):
    folder, report = exports["hardlink"]
    assert len(report.warnings) == 1
    line = report.warnings[0]
    assert "\n" not in line and "hard links" in line
    for words in ("onnx.load", "onnx.checker", "polygraphy inspect model", "--weights copy",
                  "load_external_data=False", "ONNX Runtime and TensorRT read them", "docs/exports.md"):
        assert words in line, words
    m = json.loads((folder / A.MANIFEST).read_text())["weights"]
    assert m["placement"] == "hardlink" and set(m["shards"].values()) == {"hardlink"}
    assert m["warnings"] == [line] and line in m["messages"]
    for name, placement in (("default", exports["default"][1].placement), ("copy", "copy"), ("map", "mapped")):
        assert json.loads((exports[name][0] / A.MANIFEST).read_text())["weights"]["placement"] == placement
    assert not exports["copy"][1].warnings and not exports["default"][1].warnings


def test_export_command_prints_the_warning(tiny_dir, tmp_path, monkeypatch):
    no_reflinks(monkeypatch)
    monkeypatch.setattr(A, "COPY_BELOW", 0)
    r = CliRunner().invoke(main, ["export", str(tiny_dir), "--out", str(tmp_path / "o"), "--dtype", "fp32"])
    assert r.exit_code == 0, r.output
    warnings = [ln for ln in r.output.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "--weights copy" in warnings[0] and "hardlink attack" in warnings[0]
    assert "[hardlink]" in r.output
    monkeypatch.setattr(A, "COPY_BELOW", 256 * 2**20)
    r = CliRunner().invoke(main, ["export", str(tiny_dir), "--out", str(tmp_path / "small"), "--dtype", "fp32"])
    assert r.exit_code == 0 and "warning:" not in r.output and "[copy]" in r.output
    assert "were copied, not hard-linked" in r.output


# --- check ---------------------------------------------------------------------------------
def test_check_names_the_tools_that_refuse_the_folder(exports, tmp_path):
    folder, _ = exports["hardlink"]
    rep = check_folder(folder)
    assert not rep.failures
    text = "\n".join(rep.readers)
    assert "hard links (weights/" in text
    refused = next(ln for ln in rep.readers if "refused by:" in ln)
    read = next(ln for ln in rep.readers if "read by:" in ln)
    assert all(t in refused for t in W.refused_by("hardlink")) and all(t in read for t in W.read_by("hardlink"))
    assert "ONNX Runtime" not in refused and "onnx.load" not in read
    assert "--weights copy" in text and "load_external_data=False" in text
    r = CliRunner().invoke(main, ["check", str(folder)])
    assert r.exit_code == 0 and "refused by: onnx.load(path)" in r.output and "what to do:" in r.output
    # check reads the disk, not the manifest: a plain copy of the folder loads everywhere, and says so
    shutil.copytree(folder, tmp_path / "copied")
    rep = check_folder(tmp_path / "copied")
    assert rep.readers == check_folder(exports["copy"][0]).readers
    assert "read by every tool" in rep.readers[0] and len(rep.readers) == 1


def test_check_says_a_map_export_is_for_clovers_loader_only(exports):
    rep = check_folder(exports["map"][0])
    refused = next(ln for ln in rep.readers if "refused by:" in ln)
    assert all(what in refused for _, what in W.READERS.values())
    assert "ort_session" in "\n".join(rep.readers)
    assert not any("read by:" in ln for ln in rep.readers)


# --- a real reflink, where the test machine's filesystem makes one ---------------------------
def test_real_reflink_export_loads_everywhere(tiny_dir, tmp_path):
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 4096)
    try:
        W.reflink(probe, tmp_path / "probe2")
    except OSError as e:
        pytest.skip(f"no reflinks on the filesystem of {tmp_path} ({e.strerror}); the choice is tested with a stand-in")
    try:
        os.link(next(tiny_dir.glob("*.safetensors")).resolve(), tmp_path / "same-fs")
    except OSError:
        pytest.skip("the checkpoint is on another filesystem than the temp dir: no reflink possible")
    res = export(tiny_dir, tmp_path / "out", **SMALL)
    assert res.weights.placement == "reflink" and res.weights.weight_bytes_written == 0
    for tool in TABLE_KEY:
        ok, why = loads(tool, tmp_path / "out")
        assert ok, f"{tool}: {why[-600:]}"


@pytest.mark.parametrize("copy, placed", [(True, "copy"), (False, "hardlink")])
def test_link_file_copies_when_asked_and_links_otherwise(tmp_path, monkeypatch, copy, placed):
    """What export and a build's FP8 folders place a file with where the filesystem has no reflinks."""
    from clover_export.exporter import weights as W

    monkeypatch.setattr(W, "reflink", lambda src, dst: (_ for _ in ()).throw(OSError("no reflinks")))
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 100)
    assert W.link_file(src, tmp_path / "dst.bin", copy=copy) == placed
    assert (tmp_path / "dst.bin").read_bytes() == src.read_bytes()
    assert src.stat().st_nlink == (2 if placed == "hardlink" else 1)
