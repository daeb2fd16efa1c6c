"""`clover-export build`: export -> validate -> (fp8: calibrate, quantise, validate) -> engine.

Every stage writes its own folder atomically and records a key of what it
was made from in `build.json`; re-running reuses a stage whose key matches
and redoes one whose inputs changed. Without TensorRT or a GPU the engine
stage is skipped with the reason, and the build still succeeds (unless
`require_engine`).

At the real model's size (issue 11) nothing is loaded whole and no weight
is converted into a new file: the graphs reference the checkpoint's bf16
shards (the fp32 graph casts inside the graph), the FP8 weights are
quantised once, tensor by tensor, into `fp8-weights/` and linked by both
FP8 graphs, calibration streams the reference model layer by layer
(`stream_calib.py`), and where whole-graph validation would not fit in
memory, a slice at full width (the first layer of each kind, the embedding,
norm and lm_head) is validated instead (`exporter/slice.py`).

Before the first stage, `check_inputs` checks everything the stages will
need (options, config, checkpoint headers, the tokenizer and calibration
prompts for fp8, OUT, the memory and disk plans, TensorRT under
--require-engine) and reports every problem at once, one line each, with
nothing written (docs/build.md). The FP8 weight file (a thread) and, at full
size, the bf16 export (a process) run beside the other stages
(`background.py`). Ctrl-C keeps every finished stage; the same command
continues from there.

OUT/
  build.json       stages, their keys and results
  onnx-fp32/       fp32 step graph: ONNX Runtime on CPU, the validation and fallback path
  fp8-weights/     fp8.bin (e4m3 weights + fp32 scales) and its index, linked by both FP8 graphs
  onnx-bf16/       bf16 step graph: what TensorRT parses for a bf16 engine
  onnx-fp8/        FP8 Q/DQ graph on fp32 activations: FP8 accuracy measured in ONNX Runtime
  onnx-fp8-bf16/   FP8 Q/DQ graph on the bf16 graph: what TensorRT parses for an FP8 engine
  <graph>/engine.plan   the engine, beside the graph it was built from (named in that manifest)
"""

from __future__ import annotations

import gc
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from clover_export.artifact.manifest import BUILD_FILE
from clover_export.core.errors import CloverError
from clover_export.verify.agreement import FP8_MIN_AGREEMENT

BUILD_WEIGHT_MODES = ("link", "copy")  # export's weight modes a build accepts (STEP_GRAPH.md 2: files beside the graph)
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
    force: bool = False  # redo every stage; OUT must still be a build folder (clover_export.artifact.outdir)
    validation: str = "auto"  # "whole" graph, a full-width "slice", or "auto": whole when it fits in memory


@dataclass
class BuildResult:
    out: Path
    stages: dict[str, dict] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # human-readable reasons
    engine: Path | None = None
    ran: list[str] = field(default_factory=list)  # stages run by this invocation
    reused: list[str] = field(default_factory=list)  # stages reused from an earlier one


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def checkpoint_key(model_dir: Path) -> str:
    """Identity of the weights without reading them: shard names, sizes and mtimes."""
    from clover_export.core.checkpoint import shard_files

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
        from clover_export.core.atomic import atomic_write

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


@dataclass
class Ready:
    """What `check_inputs` found: everything the stages need, checked before any of them runs."""

    model_dir: Path
    cfg: object  # CloverConfig
    max_context: int
    out: Path
    memory: object  # memory_plan.MemoryPlan
    disk: object  # disk_plan.DiskPlan
    stages: Stages
    base: tuple  # what every stage key is made from
    keys: dict[str, str]
    validation: tuple[bool, str]  # validation_mode: (whole graphs?, why)
    prompts: object = None  # fp8: calibration.PromptBatch (the calibration prompts, tokenised)


def problem_line(e: CloverError) -> str:
    """A CloverError as one problem line; a message that lists several items keeps them on indented lines."""
    first, *rest = e.message.splitlines()
    line = f"[{e.component}] {first}" + (f" ({e.note})" if e.note else "")
    return "\n".join([line] + [f"      {r.strip()}" for r in rest])


