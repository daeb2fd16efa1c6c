"""manifest.json through `artifact.manifest.Manifest` only: what its writers write (export, the build's stages
that run without TensorRT) is what each backend's reader reads; another format version is refused by name;
nothing outside `artifact/` reads or writes it as a dict."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import clover_export
from clover_export.artifact.manifest import FORMAT, MANIFEST, Manifest, load_artifact
from clover_export.core.errors import CloverError
from clover_export.model.loading import resolve_model_dir

CONTEXT = 256  # the build's --max-context: below the embedded default's 2048, so a reader of the config's is seen
GRAPHS = ("onnx-fp32", "onnx-bf16", "onnx-fp8", "onnx-fp8-bf16")
# manifest.json's keys as the previous release wrote them (a dict literal in exporter/export.py), by hand
EXPORT_KEYS = {"format", "format_version", "graph", "weight_map", "model_dir", "config", "config_fingerprint", "dtype",
               "block_size", "chunk", "opset", "ir_version", "inputs", "outputs", "dynamic_dims", "profiles", "ops",
               "weights", "tools", "created"}


@pytest.fixture(scope="module")
def small_build(tmp_path_factory):
    """An fp8 build of the embedded default (whole-graph validation: the stages that run without TensorRT)."""
    from clover_export.pipeline.build import BuildOptions, build

    out = tmp_path_factory.mktemp("manifest") / "build"
    build(None, out, BuildOptions(max_batch=2, max_context=CONTEXT, validation="whole"))
    return out


def engine_folder_copy(graph: Path, dest: Path) -> Path:
    """The graph folder without its weights, with a stand-in plan file: what the trt backend's reader sees."""
    shutil.copytree(graph, dest, ignore=shutil.ignore_patterns("weights"))
    (dest / "engine.plan").write_bytes(b"plan")
    return dest


@pytest.mark.slow
def test_every_graph_a_build_writes_reads_the_same_through_each_backend(small_build, tmp_path):
    from clover_export.backends.ort_backend import OrtBackend
    from clover_export.backends.trt_backend import read_engine_folder

    for name in GRAPHS:
        folder = small_build / name
        m = Manifest.load(folder)
        assert (m.max_context, m.max_batch, m.block_size) == (CONTEXT, 2, 32), name
        assert Path(m.model_dir) == resolve_model_dir("tiny").resolve(), name
        assert (m.quantization is not None) == ("fp8" in name) and (m.tensorrt is not None) == ("bf16" in name)
        if m.quantization is not None:  # onnx-fp8 from onnx-fp32, onnx-fp8-bf16 from onnx-bf16
            source = "onnx-fp32" if name == "onnx-fp8" else "onnx-bf16"
            assert Path(m.quantization.source) == (small_build / source).resolve()
            assert (folder / m.weights.fp8_file).is_file()
        if m.tensorrt is not None:
            assert (folder / m.tensorrt.graph).is_file()
        trt = read_engine_folder(engine_folder_copy(folder, tmp_path / name))
        assert (trt.max_context, trt.block_size, trt.source_dir) == (CONTEXT, 32, tmp_path / name), name
        assert trt.bf16 == name.endswith("bf16") and trt.plan == tmp_path / name / "engine.plan"
        assert (trt.refit_graph, trt.stripped) == (tmp_path / name / "model.onnx", False)  # no engine recorded
        if not name.endswith("bf16"):  # ONNX Runtime's CPU EP runs no bf16 graph
            ort = OrtBackend.load(folder)
            assert (ort.max_context, ort.block_size, ort.source_dir) == (CONTEXT, 32, folder), name


@pytest.mark.slow
def test_the_engine_stage_s_record_is_where_the_trt_reader_finds_plan_and_refit_graph(small_build, tmp_path):
    from clover_export.backends.trt_backend import read_engine_folder
    from clover_export.pipeline.stages import record_engine

    folder = engine_folder_copy(small_build / "onnx-fp8-bf16", tmp_path / "g")
    (folder / "engine.plan").rename(folder / "built.plan")  # the manifest names the plan: not found by its suffix
    (folder / "other.plan").write_bytes(b"not this one")
    # the keys `engines.builder.build_engine` returns (its last statement), values as a weight-stripped build's
    info = {"tensorrt": "10.13.0", "plan": "built.plan", "bytes": 4, "graph": "model.trt.onnx", "plugin_layers": 6,
            "profiles": ["decode", "prefill"], "stripped": True, "fp8_builder_flag": False,
            "aot_shared_memory_bytes": 0}
    record_engine(folder, info)
    m = json.loads((folder / MANIFEST).read_text())
    assert m["engine"] == "engine.plan" and m["engine_info"] == info  # the builder's record kept whole
    (folder / "built.plan").rename(folder / "engine.plan")
    trt = read_engine_folder(folder)
    assert (trt.plan, trt.refit_graph, trt.stripped) == (folder / "engine.plan", folder / "model.trt.onnx", True)
    assert Manifest.load(folder).engine.tensorrt == "10.13.0"


