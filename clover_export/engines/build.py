"""`clover-export build`: export -> validate -> (fp8: calibrate, quantise, validate) -> engine.

Every stage writes its own folder atomically and records a key of what it
was made from in `build.json`; re-running reuses a stage whose key matches
and redoes one whose inputs changed. Without TensorRT or a GPU the engine
stage is skipped with the reason, and the build still succeeds (unless
`require_engine`).

OUT/
  build.json       stages, their keys and results
  onnx-fp32/       fp32 step graph: ONNX Runtime on CPU, the validation and fallback path
  onnx-bf16/       bf16 step graph: what TensorRT parses for a bf16 engine
  onnx-fp8/        FP8 Q/DQ graph on fp32 activations: FP8 accuracy measured in ONNX Runtime
  onnx-fp8-bf16/   FP8 Q/DQ graph on the bf16 graph: what TensorRT parses for an FP8 engine
  <graph>/engine.plan   the engine, beside the graph it was built from (named in that manifest)
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from clover_export.engines.calibration import FP8_MIN_AGREEMENT
from clover_export.errors import CloverError

BUILD_FILE = "build.json"
ENGINE_FILE = "engine.plan"


@dataclass
class BuildOptions:
    precision: str = "bf16"
    max_batch: int = 8
    max_context: int | None = None
    chunk: int = 256
    weights: str = "link"
    calib: str | None = None
    gpu_memory_gib: float | None = None
    strip_weights: bool = False
    require_engine: bool = False
    allow_qwen: bool = False
    force: bool = False  # redo every stage; OUT must still be a build folder (clover_export.outdir)


@dataclass
class BuildResult:
    out: Path
    stages: dict[str, dict] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # human-readable reasons
    engine: Path | None = None


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def checkpoint_key(model_dir: Path) -> str:
    """Identity of the weights without reading them: shard names, sizes and mtimes."""
    from clover_export.checkpoint import shard_files

    return _key([(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in shard_files(model_dir)])


class Stages:
    """build.json: stage name -> {"key", "result"}; written after every stage."""

    def __init__(self, out: Path):
        self.path = out / BUILD_FILE
        try:
            self.data = json.loads(self.path.read_text()) if self.path.exists() else {}
        except json.JSONDecodeError:
            self.data = {}
        self.data.setdefault("stages", {})

    def done(self, name: str, key: str, folder: Path | None) -> bool:
        rec = self.data["stages"].get(name)
        return bool(rec and rec["key"] == key and (folder is None or folder.exists()))

    def record(self, name: str, key: str, result: dict) -> None:
        self.data["stages"][name] = {"key": key, "result": result}
        from clover_export.atomic import atomic_write

        atomic_write(self.path, json.dumps(self.data, indent=2).encode())

    def result(self, name: str) -> dict:
        return self.data["stages"][name]["result"]


def gpu_memory_bytes(opts: BuildOptions) -> int | None:
    if opts.gpu_memory_gib is not None:
        if not opts.gpu_memory_gib > 0:
            raise CloverError("build", f"--gpu-memory must be > 0 GiB, got {opts.gpu_memory_gib}")
        return int(opts.gpu_memory_gib * 1024**3)
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory
    except Exception:  # no usable CUDA: no GPU figure
        return None
    return None


def build(model, out: str | Path, opts: BuildOptions, log: Callable[[str], None] = print) -> BuildResult:
    from clover_export.config import load_config
    from clover_export.engines.memory_plan import plan_memory, require_fit
    from clover_export.models import resolve_model_dir

    if opts.precision not in ("bf16", "fp8"):
        raise CloverError("build", f"unknown precision {opts.precision!r}", "expected bf16 or fp8")
    if opts.require_engine:  # before any work (issue 10)
        why = engine_blocker(opts.precision)
        if why:
            raise CloverError("build", f"--require-engine: no engine can be built here: {why}",
                              "run `clover-export doctor` to see what is missing; nothing was built")
    model_dir = resolve_model_dir(model)
    cfg = load_config(model_dir)
    max_context = cfg.max_context if opts.max_context is None else opts.max_context
    from clover_export.outdir import claim_dir

    out = claim_dir(out, "build", command="build", force=opts.force, model_dirs=[model_dir])
    plan = plan_memory(cfg, opts.precision, opts.max_batch, max_context, opts.chunk, gpu_memory_bytes(opts))
    for line in plan.lines():
        log(line)
    require_fit(plan)  # before anything is written
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CloverError("build", f"--out {out}: cannot create the folder ({e.strerror or e})") from None
    stages = Stages(out)
    if opts.force:
        stages.data["stages"] = {}
    res = BuildResult(out)
    base = (str(model_dir.resolve()), checkpoint_key(model_dir), cfg.fingerprint(), opts.max_batch, max_context,
            opts.chunk, opts.weights, opts.allow_qwen)

    def export_stage(dtype: str) -> Path:
        from clover_export.exporter.export import export

        folder, key = out / f"onnx-{dtype}", _key("export", dtype, *base)
        if stages.done(f"export-{dtype}", key, folder):
            log(f"[export {dtype}] reused {folder.name} (inputs unchanged)")
        else:
            t = time.perf_counter()
            r = export(model_dir, folder, dtype=dtype, weights=opts.weights, chunk=opts.chunk, max_batch=opts.max_batch,
                       max_len=max_context, allow_qwen=opts.allow_qwen, force=True)
            msg = f"weights {r.weights.mode}" + (f" ({'; '.join(r.weights.messages)})" if r.weights.messages else "")
            log(f"[export {dtype}] {folder.name} in {time.perf_counter() - t:.1f} s, {msg}")
            stages.record(f"export-{dtype}", key, {"weights": r.weights.mode, "seconds": round(r.seconds, 2)})
        return folder

    def validate_stage(folder: Path, key_parts) -> None:
        from clover_export.exporter.validate import validate

        name, key = f"validate-{folder.name}", _key("validate", *key_parts)
        if stages.done(name, key, None):
            log(f"[validate {folder.name}] reused: passed before")
            return
        t = time.perf_counter()
        rep = validate(folder, cuda=True)
        if not rep.passed:
            raise CloverError("build", f"{folder.name} does not match the reference model:\n{rep.format()}")
        log(f"[validate {folder.name}] passed on {', '.join(rep.runners)} in {time.perf_counter() - t:.1f} s")
        stages.record(name, key, {"runners": rep.runners, "passed": True})

    fp32 = export_stage("fp32")
    validate_stage(fp32, ("fp32", *base))
    bf16 = export_stage("bf16")
    validate_stage(bf16, ("bf16", *base))
    engine_graph = bf16
    if opts.precision == "fp8":
        engine_graph = fp8_stages(model_dir, out, fp32, bf16, base, opts, stages, log)

    engine_stage(out, engine_graph, cfg, opts, max_context, base, stages, res, log)
    res.stages = stages.data["stages"]
    return res


def fp8_stages(model_dir, out, fp32, bf16, base, opts, stages, log) -> Path:
    from clover_export.engines.calibration import HELDOUT_PROMPTS, agreement, calibration_steps, read_prompts
    from clover_export.engines.fp8 import calibrate, quantize_graph

    prompts = read_prompts(opts.calib)
    calib_key = _key("calibrate", prompts, *base)
    if stages.done("calibrate", calib_key, None):
        amax = stages.result("calibrate")["amax"]
        log(f"[calibrate] reused {len(amax)} activation ranges")
    else:
        t = time.perf_counter()
        from clover_export.exporter.artifact import load_artifact

        block_size = load_artifact(fp32).block_size
        amax = calibrate(model_dir, calibration_steps(model_dir, prompts, block_size), block_size)
        log(f"[calibrate] {len(prompts)} prompts, {len(amax)} activation ranges in {time.perf_counter() - t:.1f} s")
        stages.record("calibrate", calib_key, {"amax": amax, "prompts": len(prompts)})
    for src, name in ((fp32, "onnx-fp8"), (bf16, "onnx-fp8-bf16")):
        key = _key("quantize", name, calib_key)
        if stages.done(f"quantize-{name}", key, out / name):
            log(f"[quantize] reused {name}")
            continue
        rep = quantize_graph(src, out / name, amax, force=True)  # the build's own folder
        log(f"[quantize] {name}: {rep.gemms} GEMMs with Q/DQ, {rep.expert_tensors} expert tensors e4m3, "
            f"{rep.bytes_written / 2**20:.1f} MiB written")
        stages.record(f"quantize-{name}", key, {"gemms": rep.gemms, "experts": rep.expert_tensors})
    key = _key("agreement", calib_key)
    if stages.done("validate-onnx-fp8", key, None):
        res = stages.result("validate-onnx-fp8")
        log(f"[validate onnx-fp8] reused: {res['line']}")
    else:
        a = agreement(fp32, out / "onnx-fp8", model_dir, HELDOUT_PROMPTS)
        log(f"[validate onnx-fp8] {a.line()}")
        res = {"line": a.line(), "top1_agreement": a.top1_agreement, "max_abs_logit_error": a.max_abs_logit_error}
        stages.record("validate-onnx-fp8", key, res)
    if res["top1_agreement"] < FP8_MIN_AGREEMENT:  # the engine stage never sees a graph below the gate
        raise CloverError("build", f"onnx-fp8 is below the FP8 gate: {res['line']} (gate: top-1 agreement "
                          f">= {100 * FP8_MIN_AGREEMENT:.0f}%); no engine was built",
                          "calibrate on prompts like your traffic (--calib FILE), or build --precision bf16")
    from clover_export.engines.fp8_twins import require_twins

    twins = require_twins(out / "onnx-fp8", out / "onnx-fp8-bf16")
    log(f"[validate onnx-fp8-bf16] {twins}")
    return out / "onnx-fp8-bf16"


def engine_blocker(precision: str, facts=None) -> str | None:
    """Why no `precision` engine can be built on this machine, or None."""
    from clover_export.engines.doctor import PRECISION_MIN_SM, collect, tensorrt_problem

    facts = collect() if facts is None else facts
    why = tensorrt_problem(facts)  # absent, broken (with the import error) or older than the floor (with the features)
    if why is None and not facts.gpus:
        why = "no CUDA GPU on this machine"
    elif why is None and tuple(facts.gpus[0]["sm"]) < PRECISION_MIN_SM[precision]:
        sm = facts.gpus[0]["sm"]
        why = f"{precision} engines need sm_{''.join(map(str, PRECISION_MIN_SM[precision]))}+, this GPU is sm_{sm[0]}{sm[1]}"
    return why


def engine_stage(out, graph: Path, cfg, opts, max_context, base, stages, res, log) -> None:
    from clover_export.engines.doctor import collect
    from clover_export.exporter.artifact import load_artifact

    art = load_artifact(graph)
    if art.weights_mode == "map":  # TensorRT reads external data from files beside the graph (STEP_GRAPH.md 2)
        raise CloverError("build", f"{graph.name} has map-mode weights (the checkpoint referenced in place through "
                          "weights.json): TensorRT cannot parse or refit them", "build again with --weights link or copy")
    facts = collect()
    why = engine_blocker(opts.precision, facts)
    if why:
        msg = f"[engine] skipped: {why}; the ONNX graphs above are complete and validated"
        log(msg)
        res.skipped.append(why)
        stages.record("engine", "skipped", {"skipped": why})
        if opts.require_engine:
            raise CloverError("build", f"no engine was built: {why}", "run `clover-export doctor` to see what is missing")
        return
    from clover_export.engines.profiles import BuildSettings
    from clover_export.engines.tensorrt_build import build_engine
    from clover_export.exporter.trt_graph import TRT_GRAPH

    plan_path = graph / ENGINE_FILE  # beside its graph: `generate GRAPH_DIR --backend trt` finds it there
    key = _key("engine", opts.precision, opts.strip_weights, facts.tensorrt, facts.gpus[0]["name"], *base)
    if stages.done("engine", key, plan_path):
        log(f"[engine] reused {plan_path}")
        res.engine = plan_path
        return
    settings = BuildSettings(opts.precision, 4 * 1024**3, opts.strip_weights, str(out / "timing.cache"))
    info = build_engine(graph / TRT_GRAPH, plan_path, art.manifest["profiles"], settings)  # no clover functions
    manifest = {**art.manifest, "engine": ENGINE_FILE, "engine_info": info}
    from clover_export.atomic import atomic_write

    atomic_write(graph / "manifest.json", json.dumps(manifest, indent=2).encode())
    log(f"[engine] {plan_path}: {info['bytes'] / 2**20:.1f} MiB, TensorRT {info['tensorrt']}")
    stages.record("engine", key, {**info, "graph": graph.name})
    res.engine = plan_path
