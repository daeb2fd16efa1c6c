"""The build's stages describe themselves (`pipeline.context.Stage`): one list per build (`stages.stage_list`),
each stage's key made from what it says, and each stage's name written in one module only."""

from __future__ import annotations

import ast
from itertools import product
from pathlib import Path

import pytest

import clover_export
from clover_export.pipeline import stages as S
from clover_export.pipeline.context import BuildContext, BuildOptions, Stages, stage_key

ROOT = Path(clover_export.__file__).parent
# (whole-graph validation, fp8) -> the stage names in order, as docs/build.md describes a build
ORDERS = {
    (True, True): ["export-fp32", "validate-onnx-fp32", "export-bf16", "validate-onnx-bf16", "calibrate",
                   "fp8-weights", "quantize-onnx-fp8", "quantize-onnx-fp8-bf16", "validate-onnx-fp8", "fp8-gate",
                   "validate-onnx-fp8-bf16", "engine"],
    (True, False): ["export-fp32", "validate-onnx-fp32", "export-bf16", "validate-onnx-bf16", "engine"],
    (False, True): ["export-fp32", "validate-slices", "calibrate", "export-bf16", "validate-onnx-bf16",
                    "fp8-weights", "quantize-onnx-fp8", "quantize-onnx-fp8-bf16", "validate-onnx-fp8", "fp8-gate",
                    "validate-onnx-fp8-bf16", "engine"],
    (False, False): ["export-fp32", "validate-slices", "export-bf16", "validate-onnx-bf16", "engine"],
}


@pytest.mark.parametrize("whole,fp8", list(product((True, False), repeat=2)))
def test_the_stage_list_of_each_kind_of_build(whole, fp8):
    stages = S.stage_list(whole, fp8)
    assert [s.name for s in stages] == ORDERS[whole, fp8]
    assert stages[-1].folder == ("onnx-fp8-bf16" if fp8 else "onnx-bf16") + "/engine.plan"  # beside its graph
    for s in stages:
        assert (s.key is None) == (s.reuse is None), s.name  # a recorded stage says what its key is made from
    written = {s.name for s in stages if s.disk is not None}
    fp8_written = {"fp8-weights", "quantize-onnx-fp8", "quantize-onnx-fp8-bf16"} if fp8 else set()
    assert written == {"export-fp32", "export-bf16", "engine"} | fp8_written
    assert {s.name for s in stages if s.checks is not None} == {"engine"} | ({"calibrate"} if fp8 else set())


def test_stage_keys_are_made_from_what_each_stage_says_as_before(tmp_path):
    """The keys an earlier build recorded in build.json (hand-written here as the previous release made them)
    are the keys now: a build folder made before reuses its stages."""
    ctx = BuildContext(BuildOptions(), tmp_path, Stages(tmp_path), base=("model", 7), calibration_prompts=["p"])
    calibrate, weights = stage_key("calibrate", ["p"], "model", 7), stage_key("fp8-weights", "model", 7)
    want = {"export-fp32": stage_key("export", "fp32", "model", 7),
            "export-bf16": stage_key("export", "bf16", "model", 7),
            "validate-onnx-fp32": stage_key("validate", "fp32", "model", 7),
            "validate-onnx-bf16": stage_key("validate", "bf16", "model", 7),
            "validate-slices": stage_key("validate-slices", "model", 7), "calibrate": calibrate, "fp8-weights": weights,
            "quantize-onnx-fp8": stage_key("quantize", "onnx-fp8", calibrate, weights),
            "quantize-onnx-fp8-bf16": stage_key("quantize", "onnx-fp8-bf16", calibrate, weights),
            "validate-onnx-fp8": stage_key("agreement", calibrate), "fp8-gate": None, "validate-onnx-fp8-bf16": None}
    got = {s.name: ctx.key(s) for whole in (True, False) for s in S.stage_list(whole, True)[:-1]}
    assert got == want


# the modules of the build; "engine" is an ordinary word elsewhere (the manifest's key, the server's thread)
BUILD_MODULES = sorted((ROOT / "pipeline").glob("*.py")) + [ROOT / "cli" / "build.py"]


def string_constants(path: Path) -> set[str]:
    """Every string literal of the module, f-strings' literal parts included."""
    return {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


def names_outside_stages(modules: list[Path], names: set[str]) -> dict[str, list[str]]:
    """Stage name -> the modules other than stages.py that spell it out (there every name is written, some
    through f-strings: `f"export-{dtype}"`)."""
    where: dict[str, list[str]] = {}
    for path in modules:
        if path.name != "stages.py":
            for name in sorted(string_constants(path) & names):
                where.setdefault(name, []).append(path.name)
    return where


def test_every_stage_name_is_written_in_stages_only(tmp_path):
    names = {s.name for whole, fp8 in ORDERS for s in S.stage_list(whole, fp8)}
    assert names == {name for order in ORDERS.values() for name in order}
    assert names_outside_stages(BUILD_MODULES, names) == {}
    (tmp_path / "stages.py").write_text('CALIBRATE = Stage("calibrate", make)\n')
    (tmp_path / "background.py").write_text('done = ctx.stages.done("export-bf16", key, out / "onnx-bf16")\n')
    found = names_outside_stages([tmp_path / "stages.py", tmp_path / "background.py"], names)
    assert found == {"export-bf16": ["background.py"]}