@pytest.mark.slow
def test_the_file_keeps_the_previous_release_s_layout(small_build):
    """A manifest written before the typed one loads unchanged: the keys on disk are those the dict literal
    wrote, and reading then writing a manifest gives back the same JSON."""
    for name in GRAPHS:
        m = json.loads((small_build / name / MANIFEST).read_text())
        extra = ({"tensorrt"} if name.endswith("bf16") else set()) | ({"quantization"} if "fp8" in name else set())
        assert set(m) == EXPORT_KEYS | extra, name
        assert (m["format"], m["format_version"]) == ("clover-export/step-graph", 2)
        assert Manifest.from_json(m).to_json() == m, name


@pytest.mark.parametrize("version", [1, 3, None])
def test_another_format_version_is_refused_naming_the_file_and_both_versions(tiny_dir, tmp_path, version):
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(b"")
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "format_version": version, "graph": "model.onnx"}))
    with pytest.raises(CloverError) as e:
        load_artifact(folder)
    text = str(e.value)
    assert str(folder / MANIFEST) in text and f"version {version!r}" in text and "reads version 2" in text
    assert "export the model again" in text
    r = subprocess.run([sys.executable, "-m", "clover_export.cli", "generate", str(folder), "--prompt", "hi"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert f"version {version!r}; this clover-export reads version 2" in r.stderr + r.stdout, r.stderr


# the ways of reading or writing manifest.json as a dict; outside artifact/ every one goes through `Manifest`
DICT_MANIFEST = re.compile(r"""manifest\s*\[|manifest\.get\(|["'](format_version|engine_info)["']"""
                           r"""|["']manifest\.json["']|loads\([^)]*MANIFEST""")
OWN_FORMAT = {"plugins/triton/aot.py"}  # the AOT kernels' manifest.json: another file, another format


def dict_manifest_uses(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("artifact/") or rel in OWN_FORMAT:
            continue
        found += [f"{rel}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
                  if DICT_MANIFEST.search(line)]
    return found


def test_nothing_outside_artifact_reads_or_writes_the_manifest_as_a_dict(tmp_path):
    assert dict_manifest_uses(Path(clover_export.__file__).parent) == []
    (tmp_path / "backends").mkdir()
    (tmp_path / "artifact").mkdir()
    (tmp_path / "artifact" / "manifest.py").write_text('m = {"format_version": 2}\n')
    (tmp_path / "backends" / "x.py").write_text('a = manifest.get("max_context", 1)\nb = art.manifest["model_dir"]\n'
                                                'c = json.loads((p / "manifest.json").read_text())\n'
                                                'd = json.loads((p / MANIFEST).read_text())\ne = manifest.model_dir\n')
    assert [u.split(":")[1] for u in dict_manifest_uses(tmp_path)] == ["1", "2", "3", "4"]


def test_compare_on_an_export_takes_the_reference_model_from_its_model_dir(tiny_dir, tmp_path):
    """`compare GOLDEN EXPORT` computes prompt logits with the model the export names (`model_dir`); the export
    folder holds the tokenizer but no config.json or weights."""
    from click.testing import CliRunner

    from clover_export.backends.torch_backend import TorchBackend
    from clover_export.cli import main
    from clover_export.exporter.export import export
    from clover_export.runtime.golden import write_golden

    export(tiny_dir, tmp_path / "export", dtype="fp32", max_batch=1)
    prompt = [1, 5, 9, 12]
    logits = TorchBackend.load(tiny_dir, dtype="fp32", device="cpu").prompt_logits(prompt)
    write_golden(tmp_path / "g.json", prompt, {}, None, logits.detach().numpy())
    r = CliRunner().invoke(main, ["compare", str(tmp_path / "g.json"), str(tmp_path / "export"), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert float(r.output.split("max |error| ")[1].split()[0]) < 1e-6 and "ok" in r.output, r.output
