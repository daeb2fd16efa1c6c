"""The TensorRT path without TensorRT (STEP_GRAPH.md 2, 4).

Everything that decides what TensorRT gets is checked here on the CPU: the
graph it parses (`model.trt.onnx`: no functions, the MoE split into AOT
sub-ops, `aot=1`), the rules `check` enforces on it (each broken on purpose),
the expected plugin-layer count (tiny and full-size graphs), the version
floor, the refusal of map-mode weights, and the reporting of a broken
TensorRT install. The fake `tensorrt` packages below only raise or carry a
version string: they test our reporting and gates, they validate nothing
about TensorRT itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import helper

from clover_export.core.errors import CloverError
from clover_export.exporter.check import check_folder
from clover_export.exporter.trt_graph import TRT_GRAPH, expected_plugin_layers, plugin_nodes, trt_graph
from clover_export.plugins.contracts import NAMESPACE, TRT_CONTRACTS
from clover_export.plugins.trt import versions as V

BROKEN = "libnvinfer.so.10: cannot open shared object file: No such file or directory"


def independent_count(cfg, split: bool) -> Counter:
    """Plugin layers per op from the config alone: one GDN / attention core per layer (attention as split + merge
    where the pools hold >= 2048 positions), five MoE sub-ops per layer."""
    gdn = sum(t == "linear_attention" for t in cfg.layer_types)
    attention = cfg.num_hidden_layers - gdn
    c = Counter(BlockGDN=gdn, **({"BlockAttentionSplit": attention, "BlockAttentionMerge": attention} if split
                                 else {"BlockAttention": attention}))
    for op in ("MoERoute", "MoEAlign", "MoEGateUp", "MoEDown", "MoECombine"):
        c[op] = cfg.num_hidden_layers
    return c


@pytest.fixture(scope="module")
def bf16_export(tmp_path_factory):
    from clover_export.exporter.export import export
    from clover_export.tiny import generate_random_tiny

    root = tmp_path_factory.mktemp("trt")
    model = generate_random_tiny(root / "model", seed=2, dtype=torch.bfloat16)
    export(model, root / "out", dtype="bf16", weights="link", max_batch=2)
    return model, root / "out"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_trt(folder: Path, edit) -> None:
    proto = onnx.load(str(folder / TRT_GRAPH), load_external_data=False)
    edit(proto)
    onnx.save_model(proto, str(folder / TRT_GRAPH))


def _fails(folder: Path) -> list[str]:
    return [str(f) for f in check_folder(folder).failures]


# ----------------------------------------------------------------- the graph TensorRT parses
def test_export_writes_the_trt_graph_beside_model_onnx(bf16_export):
    from clover_export.artifact.manifest import load_artifact

    _, out = bf16_export
    art = load_artifact(out)
    trt = onnx.load(str(out / TRT_GRAPH), load_external_data=False)
    full = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert len(trt.functions) == 0 and len(full.functions) > 0
    assert art.config.max_context == 2048  # pools of 2048 positions: attention in its split-KV form, 2 splits at most
    want = independent_count(art.config, split=True)
    assert plugin_nodes(trt) == want and art.manifest.tensorrt.plugin_nodes == dict(want)
    assert expected_plugin_layers(trt) == sum(want.values())
    split = next(n for n in trt.graph.node if n.op_type == "BlockAttentionSplit")
    merge = next(n for n in trt.graph.node if n.op_type == "BlockAttentionMerge")
    assert {x.name: helper.get_attribute_value(x) for x in split.attribute}["max_splits"] == 2
    assert list(merge.input) == [*split.output[:3], split.input[0]]  # the partials, their count, q for o's dtype
    for n in trt.graph.node:
        if n.domain == NAMESPACE:
            a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
            assert a["plugin_namespace"] == b"clover" and a["plugin_version"] == b"1" and a["aot"] == 1, n.name
            assert n.op_type in TRT_CONTRACTS
    ext = lambda p: {t.name: list(t.external_data) for t in p.graph.initializer}  # noqa: E731
    assert ext(trt) == ext(full)  # the same weight files, nothing copied
    assert not check_folder(out).failures


def test_check_reports_what_tensorrt_gets(bf16_export):
    from clover_export.cli import main

    _, out = bf16_export
    r = CliRunner().invoke(main, ["check", str(out)])
    assert r.exit_code == 0, r.output
    assert f"TensorRT parses {TRT_GRAPH}" in r.output and "BlockGDN 6" in r.output and "MoERoute 8" in r.output
    assert "clover functions left: none" in r.output and "minimum TensorRT 10.9" in r.output


@pytest.mark.slow
def test_full_size_graph_plugin_count():
    """The Clover-35B-A3B step graph traced on the meta device (no weights): 40 layers -> 240 plugin layers."""
    from clover_export.exporter.trace import trace_step
    from clover_export.testing.fullsize import full_size_config

    cfg = full_size_config()
    traced = trace_step(cfg, torch.bfloat16, cfg.block_size).model
    g = trt_graph(traced, cfg.num_experts, cfg.max_context)
    assert plugin_nodes(g) == independent_count(cfg, split=True)
    assert expected_plugin_layers(g) == 30 + 2 * 10 + 5 * 40 and len(g.functions) == 0
    assert plugin_nodes(trt_graph(traced, cfg.num_experts, 1024)) == independent_count(cfg, split=False)


# ----------------------------------------------------------------- check: each rule broken on purpose
def _drop_attr(name):
    def edit(p):
        node = next(n for n in p.graph.node if n.op_type == "BlockGDN")
        keep = [a for a in node.attribute if a.name != name]
        del node.attribute[:]
        node.attribute.extend(keep)
    return edit


def _set_version(p):
    node = next(n for n in p.graph.node if n.op_type == "MoERoute")
    next(a for a in node.attribute if a.name == "plugin_version").s = b"2"


def _add_function(folder):
    def edit(p):
        full = onnx.load(str(folder / "model.onnx"), load_external_data=False)
        p.functions.append(next(f for f in full.functions if f.name == "BlockAttention"))
    return edit


def _unsplit_moe(folder):
    def edit(p):
        full = onnx.load(str(folder / "model.onnx"), load_external_data=False)
        moe = next(n for n in full.graph.node if n.op_type == "CoresetMoE")
        p.graph.node.append(moe)
    return edit


def _move_external_data(p):
    t = next(t for t in p.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    next(e for e in t.external_data if e.key == "offset").value = "0"


@pytest.mark.parametrize("rule, edit, expect", [
    ("no plugin_namespace", lambda f: _drop_attr("plugin_namespace"), "attribute plugin_namespace is None"),
    ("no plugin_version", lambda f: _drop_attr("plugin_version"), "attribute plugin_version is None"),
    ("wrong plugin_version", lambda f: _set_version, "attribute plugin_version is '2', expected '1'"),
    ("no aot", lambda f: _drop_attr("aot"), "attribute aot=1 missing"),
    ("function left", _add_function, "a model-local function is left"),
    ("unsplit MoE", _unsplit_moe, "CoresetMoE must be split into its AOT sub-ops"),
    ("other external data", lambda f: _move_external_data, "external data differs from model.onnx"),
])
def test_check_refuses_a_broken_trt_graph(bf16_export, tmp_path, rule, edit, expect):
    _, out = bf16_export
    bad = _copy(out, tmp_path / "bad")
    _edit_trt(bad, edit(bad))
    fails = _fails(bad)
    assert any(expect in f for f in fails), (rule, fails)
    assert all(TRT_GRAPH in f for f in fails), fails  # only the rule broken here fails


def test_check_cli_fails_one_line_per_problem(bf16_export, tmp_path):
    from clover_export.cli import main

    _, out = bf16_export
    bad = _copy(out, tmp_path / "bad")
    _edit_trt(bad, _drop_attr("plugin_namespace"))
    _edit_trt(bad, _add_function(bad))
    r = CliRunner().invoke(main, ["check", str(bad)])
    assert r.exit_code == 1 and "Traceback" not in r.output
    fails = [ln for ln in r.output.splitlines() if ln.strip().startswith("FAIL")]
    assert len(fails) == 2, r.output


def test_missing_trt_graph_fails_for_bf16(bf16_export, tmp_path):
    _, out = bf16_export
    bad = _copy(out, tmp_path / "bad")
    (bad / TRT_GRAPH).unlink()
    assert any("missing: TensorRT parses model.trt.onnx" in f for f in _fails(bad))


def test_map_mode_cannot_reach_tensorrt(bf16_export, tmp_path):
    from clover_export.exporter.export import export
    from clover_export.pipeline.build import BuildOptions, build

    model, _ = bf16_export
    out = tmp_path / "map"
    res = export(model, out, dtype="bf16", weights="map", max_batch=2)  # fine for ONNX Runtime
    assert res.weights.mode == "map" and not (out / TRT_GRAPH).exists()
    fails = _fails(out)
    assert len(fails) == 1 and "map mode" in fails[0] and "--weights link or copy" in fails[0]
    assert not any("refit" in str(f) for f in check_folder(out).findings)  # no refit-from-the-map path exists
    # a build refuses map-mode weights before its first stage, and writes nothing
    with pytest.raises(CloverError, match="map mode references the checkpoint in place, which TensorRT cannot"):
        build(model, tmp_path / "b", BuildOptions(precision="bf16", weights="map"))
    assert not (tmp_path / "b").exists()


# ----------------------------------------------------------------- versions, broken installs
def test_version_table():
    assert V.MIN_TENSORRT == (10, 9) and V.version_text() == "10.9"
    assert all(f.since <= V.MIN_TENSORRT for f in V.FEATURES)
    assert V.missing_features("10.9.0.34") == [] and V.missing_features("11.1.0") == []
    assert {f.since for f in V.missing_features("10.8.0")} == {(10, 9)}
    assert {f.since for f in V.missing_features("10.6.1")} == {(10, 7), (10, 9)}
    assert len(V.missing_features("10.0")) == len(V.FEATURES) - 1
    reason = V.too_old_reason("10.8.0")
    assert "older than 10.9" in reason and "aot_impl" in reason and "PREFER_AOT_PYTHON_PLUGINS" in reason
    with pytest.raises(CloverError, match="TensorRT 10.7.0 is older than 10.9"):
        V.require_tensorrt("10.7.0")
    with pytest.raises(ValueError):
        V.parse_version("ten")


def test_doctor_refuses_old_or_broken_tensorrt():
    from clover_export.pipeline.doctor import Facts, capabilities

    gpu = [{"name": "H200", "sm": (9, 0), "memory": 141 * 1024**3}]
    rows = lambda f: {w: (ok, why) for w, ok, why in capabilities(f)}  # noqa: E731
    ok, why = rows(Facts(torch="2.13", tensorrt="10.8.0", gpus=gpu))["build engines / generate --backend trt"]
    assert not ok and "older than 10.9" in why
    ok, why = rows(Facts(torch="2.13", tensorrt_error=f"ImportError: {BROKEN}", gpus=gpu))[
        "build engines / generate --backend trt"]
    assert not ok and "installed but cannot be imported" in why and "libnvinfer.so.10" in why
    assert rows(Facts(torch="2.13", tensorrt="10.9.0", gpus=gpu))["build engines / generate --backend trt"][0]


@pytest.fixture
def broken_tensorrt(tmp_path, monkeypatch):
    """A `tensorrt` package whose import fails the way a wheel without its libraries does."""
    pkg = tmp_path / "fake" / "tensorrt"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"raise ImportError({BROKEN!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    for name in [m for m in sys.modules if m == "tensorrt" or m.startswith("tensorrt.")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path / "fake"


def test_broken_tensorrt_is_reported_not_called_missing(broken_tensorrt, bf16_export, tmp_path):
    from clover_export.engines.builder import import_tensorrt, probe_tensorrt
    from clover_export.pipeline.context import BuildContext, BuildOptions, Stages
    from clover_export.pipeline.stages import engine
    from clover_export.testing.logs import log_lines

    assert probe_tensorrt() == (None, f"ImportError: {BROKEN}")
    with pytest.raises(CloverError, match="installed but cannot be imported.*libnvinfer.so.10") as e:
        import_tensorrt()
    assert "not installed" not in str(e.value)
    _, out = bf16_export
    with log_lines() as logged:  # the engine stage of a build in tmp_path, of the graph `out`
        BuildContext(BuildOptions(), tmp_path, Stages(tmp_path)).run(engine(str(out)))
    assert any("skipped: TensorRT is installed but cannot be imported" in m and "libnvinfer" in m for m in logged)
    with pytest.raises(CloverError, match="no engine was built: TensorRT is installed but cannot be imported"):
        BuildContext(BuildOptions(require_engine=True), tmp_path, Stages(tmp_path)).run(engine(str(out)))
    r = subprocess.run([sys.executable, "-m", "clover_export.cli", "doctor"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": f"{broken_tensorrt}:{Path(__file__).parents[2]}"})
    assert "tensorrt: installed but broken (ImportError: libnvinfer.so.10" in r.stdout, r.stdout + r.stderr
    assert "TensorRT is installed but cannot be imported" in r.stdout


def test_too_old_tensorrt_is_refused_by_the_import_guard(tmp_path, monkeypatch):
    from clover_export.engines.builder import import_tensorrt

    pkg = tmp_path / "tensorrt"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("__version__ = '10.8.0.43'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    # the fake module must not outlive the test (a later find_spec("tensorrt") in this process would see it):
    # setitem records "absent" so the undo deletes the key; delitem lets the import reach the fake package
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.delitem(sys.modules, "tensorrt")
    with pytest.raises(CloverError, match="TensorRT 10.8.0.43 is older than 10.9.*aot_impl"):
        import_tensorrt()


# ----------------------------------------------------------------- builder logic that needs no TensorRT
def test_plugin_layer_count_and_registration_rules():
    from clover_export.engines.builder import plugin_layer_problems, registration_problems

    want = {"BlockGDN": 6, "MoERoute": 8}
    assert plugin_layer_problems(dict(want), want) == []
    # the parser imported one GDN node as its function body (no plugin layer): refused
    got = plugin_layer_problems({"BlockGDN": 5, "MoERoute": 8}, want)
    assert got == ["clover::BlockGDN: 5 plugin layer(s) after parsing, 6 node(s) in the graph"]
    assert plugin_layer_problems({"BlockGDN": 6, "MoERoute": 8, "Extra": 1}, want) == [
        "clover::Extra: 1 plugin layer(s) after parsing, 0 node(s) in the graph"]
    assert registration_problems({"BlockGDN"}, False, (), "ImportError: x") == [
        "the clover plugins are not registered: tensorrt.plugin could not be imported: ImportError: x"]
    assert registration_problems({"BlockGDN", "MoEAlign"}, True, ("clover::BlockGDN",)) == [
        "no plugin registered for clover::MoEAlign"]
    assert registration_problems({"BlockGDN"}, True, ("clover::BlockGDN",)) == []


def test_progress_monitor_never_raises(monkeypatch):
    """An exception from a progress callback would abort TensorRT's build: a failing bar is dropped instead."""
    import tqdm

    from clover_export.engines.builder import _SafeMonitor

    m = _SafeMonitor()
    m.phase_start("ok", None, 2)
    monkeypatch.setattr(tqdm, "tqdm", lambda *a, **k: (_ for _ in ()).throw(OSError("terminal gone")))
    m.phase_start("broken", None, 3)
    assert m.step_complete("broken", 0) is True and m.step_complete("never-started", 0) is True
    m.bars["ok"].update = lambda n: (_ for _ in ()).throw(ValueError("closed"))
    assert m.step_complete("ok", 0) is True
    m.phase_finish("ok")
    m.phase_finish("broken")