def refuse(problems: list[CloverError]) -> None:
    """Raise for the problems found: one as itself, several as one error listing them, one line each."""
    if len(problems) == 1:
        e = problems[0]
        raise CloverError(e.component, e.message, f"{e.note}; nothing was written" if e.note else "nothing was written")
    if problems:
        raise CloverError("build", f"cannot start: {len(problems)} problems, nothing was written:\n  - "
                          + "\n  - ".join(map(problem_line, problems)), "fix them and run the same command again")


def check_inputs(model, out, opts: BuildOptions, log: Callable[[str], None] = print) -> Ready:
    """Everything `build` will need, checked before its first stage: the options, the model folder, its
    config and checkpoint headers, (fp8) the tokenizer, chat template, mask token and calibration prompts,
    OUT, GPU memory, disk space, and TensorRT where --require-engine asks for an engine. Every problem is
    reported at once, one line each, and nothing is written (not even OUT)."""
    import warnings

    from clover_export.artifact.outdir import claim_dir
    from clover_export.core.checkpoint import locate_tensors, plan_tensors
    from clover_export.core.config import load_config
    from clover_export.model.loading import resolve_model_dir
    from clover_export.pipeline.disk_plan import shortfall as disk_shortfall
    from clover_export.tensorrt.memory_plan import plan_memory
    from clover_export.tensorrt.memory_plan import shortfall as memory_shortfall

    problems: list[CloverError] = []

    def problem(e: CloverError) -> None:
        if str(e) not in map(str, problems):  # the same fact found by two checks is one problem
            problems.append(e)

    def attempt(fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except CloverError as e:
            problem(e)
            return None

    precision_ok = opts.precision in ("bf16", "fp8")
    if not precision_ok:
        problem(CloverError("build", f"unknown precision {opts.precision!r}", "expected bf16 or fp8"))
    elif opts.require_engine and (why := engine_blocker(opts.precision)):
        problem(CloverError("build", f"--require-engine: no engine can be built here: {why}",
                            "run `clover-export doctor` to see what is missing"))
    if opts.weights not in BUILD_WEIGHT_MODES:  # TensorRT reads external data from files beside the graph
        problem(CloverError("build", f"--weights {opts.weights}: a build's graphs need their weights in weights/ "
                            "(map mode references the checkpoint in place, which TensorRT cannot parse or refit)",
                            f"use --weights {' or '.join(BUILD_WEIGHT_MODES)}"))
    gpu_bytes = attempt(gpu_memory_bytes, opts)
    model_dir = attempt(resolve_model_dir, model)
    out = attempt(claim_dir, out, "build", command="build", force=opts.force,
                  model_dirs=[model_dir] if model_dir else [])
    cfg = attempt(load_config, model_dir) if model_dir else None
    if cfg is None:  # nothing further can be checked without the config
        refuse(problems)
    validation = attempt(validation_mode, cfg, opts)
    with warnings.catch_warnings():  # a plain Qwen checkpoint's warning comes again, once, at export
        warnings.simplefilter("ignore")
        planned = attempt(lambda: plan_tensors(cfg, locate_tensors(model_dir), allow_qwen=opts.allow_qwen))
    prompts = batch = None
    if opts.precision == "fp8":
        from clover_export.quantize.calibration import BUILTIN_PROMPTS, prompt_batch, read_prompts

        prompts = attempt(read_prompts, opts.calib)
        attempt(cfg.require_mask_token)
        # the tokenizer and chat template are checked on a built-in prompt when --calib is itself a problem
        batch = attempt(prompt_batch, model_dir, prompts or BUILTIN_PROMPTS[:1], cfg.block_size)
        if batch is not None and (bad := [t for row in batch.ids for t in row if not 0 <= t < cfg.vocab_size]):
            problem(CloverError("calibration", f"{model_dir / 'tokenizer.json'} gives token id {bad[0]} for the "
                                f"calibration prompts, outside the vocabulary (size {cfg.vocab_size}) of {cfg.source}"))
    max_context = cfg.max_context if opts.max_context is None else opts.max_context
    memory = attempt(plan_memory, cfg, opts.precision, opts.max_batch, max_context, opts.chunk, gpu_bytes) \
        if precision_ok else None
    if memory is not None and (short := memory_shortfall(memory)):
        for line in memory.lines():  # the figures behind the problem line
            log(line)
        problem(CloverError("build", short))
    disk = stages = base = keys = None
    if out is not None and planned is not None and precision_ok:
        stages = Stages(out)
        if opts.force:
            stages.data["stages"] = {}
        base = (str(model_dir.resolve()), checkpoint_key(model_dir), cfg.fingerprint(), opts.max_batch, max_context,
                opts.chunk, opts.weights, opts.allow_qwen)
        keys = stage_keys(base, opts, prompts or [])
        disk = plan_disk_for(out, cfg, model_dir, opts, keys, stages)
        if short := disk_shortfall(disk):
            for line in disk.lines():
                log(line)
            problem(CloverError("build", short))
    refuse(problems)
    return Ready(model_dir, cfg, max_context, out, memory, disk, stages, base, keys, validation, batch)


def build(model, out: str | Path, opts: BuildOptions, log: Callable[[str], None] = print) -> BuildResult:
    ready = check_inputs(model, out, opts, log)  # every problem at once, before anything is written
    model_dir, cfg, max_context, out = ready.model_dir, ready.cfg, ready.max_context, ready.out
    stages, base, keys = ready.stages, ready.base, ready.keys
    for line in ready.memory.lines() + ready.disk.lines():
        log(line)
    res = BuildResult(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CloverError("build", f"--out {out}: cannot create the folder ({e.strerror or e})") from None

    def export_args(dtype: str) -> dict:
        return dict(model=model_dir, out=out / f"onnx-{dtype}", dtype=dtype, weights=opts.weights, chunk=opts.chunk,
                    max_batch=opts.max_batch, max_len=max_context, allow_qwen=opts.allow_qwen, force=True)

    def export_stage(dtype: str) -> Path:
        from clover_export.exporter.export import export

        name, folder, key = f"export-{dtype}", out / f"onnx-{dtype}", keys[f"export-{dtype}"]
        if stages.done(name, key, folder):
            log(f"[export {dtype}] reused {folder.name} (inputs unchanged)")
            res.reused.append(name)
        else:
            t = time.perf_counter()
            background = dtype == "bf16" and bf16_job is not None
            r = bf16_job.result() if background else export(**export_args(dtype))
            where = f"in a background process (waited {time.perf_counter() - t:.1f} s for it)" if background else ""
            msg = f"weights {r.weights.mode}" + (f" ({'; '.join(r.weights.messages)})" if r.weights.messages else "")
            log(f"[export {dtype}] {folder.name} in {r.seconds:.1f} s{' ' * bool(where)}{where}, {msg}, "
                f"{r.weights.weight_bytes_written} weight bytes written, readiness checks (`check`) passed")
            stages.record(name, key, {"weights": r.weights.mode, "seconds": round(r.seconds, 2),
                                      "bytes_written": r.bytes_written})
            res.ran.append(name)
        return folder

    def validate_stage(folder: Path, key_parts) -> None:
        from clover_export.verify.validate import validate

        name, key = f"validate-{folder.name}", _key("validate", *key_parts)
        if stages.done(name, key, None):
            log(f"[validate {folder.name}] reused: passed before")
            res.reused.append(name)
            return
        t = time.perf_counter()
        rep = validate(folder, cuda=True)
        if not rep.passed:
            raise CloverError("build", f"{folder.name} does not match the reference model:\n{rep.format()}")
        log(f"[validate {folder.name}] passed on {', '.join(rep.runners)} in {time.perf_counter() - t:.1f} s")
        stages.record(name, key, {"runners": rep.runners, "passed": True})
        res.ran.append(name)

    whole, why = ready.validation
    log(f"[validate] {'whole graphs' if whole else 'a slice at full width'}: {why}")
    writer = None
    if opts.precision == "fp8" and not stages.done("fp8-weights", keys["fp8-weights"], out / "fp8-weights"):
        import shutil

        from clover_export.pipeline.background import BackgroundWeights

        for stale in out.glob(".fp8-weights.*"):  # a writer killed outright (SIGKILL, power): its temporary folder
            shutil.rmtree(stale, ignore_errors=True)
        writer = BackgroundWeights(model_dir, cfg, out / "fp8-weights")  # disk-bound: beside the CPU-bound stages
        log("[quantize] fp8-weights: writing in the background (disk-bound) while the graphs are exported, "
            "validated and calibrated")
    bf16_job = None
    if not whole and not stages.done("export-bf16", keys["export-bf16"], out / "onnx-bf16"):
        from clover_export.pipeline.background import BackgroundExport

        bf16_job = BackgroundExport(**export_args("bf16"))  # Python-bound: beside the stages below
        log("[export bf16] in a background process beside the stages below")
    try:
        engine_graph = _graph_stages(model_dir, out, cfg, opts, base, keys, stages, res, log, whole,
                                     export_stage, validate_stage, writer, ready.prompts)
    finally:
        if bf16_job is not None:
            bf16_job.stop()  # after a failure or Ctrl-C: its temporary folder removed; else it has finished
        if writer is not None:
            writer.stop()  # after a failure or Ctrl-C: nothing of it stays written; else it has finished
            weights = writer.finished()
            if weights is not None and not stages.done("fp8-weights", keys["fp8-weights"], out / "fp8-weights"):
                record_fp8_weights(stages, keys["fp8-weights"], weights, writer.seconds)  # a later stage failed
    engine_stage(out, engine_graph, cfg, opts, max_context, base, stages, res, log)
    log(f"[build] ran: {', '.join(res.ran) or 'nothing'}; reused: {', '.join(res.reused) or 'nothing'}"
        + (f"; needs a GPU / TensorRT: engine ({'; '.join(res.skipped)})" if res.skipped else ""))
    res.stages = stages.data["stages"]
    return res


def _graph_stages(model_dir, out, cfg, opts, base, keys, stages, res, log, whole, export_stage, validate_stage,
                  writer, prompts) -> Path:
    """Export and validate both graphs, then the FP8 stages; the graph the engine is built from.
    Whole-graph validation: in that order. Slice validation (full size): the fp32 export, then the slice
    (reusing its trace); the bf16 export runs in a background process (`build`), collected when first
    needed: after the slice, or for fp8 after calibrating."""

    def fp32_stage() -> Path:
        fp32 = export_stage("fp32")
        if whole:
            validate_stage(fp32, ("fp32", *base))
        return fp32

    def bf16_stage() -> Path:
        bf16 = export_stage("bf16")
        if whole:
            validate_stage(bf16, ("bf16", *base))
        else:
            log("[validate onnx-bf16] structural checks (`check`) passed at export; not run whole: "
                "ONNX Runtime's CPU EP has no bf16 kernels and onnx.reference cannot run it at this size "
                "(the slice ran the same traced code in fp32)")
        return bf16

    shared: dict = {}  # weights the slice read that the streamed calibration takes over (`validate_slices`)
    if whole:
        fp32, bf16 = fp32_stage(), bf16_stage()
        fp32_graph, bf16_graph = (lambda: fp32), (lambda: bf16)
    else:
        fp32 = fp32_stage()
        slice_stage(model_dir, out, cfg, opts, base, stages, res, log, shared if opts.precision == "fp8" else None)
        fp32_graph, bf16_graph = (lambda: fp32), bf16_stage
    if opts.precision != "fp8":
        return bf16_graph()
    return fp8_stages(model_dir, out, cfg, fp32_graph, bf16_graph, base, opts, stages, log, keys, whole, res, writer,
                      shared, prompts=prompts)


def stage_keys(base: tuple, opts: BuildOptions, prompts: list[str]) -> dict[str, str]:
    """Stage name -> key of what it is made from (a stage reruns when its key changes)."""
    keys = {f"export-{d}": _key("export", d, *base) for d in ("fp32", "bf16")}
    if opts.precision == "fp8":
        keys["calibrate"] = _key("calibrate", prompts, *base)
        keys["fp8-weights"] = _key("fp8-weights", *base)
        for name in ("onnx-fp8", "onnx-fp8-bf16"):
            keys[f"quantize-{name}"] = _key("quantize", name, keys["calibrate"], keys["fp8-weights"])
    return keys


def plan_disk_for(out: Path, cfg, model_dir: Path, opts: BuildOptions, keys: dict, stages: Stages):
    from clover_export.model.sizing import weight_bytes
    from clover_export.pipeline.disk_plan import plan_disk

    folders = {"export-fp32": out / "onnx-fp32", "export-bf16": out / "onnx-bf16", "fp8-weights": out / "fp8-weights"}
    todo = {name: not stages.done(name, keys[name], folders[name]) for name in folders if name in keys}
    todo["quantize (2 graphs)"] = not all(stages.done(f"quantize-{n}", keys.get(f"quantize-{n}", ""), out / n)
                                          for n in ("onnx-fp8", "onnx-fp8-bf16"))
    engine = None if engine_blocker(opts.precision) else (0 if opts.strip_weights else weight_bytes(cfg, opts.precision))
    return plan_disk(out, cfg, model_dir, opts.precision, opts.weights, todo, engine)


def validation_mode(cfg, opts: BuildOptions) -> tuple[bool, str]:
    """(whole graphs?, why): whole-graph validation where it fits in half this machine's memory."""
    from clover_export.verify.slice import available_memory, whole_validation_bytes

    if opts.validation not in ("auto", "whole", "slice"):
        raise CloverError("build", f"unknown validation {opts.validation!r}", "expected auto, whole or slice")
    need, have = whole_validation_bytes(cfg), available_memory()
    figures = f"whole-graph validation needs ~{need / 2**30:.1f} GiB of RAM, {have / 2**30:.1f} GiB available"
    if opts.validation != "auto":
        return opts.validation == "whole", f"requested ({figures})"
    if need <= have // 2:
        return True, figures
    return False, figures + "; validating the first layer of each kind with the real weights instead"


def slice_stage(model_dir, out, cfg, opts, base, stages, res, log, keep: dict | None = None) -> None:
    from clover_export.verify.slice import validate_slices

    name, key = "validate-slices", _key("validate-slices", *base)
    if stages.done(name, key, None):
        log(f"[validate slices] reused: {'; '.join(stages.result(name)['lines'])}")
        res.reused.append(name)
        return
    result = validate_slices(model_dir, out / ".slices", cfg.block_size, min(opts.chunk, 16), 2, keep=keep)
    log(f"[validate slices] {result.line()}")
    if not result.passed:
        raise CloverError("build", "the exported graph does not match the reference model on a full-width slice:\n"
                          f"{result.line()}\n{result.report}")
    stages.record(name, key, {"lines": [result.line()], "passed": True})
    res.ran.append(name)


def fp8_weights_stage(out, fp32, stages, log, keys, res, writer=None):
    """The shared FP8 weight file: reused, taken from the background writer (`background.py`), or written here."""
    from clover_export.quantize.weights import load_fp8_weights, quantize_weights

    wfolder, wkey = out / "fp8-weights", keys["fp8-weights"]
    if stages.done("fp8-weights", wkey, wfolder):
        weights = load_fp8_weights(wfolder)
        log(f"[quantize] reused {wfolder.name} ({weights.bytes_written / 2**30:.2f} GiB)")
        res.reused.append("fp8-weights")
        return weights
    t = time.perf_counter()
    if writer is not None:
        weights = writer.result()
        sec, how = writer.seconds, f"in the background beside the stages above (waited {time.perf_counter() - t:.1f} s)"
    else:
        from tqdm import tqdm

        from clover_export.artifact.manifest import load_artifact
        from clover_export.model.sizing import fp8_weight_names
        from clover_export.quantize.graph import source_plans

        art = load_artifact(fp32)
        weights = quantize_weights(source_plans(art), fp8_weight_names(art.config), wfolder,
                                   progress=lambda it: tqdm(it, desc="quantise", unit="tensor", leave=False))
        sec, how = time.perf_counter() - t, "here"
    log(f"[quantize] {wfolder.name}: {len(weights.index)} tensors, {weights.bytes_written / 2**30:.2f} GiB "
        f"written once in {sec:.1f} s ({weights.bytes_written / max(sec, 1e-9) / 2**20:.0f} MiB/s), {how}")
    record_fp8_weights(stages, wkey, weights, sec)
    res.ran.append("fp8-weights")
    return weights


def record_fp8_weights(stages, key: str, weights, sec: float) -> None:
    stages.record("fp8-weights", key, {"tensors": len(weights.index), "bytes_written": weights.bytes_written,
                                        "seconds": round(sec, 2)})


def fp8_stages(model_dir, out, cfg, fp32_graph, bf16_graph, base, opts, stages, log, keys, whole, res,
               writer=None, shared: dict | None = None, *, prompts) -> Path:
    """Calibrate, the FP8 weights, both FP8 graphs, their checks. fp32_graph(), bf16_graph(): the graphs'
    folders, asked for after the calibration (background exports may run until then). shared: weights the
    slice read, taken over by the streamed calibration (emptied here either way). prompts: the calibration
    prompts tokenised (`calibration.PromptBatch`, made by `check_inputs`)."""
    from clover_export.quantize.graph import calibrate, quantize_graph
    from clover_export.verify.agreement import HELDOUT_PROMPTS, agreement

    calib_key = keys["calibrate"]
    if stages.done("calibrate", calib_key, None):
        amax = stages.result("calibrate")["amax"]
        log(f"[calibrate] reused {len(amax)} activation ranges")
        res.reused.append("calibrate")
    else:
        t = time.perf_counter()
        from clover_export.quantize.stream_calib import streamed_model

        block_size = cfg.block_size  # the graphs' (build exports at the config's block size)
        model = streamed_model(model_dir, block_size, preloaded=shared)  # one layer's weights resident at a time
        if shared:
            shared.clear()  # held by the model now (on a GPU: copied there, the host copies go)
        try:
            amax = calibrate(model_dir, prompts, block_size, model=model)
        finally:
            model.stream_progress.close()
        log(f"[calibrate] {len(prompts.ids)} prompts, {len(amax)} activation ranges in {time.perf_counter() - t:.1f} s "
            f"(layer by layer on {next(iter(model.lm_head.parameters())).device})")
        stages.record("calibrate", calib_key, {"amax": amax, "prompts": len(prompts.ids)})
        res.ran.append("calibrate")
        del model
        gc.collect()  # the streamed model's hooks hold it in reference cycles: its arenas go now, not at exit
    if shared:
        shared.clear()  # 3 GiB at full size: not held past the calibration
    fp32, bf16 = fp32_graph(), bf16_graph()
    weights = fp8_weights_stage(out, fp32, stages, log, keys, res, writer)
    for src, name in ((fp32, "onnx-fp8"), (bf16, "onnx-fp8-bf16")):
        key = keys[f"quantize-{name}"]
        if stages.done(f"quantize-{name}", key, out / name):
            log(f"[quantize] reused {name}")
            res.reused.append(f"quantize-{name}")
            continue
        rep = quantize_graph(src, out / name, amax, force=True, weights=weights)  # the build's own folder
        log(f"[quantize] {name}: {rep.gemms} GEMMs with Q/DQ, {rep.expert_tensors} expert tensors e4m3, "
            f"linked to {weights.dir.name}/ ({rep.bytes_written} weight bytes written)")
        stages.record(f"quantize-{name}", key, {"gemms": rep.gemms, "experts": rep.expert_tensors})
        res.ran.append(f"quantize-{name}")
    key = _key("agreement", calib_key)
    if stages.done("validate-onnx-fp8", key, None):
        agr = stages.result("validate-onnx-fp8")
        log(f"[validate onnx-fp8] reused: {agr['line']}")
        res.reused.append("validate-onnx-fp8")
    elif not whole:
        agr = None
        log("[validate onnx-fp8] skipped: top-1 agreement plays the whole fp32 and FP8 graphs in ONNX Runtime, "
            "and this build validates a slice, not whole graphs (see [validate] above)")
    else:
        a = agreement(fp32, out / "onnx-fp8", model_dir, HELDOUT_PROMPTS)
        log(f"[validate onnx-fp8] {a.line()}")
        agr = {"line": a.line(), "top1_agreement": a.top1_agreement, "max_abs_logit_error": a.max_abs_logit_error}
        stages.record("validate-onnx-fp8", key, agr)
        res.ran.append("validate-onnx-fp8")
    if agr is not None and agr["top1_agreement"] < FP8_MIN_AGREEMENT:  # the engine stage never sees it
        raise CloverError("build", f"onnx-fp8 is below the FP8 gate: {agr['line']} (gate: top-1 agreement "
                          f">= {100 * FP8_MIN_AGREEMENT:.0f}%); no engine was built",
                          "calibrate on prompts like your traffic (--calib FILE), or build --precision bf16")
    from clover_export.verify.twins import require_twins

    twins = require_twins(out / "onnx-fp8", out / "onnx-fp8-bf16")
    log(f"[validate onnx-fp8-bf16] {twins}")
    return out / "onnx-fp8-bf16"


def engine_blocker(precision: str, facts=None) -> str | None:
    """Why no `precision` engine can be built on this machine, or None."""
    from clover_export.pipeline.doctor import PRECISION_MIN_SM, collect, tensorrt_problem

    facts = collect() if facts is None else facts
    why = tensorrt_problem(facts)  # absent, broken (with the import error) or older than the floor (with the features)
    if why is None and not facts.gpus:
        why = "no CUDA GPU on this machine"
    elif why is None and tuple(facts.gpus[0]["sm"]) < PRECISION_MIN_SM[precision]:
        sm = facts.gpus[0]["sm"]
        why = f"{precision} engines need sm_{''.join(map(str, PRECISION_MIN_SM[precision]))}+, this GPU is sm_{sm[0]}{sm[1]}"
    return why


def engine_stage(out, graph: Path, cfg, opts, max_context, base, stages, res, log) -> None:
    from clover_export.artifact.manifest import load_artifact
    from clover_export.pipeline.doctor import collect

    art = load_artifact(graph)
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
    from clover_export.exporter.trt_graph import TRT_GRAPH
    from clover_export.tensorrt.builder import build_engine
    from clover_export.tensorrt.profiles import BuildSettings

    plan_path = graph / ENGINE_FILE  # beside its graph: `generate GRAPH_DIR --backend trt` finds it there
    key = _key("engine", opts.precision, opts.strip_weights, facts.tensorrt, facts.gpus[0]["name"], *base)
    if stages.done("engine", key, plan_path):
        log(f"[engine] reused {plan_path}")
        res.engine = plan_path
        return
    settings = BuildSettings(opts.precision, 4 * 1024**3, opts.strip_weights, str(out / "timing.cache"))
    info = build_engine(graph / TRT_GRAPH, plan_path, art.manifest["profiles"], settings)  # no clover functions
    manifest = {**art.manifest, "engine": ENGINE_FILE, "engine_info": info}
    from clover_export.core.atomic import atomic_write

    atomic_write(graph / "manifest.json", json.dumps(manifest, indent=2).encode())
    log(f"[engine] {plan_path}: {info['bytes'] / 2**20:.1f} MiB, TensorRT {info['tensorrt']}")
    stages.record("engine", key, {**info, "graph": graph.name})
    res.engine = plan_path
