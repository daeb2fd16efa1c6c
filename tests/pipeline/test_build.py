"""`clover-export build` on the embedded default, end to end without TensorRT, twice; FP8 accuracy."""

import json
import shutil
import subprocess
import sys

import pytest

from clover_export.engines.builder import tensorrt_version
from clover_export.testing.logs import log_lines
from clover_export.verify.agreement import FP8_MIN_AGREEMENT


def run(*args):
    return subprocess.run([sys.executable, "-m", "clover_export.cli", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("build") / "tiny"
    first = run("build", "--out", str(out), "--max-batch", "2")
    return out, first


@pytest.mark.slow
def test_build_runs_every_stage_and_says_what_it_skipped(built):
    out, r = built
    assert r.returncode == 0, r.stderr
    for stage in ("[export fp32]", "[validate onnx-fp32] passed", "[export bf16]", "[validate onnx-bf16] passed",
                  "[calibrate]", "[quantize] onnx-fp8:", "[quantize] onnx-fp8-bf16:", "[validate onnx-fp8]"):
        assert stage in r.stdout, stage
    if tensorrt_version() is None:
        assert "[engine] skipped: TensorRT is not installed" in r.stdout
    for folder in ("onnx-fp32", "onnx-bf16", "onnx-fp8", "onnx-fp8-bf16"):
        assert (out / folder / "manifest.json").exists() and (out / folder / "model.onnx").exists()
    stages = json.loads((out / "build.json").read_text())["stages"]
    assert stages["validate-onnx-fp32"]["result"]["passed"]


@pytest.mark.slow
def test_fp8_graph_agrees_with_fp32_on_the_trained_default(built):
    """Issue target: top-1 agreement >= 97% of denoise positions (ONNX Runtime, CPU)."""
    out, r = built
    res = json.loads((out / "build.json").read_text())["stages"]["validate-onnx-fp8"]["result"]
    print(res["line"])
    assert res["top1_agreement"] >= FP8_MIN_AGREEMENT, res["line"]


@pytest.mark.slow
def test_second_build_reuses_everything(built):
    out, _ = built
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("onnx-*/model.onnx")}
    r = run("build", "--out", str(out), "--max-batch", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("reused") >= 8, r.stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("onnx-*/model.onnx")} == before


@pytest.mark.slow
def test_fp8_below_the_gate_fails_the_build_before_the_engine_stage(built, monkeypatch):
    """Below FP8_MIN_AGREEMENT the build fails before the engine stage (not a warning), with the figures,
    measured (API) or reused from build.json (CLI)."""
    from clover_export.core.errors import CloverError
    from clover_export.pipeline import build as B
    from clover_export.verify import agreement

    out, _ = built
    path = out / "build.json"
    saved = path.read_text()
    try:
        data = json.loads(saved)
        del data["stages"]["validate-onnx-fp8"]
        path.write_text(json.dumps(data))
        bad = agreement.Agreement(384, 0.95, 5.5, 0.3)
        monkeypatch.setattr(agreement, "agreement", lambda *a, **k: bad)
        with pytest.raises(CloverError) as e, log_lines() as logged:
            B.build(None, out, B.BuildOptions(precision="fp8", max_batch=2))
        assert bad.line() in str(e.value) and "no engine was built" in str(e.value)
        assert not any(line.startswith("[engine]") for line in logged), logged
        # the figures were recorded: a re-run reuses them and fails the same way, on one line
        r = run("build", "--out", str(out), "--max-batch", "2")
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith("error: [build] onnx-fp8 is below the FP8 gate") and "95.00%" in r.stderr
        assert "[engine]" not in r.stdout
    finally:
        path.write_text(saved)


@pytest.mark.slow
def test_changed_option_rebuilds_what_depends_on_it(built, tmp_path):
    out, _ = built
    r = run("build", "--out", str(out), "--max-batch", "3", "--precision", "bf16")
    assert r.returncode == 0, r.stderr
    assert "[export fp32] onnx-fp32 in" in r.stdout  # the batch size shapes the profiles: re-exported
    assert "[calibrate]" not in r.stdout  # bf16 needs no calibration


def test_require_engine_fails_plainly_without_tensorrt(tmp_path):
    """Checked before any work: no export, no folder, the reason on one line."""
    if tensorrt_version() is not None:
        pytest.skip("TensorRT is installed here")
    r = run("build", "--out", str(tmp_path / "b"), "--precision", "bf16", "--require-engine", "--max-batch", "1")
    assert r.returncode == 1
    assert "--require-engine: no engine can be built here: TensorRT is not installed" in r.stderr
    assert "Traceback" not in r.stderr and "nothing was written" in r.stderr
    assert "[export" not in r.stdout and "memory plan" not in r.stdout, r.stdout
    assert not (tmp_path / "b").exists()


def test_build_refuses_a_plan_that_does_not_fit(tmp_path):
    r = run("build", "--out", str(tmp_path / "b"), "--gpu-memory", "1")
    assert r.returncode == 1
    assert "does not fit" in r.stderr and "GPU usable" in r.stderr
    assert not (tmp_path / "b" / "onnx-fp32").exists()


def test_every_problem_is_reported_at_once_before_any_work(tiny_dir, tmp_path, monkeypatch):
    """Seven problems in one fp8 build, each found by the checks before the first stage: all of them reported in
    one error, one line each (a fact found by two checks once), and nothing written, not even OUT."""
    from clover_export.core.errors import CloverError
    from clover_export.exporter import export as export_module
    from clover_export.pipeline import build as B
    from clover_export.pipeline import disk_plan
    from clover_export.pipeline.doctor import engine_blocker

    model = shutil.copytree(tiny_dir, tmp_path / "model", ignore=shutil.ignore_patterns("tokenizer.json"))
    config = json.loads((model / "config.json").read_text())
    del config["mask_token_id"]  # needed by the calibration (and by prompt_batch, which finds it too)
    (model / "config.json").write_text(json.dumps(config))
    calib = tmp_path / "calib.json"
    calib.write_text('{"prompts": "not a list"}')
    monkeypatch.setattr(disk_plan, "free_bytes", lambda path: 2**20)
    monkeypatch.setattr(export_module, "export", lambda *a, **k: pytest.fail("a stage ran"))
    before = sorted(p.name for p in tmp_path.iterdir())
    opts = B.BuildOptions(precision="fp8", max_batch=2, calib=str(calib), gpu_memory_gib=0.5, require_engine=True,
                          weights="map")
    with pytest.raises(CloverError) as e, log_lines() as logged:
        B.build(model, tmp_path / "out", opts)
    expected = [f"{model / 'tokenizer.json'}: file not found", f"{calib}: expected prompts",
                "field 'mask_token_id' is missing", "the engine does not fit in GPU memory",
                "not enough free disk space", "--weights map: a build's graphs need their weights in weights/"]
    if engine_blocker("fp8"):
        expected.append("--require-engine: no engine can be built here")
    head, *lines = str(e.value).splitlines()
    problems = [line for line in lines if line.startswith("  - [")]
    assert head == f"[build] cannot start: {len(expected)} problems, nothing was written:", str(e.value)
    assert len(problems) == len(expected) == len(lines) - 1 and lines[-1].startswith("  Note:"), str(e.value)
    for want in expected:
        assert sum(want in line for line in problems) == 1, (want, problems)
    assert sum("DOES NOT FIT" in line for line in logged) == 2  # the memory and disk plans behind their lines
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no OUT, no temporary folder


def test_a_single_problem_is_its_own_one_line_error(tiny_dir, tmp_path):
    """Through the CLI: one problem is the error itself, as every CLI error is, saying nothing was written."""
    calib = tmp_path / "calib.json"
    calib.write_text("[1, 2]")
    r = run("build", str(tiny_dir), "--out", str(tmp_path / "b"), "--calib", str(calib))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.splitlines() == [f"error: [calibration] {calib}: expected prompts, one per line or a JSON list "
                                     "of strings", "  Note: nothing was written"], r.stderr
    assert "[export" not in r.stdout and not (tmp_path / "b").exists()


@pytest.mark.tensorrt
@pytest.mark.skipif(tensorrt_version() is None, reason="TensorRT is not installed on this machine")
def test_engine_is_built_where_tensorrt_exists(built):  # skipped before the build fixture runs
    out, r = built
    assert (out / "onnx-fp8-bf16" / "engine.plan").exists(), r.stdout


@pytest.mark.slow
def test_validate_judges_an_fp8_graph_against_its_source(built):
    out, _ = built
    r = run("validate", str(out / "onnx-fp8"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "top-1 agreement" in r.stdout and "PASSED" in r.stdout
    r = run("validate", str(out / "onnx-fp8-bf16"))  # compared with its twin onnx-fp8, then judged through it
    assert r.returncode == 0, r.stdout + r.stderr
    assert "onnx-fp8-bf16: same graph as onnx-fp8 up to dtype" in r.stdout and "PASSED" in r.stdout


@pytest.mark.slow
def test_engine_bound_folders_carry_the_trt_graph_and_pass_check(built):
    """`build --precision fp8` (the default): model.trt.onnx in onnx-bf16 and onnx-fp8-bf16, `check` passes."""
    import onnx

    out, _ = built
    for folder in ("onnx-bf16", "onnx-fp8-bf16"):
        assert (out / folder / "model.trt.onnx").exists(), folder
        r = run("check", str(out / folder))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "TensorRT parses model.trt.onnx" in r.stdout and "clover functions left: none" in r.stdout
    for folder in ("onnx-fp32", "onnx-fp8"):  # ONNX Runtime graphs: not engine-bound
        assert not (out / folder / "model.trt.onnx").exists(), folder
    ops = {n.op_type for n in onnx.load(str(out / "onnx-fp8-bf16" / "model.trt.onnx"),
                                        load_external_data=False).graph.node if n.domain == "clover"}
    # the default context (>= 2048 pool positions) splits attention over the prefix (launch.attention_split_cap)
    assert ops == {"BlockGDN", "BlockAttentionSplit", "BlockAttentionMerge", "MoERoute", "MoEAlign", "MoEGateUpFP8",
                   "MoEDownFP8", "MoECombine"}


def test_disk_plan_counts_a_small_checkpoint_copied_in_link_mode(tmp_path):
    """`--weights link` copies a checkpoint up to COPY_BELOW where the filesystem has no reflinks (exports.md):
    the plan counts those bytes for each graph (a full-size checkpoint, linked, counts none: test_build_fullsize)."""
    from clover_export.artifact.manifest import COPY_BELOW
    from clover_export.core.config import load_config
    from clover_export.model.loading import resolve_model_dir
    from clover_export.pipeline.disk_plan import checkpoint_bytes, export_bytes

    model = resolve_model_dir("tiny")
    shards = checkpoint_bytes(model)
    assert 0 < shards <= COPY_BELOW
    link, copy = (export_bytes(load_config(model), model, weights, 2) for weights in ("link", "copy"))
    assert link == copy >= shards


@pytest.mark.slow
def test_every_graph_of_a_small_build_loads_in_plain_onnx(built):
    """A small build's folders hold copies, not hard links, where the filesystem has no reflinks (the FP8
    weight file and the converted tensors included): onnx >= 1.21 refuses hard-linked external data."""
    import onnx

    out, _ = built
    graphs = sorted(out.glob("onnx-*/model.onnx"))
    assert {g.parent.name for g in graphs} >= {"onnx-fp32", "onnx-bf16", "onnx-fp8", "onnx-fp8-bf16"}
    for g in graphs:
        onnx.checker.check_model(str(g), full_check=False)
        onnx.load(str(g))  # every external tensor read


def test_the_command_and_the_api_share_their_defaults():
    """`clover-export build`'s options default to BuildOptions' fields (one place); fp8 for both, as the README's
    first build (`clover-export build --out build/tiny`) calibrates and quantizes."""
    import dataclasses

    from clover_export.cli.build import build as command
    from clover_export.pipeline.build import BuildOptions

    fields = {f.name: f.default for f in dataclasses.fields(BuildOptions)}
    options = {("gpu_memory_gib" if p.name == "gpu_memory" else p.name): p.default for p in command.params
               if p.name not in ("model", "out")}
    assert options == fields
    assert BuildOptions().precision == "fp8"


def test_the_command_prints_the_build_s_progress_and_the_library_prints_nothing(tmp_path, capsys):
    """The build reports through logging: `clover-export` prints its INFO lines on stdout (here the memory plan
    behind a refusal); called from Python with logging left unconfigured, it prints nothing."""
    from click.testing import CliRunner

    from clover_export.cli import main
    from clover_export.core.errors import CloverError
    from clover_export.pipeline import build as B

    r = CliRunner().invoke(main, ["build", "--out", str(tmp_path / "b"), "--gpu-memory", "1"])
    assert r.exit_code == 1 and "does not fit" in r.stderr, r.output
    assert "memory plan (fp8" in r.stdout and "DOES NOT FIT" in r.stdout, r.stdout
    with pytest.raises(CloverError, match="does not fit"):
        B.build(None, tmp_path / "c", B.BuildOptions(gpu_memory_gib=1))
    printed = capsys.readouterr()
    assert "memory plan" not in printed.out + printed.err


def test_a_stage_is_reused_only_under_its_key_with_its_folder_and_a_check_always_runs(tmp_path):
    """BuildContext.run: a stage recorded in build.json is reused (its reuse line logged, nothing made) while its
    key matches and its folder exists; otherwise made and recorded again. A check is run every time, never recorded."""
    from clover_export.pipeline.context import BuildContext, BuildOptions, Stage, Stages, stage_key

    made: list = []

    def make(ctx):
        (ctx.out / "f").mkdir(exist_ok=True)
        made.append("s")
        return {"n": len(made)}

    check = Stage("c", lambda ctx: made.append("c"), key=lambda ctx: pytest.fail("a check has no key"))

    def run(key):
        stage = Stage("s", make, reuse=lambda ctx, rec: f"[s] reused {rec['n']}", folder="f", key=lambda ctx: (key,))
        ctx = BuildContext(BuildOptions(), tmp_path, Stages(tmp_path))
        with log_lines() as lines:
            ctx.run(stage, check)
        return ctx.result, lines

    res, _ = run("k1")
    assert (res.ran, res.reused, made) == (["s"], [], ["s", "c"])
    res, lines = run("k1")
    assert (res.ran, res.reused, made[2:], lines) == ([], ["s"], ["c"], ["[s] reused 1"])
    res, _ = run("k2")  # the inputs changed
    assert res.ran == ["s"] and made[3:] == ["s", "c"]
    (tmp_path / "f").rmdir()  # the folder went away
    res, _ = run("k2")
    assert res.ran == ["s"] and made[5:] == ["s", "c"]
    recorded = {"stages": {"s": {"key": stage_key("k2"), "result": {"n": 6}}}}
    assert json.loads((tmp_path / "build.json").read_text()) == recorded