# ----------------------------------------------------------------- model.trt.onnx computes what model.onnx computes
def _reference_ops():
    """onnx.reference kernels for every TensorRT plugin op: its contract's plain-torch core (the semantics)."""
    import importlib

    from onnx.reference.op_run import OpRun

    from clover_export.verify.runners import to_numpy, to_torch

    cast = {"int": int, "float": float, "bool": bool}
    classes = []
    for c in TRT_CONTRACTS.values():
        module, fn = c.reference.split(":")
        core = getattr(importlib.import_module(module), fn)

        def _run(self, *inputs, c=c, core=core, **attrs):  # onnx.reference passes the node's attributes by name
            attrs = [cast[a.type](attrs.get(a.name, getattr(self, a.name, None))) for a in c.attributes]
            with torch.no_grad():
                out = core(*[to_torch(x) for x in inputs], *attrs)
            return tuple(to_numpy(o) for o in (out if isinstance(out, tuple) else (out,)))

        classes.append(type(c.name, (OpRun,), {"op_domain": NAMESPACE, "_run": _run}))
    return classes


@pytest.mark.slow
def test_trt_graph_computes_what_model_onnx_computes(tiny_fp32_dir, tmp_path):
    """The rewrite (functions dropped, each CoresetMoE split into router MatMul + five sub-ops, each BlockAttention
    into split + merge) changes no value:
    model.trt.onnx run by onnx.reference with each plugin op as its contract's torch core equals model.onnx
    run by ONNX Runtime (function bodies), on the fp32 graph of the tiny model: one step, pools included."""
    from onnx.reference import ReferenceEvaluator

    from clover_export.artifact.manifest import load_artifact
    from clover_export.exporter.export import export
    from clover_export.exporter.session import ort_session
    from clover_export.verify.runners import load_weights
    from clover_export.verify.scenario import small_step

    export(tiny_fp32_dir, tmp_path / "f32", dtype="fp32", weights="link", max_batch=2)
    art = load_artifact(tmp_path / "f32")
    # pool_len 4096 (this export's pools are shorter): the split-KV form, 4 splits at most, so its references run
    g = trt_graph(onnx.load(str(art.graph_path), load_external_data=False), art.config.num_experts, 4096)
    assert plugin_nodes(g)["MoEGateUp"] == art.config.num_hidden_layers and not g.functions
    assert plugin_nodes(g)["BlockAttentionSplit"] > 0  # the split-KV form's references run too
    load_weights(g, art)
    feeds, pools = small_step(art)
    inputs = {**feeds[0], **pools}
    want = dict(zip(art.output_names, ort_session(art, ["CPUExecutionProvider"]).run(art.output_names, inputs)))
    got = dict(zip(art.output_names, ReferenceEvaluator(g, new_ops=_reference_ops()).run(art.output_names, inputs)))
    for name in art.output_names:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        if want[name].dtype.kind == "i":
            assert (got[name] == want[name]).all(), name
        else:
            torch.testing.assert_close(torch.from_numpy(got[name]), torch.from_numpy(want[name]), atol=1e-4, rtol=1e-4,
                                       msg=lambda m, n=name: f"{n}: {m}")
