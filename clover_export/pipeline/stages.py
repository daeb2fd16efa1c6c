"""The build's stages (`context.Stage`), each writing its own folder atomically; `build.py` runs them in order.

Each stage carries its folder, what its key is made from, the bytes it
writes and the problems it can find before the build starts; `stage_list`
puts a build's stages in order, once, and `checks.check_inputs`, the disk
plan, the work beside the stages (`background.py`) and `build.py` all read
that one list. Each stage logs one line saying what it made, or, reused,
what it took back (`BuildContext.run`). Stages without `reuse` are checks,
run every time. Every stage's name is written here and nowhere else.
"""

from __future__ import annotations

import gc
import logging
import time
from functools import partial
from pathlib import Path

from clover_export.core.errors import CloverError
from clover_export.pipeline import disk_plan
from clover_export.pipeline.context import BuildContext, BuildResult, Stage
from clover_export.verify.agreement import FP8_MIN_AGREEMENT

log = logging.getLogger(__name__)

ENGINE_FILE = "engine.plan"


def begin(ctx: BuildContext) -> None:
    """The memory and disk plans' figures, OUT created, how the graphs will be validated."""
    for line in ctx.memory.lines() + ctx.disk.lines():
        log.info(line)
    try:
        ctx.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CloverError("build", f"--out {ctx.out}: cannot create the folder ({e.strerror or e})") from None
    log.info(f"[validate] {'whole graphs' if ctx.whole else 'a slice at full width'}: {ctx.validation[1]}")
    ctx.shared = {} if ctx.fp8 else None


def finish(ctx: BuildContext) -> BuildResult:
    res = ctx.result
    log.info(f"[build] ran: {', '.join(res.ran) or 'nothing'}; reused: {', '.join(res.reused) or 'nothing'}"
             + (f"; needs a GPU / TensorRT: engine ({'; '.join(res.skipped)})" if res.skipped else ""))
    res.stages = ctx.stages.data["stages"]
    return res


# --- export and validation ------------------------------------------------------------------------------------
DTYPE_BYTES = {"fp32": 4, "bf16": 2}  # the exported graphs' dtypes


def graph_folder(dtype: str) -> str:
    return f"onnx-{dtype}"


def export_args(ctx: BuildContext, dtype: str) -> dict:
    """`exporter.export.export`'s arguments for the build's `dtype` graph (here or in a background process)."""
    o = ctx.opts
    return dict(model=ctx.model_dir, out=ctx.out / graph_folder(dtype), dtype=dtype, weights=o.weights,
                chunk=o.chunk, max_batch=o.max_batch, max_len=ctx.max_context, allow_qwen=o.allow_qwen, force=True)


def _export(dtype: str, ctx: BuildContext) -> dict:
    from clover_export.exporter.export import export

    t = time.perf_counter()
    background = dtype == "bf16" and ctx.bf16_job is not None
    r = ctx.bf16_job.result() if background else export(**export_args(ctx, dtype))
    where = f" in a background process (waited {time.perf_counter() - t:.1f} s for it)" if background else ""
    msg = f"weights {r.weights.mode}" + (f" ({'; '.join(r.weights.messages)})" if r.weights.messages else "")
    log.info(f"[export {dtype}] onnx-{dtype} in {r.seconds:.1f} s{where}, {msg}, "
             f"{r.weights.weight_bytes_written} weight bytes written, readiness checks (`check`) passed")
    return {"weights": r.weights.mode, "seconds": round(r.seconds, 2), "bytes_written": r.bytes_written}


def export_graph(dtype: str) -> Stage:
    """The `dtype` step graph in onnx-<dtype>/: exported here, or collected from the background export."""
    folder = graph_folder(dtype)
    return Stage(f"export-{dtype}", partial(_export, dtype), folder=folder,
                 reuse=lambda ctx, rec: f"[export {dtype}] reused {folder} (inputs unchanged)",
                 key=lambda ctx: ("export", dtype, *ctx.base),
                 disk=lambda ctx: disk_plan.export_bytes(ctx.cfg, ctx.model_dir, ctx.opts.weights, DTYPE_BYTES[dtype]))


EXPORT = {dtype: export_graph(dtype) for dtype in DTYPE_BYTES}


def _validate(name: str, ctx: BuildContext) -> dict:
    from clover_export.verify.validate import validate

    t = time.perf_counter()
    rep = validate(ctx.out / name, cuda=True)
    if not rep.passed:
        raise CloverError("build", f"{name} does not match the reference model:\n{rep.format()}")
    log.info(f"[validate {name}] passed on {', '.join(rep.runners)} in {time.perf_counter() - t:.1f} s")
    return {"runners": rep.runners, "passed": True}


def validate_graph(dtype: str) -> Stage:
    """The whole onnx-<dtype> graph against the reference model (`verify.validate`)."""
    name = graph_folder(dtype)
    return Stage(f"validate-{name}", partial(_validate, name),
                 reuse=lambda ctx, rec: f"[validate {name}] reused: passed before",
                 key=lambda ctx: ("validate", dtype, *ctx.base))


VALIDATE = {dtype: validate_graph(dtype) for dtype in DTYPE_BYTES}


def _validate_slices(ctx: BuildContext) -> dict:
    from clover_export.verify.slice import validate_slices

    result = validate_slices(ctx.model_dir, ctx.out / ".slices", ctx.cfg.block_size, min(ctx.opts.chunk, 16), 2,
                             keep=ctx.shared)
    log.info(f"[validate slices] {result.line()}")
    if not result.passed:
        raise CloverError("build", "the exported graph does not match the reference model on a full-width slice:\n"
                          f"{result.line()}\n{result.report}")
    return {"lines": [result.line()], "passed": True}


# the first layer of each kind at full width, with embedding, norm and lm_head (`verify.slice`)
VALIDATE_SLICES = Stage("validate-slices", _validate_slices,
                        reuse=lambda ctx, rec: f"[validate slices] reused: {'; '.join(rec['lines'])}",
                        key=lambda ctx: ("validate-slices", *ctx.base))


def _bf16_checked_at_export(ctx: BuildContext) -> None:
    log.info("[validate onnx-bf16] structural checks (`check`) passed at export; not run whole: "
             "ONNX Runtime's CPU EP has no bf16 kernels and onnx.reference cannot run it at this size "
             "(the slice ran the same traced code in fp32)")


# slice validation: what the bf16 graph had instead (a check, under the whole graph's validation's name)
BF16_CHECKED_AT_EXPORT = Stage(VALIDATE["bf16"].name, _bf16_checked_at_export)


# --- FP8 ------------------------------------------------------------------------------------------------------
def _calibrate(ctx: BuildContext) -> dict:
    from clover_export.quantize.calibration import calibrate
    from clover_export.quantize.stream_calib import streamed_model

    t = time.perf_counter()
    block_size = ctx.cfg.block_size  # the graphs' (build exports at the config's block size)
    model = streamed_model(ctx.model_dir, block_size, preloaded=ctx.shared)  # one layer's weights resident at a time
    if ctx.shared:
        ctx.shared.clear()  # held by the model now (on a GPU: copied there, the host copies go)
    try:
        ctx.amax = calibrate(ctx.model_dir, ctx.prompts, block_size, model=model)
    finally:
        model.stream_progress.close()
    n = len(ctx.prompts.ids)
    log.info(f"[calibrate] {n} prompts, {len(ctx.amax)} activation ranges in {time.perf_counter() - t:.1f} s "
             f"(layer by layer on {next(iter(model.lm_head.parameters())).device})")
    del model
    gc.collect()  # the streamed model's hooks hold it in reference cycles: its arenas go now, not at exit
    return {"amax": ctx.amax, "prompts": n}


def _calibration_problems(ctx: BuildContext) -> list[CloverError]:
    """The calibration prompts (--calib or the built-in ones), the mask token, and the tokenizer and chat
    template on those prompts (on a built-in one when --calib is itself a problem); into ctx: the prompts."""
    from clover_export.quantize.calibration import BUILTIN_PROMPTS, prompt_batch, read_prompts

    problems, cfg = [], ctx.cfg
    texts = _attempt(problems, read_prompts, ctx.opts.calib)
    _attempt(problems, cfg.require_mask_token)
    batch = _attempt(problems, prompt_batch, ctx.model_dir, texts or BUILTIN_PROMPTS[:1], cfg.block_size)
    if batch is not None and (bad := [t for row in batch.ids for t in row if not 0 <= t < cfg.vocab_size]):
        problems.append(CloverError("calibration", f"{ctx.model_dir / 'tokenizer.json'} gives token id {bad[0]} for "
                                    f"the calibration prompts, outside the vocabulary (size {cfg.vocab_size}) of "
                                    f"{cfg.source}"))
    ctx.calibration_prompts, ctx.prompts = texts or [], batch
    return problems


def _attempt(problems: list[CloverError], fn, *args):
    """fn(*args), or None with its CloverError added to `problems`."""
    try:
        return fn(*args)
    except CloverError as e:
        problems.append(e)
        return None


def _calibrated_before(ctx: BuildContext, rec: dict) -> str:
    if ctx.shared:
        ctx.shared.clear()  # 3 GiB at full size: not held past the calibration
    ctx.amax = rec["amax"]
    return f"[calibrate] reused {len(ctx.amax)} activation ranges"


# activation ranges of the reference model on the calibration prompts, streamed layer by layer
CALIBRATE = Stage("calibrate", _calibrate, reuse=_calibrated_before, checks=_calibration_problems,
                  key=lambda ctx: ("calibrate", ctx.calibration_prompts, *ctx.base))


def fp8_weights_record(weights, seconds: float) -> dict:
    return {"tensors": len(weights.index), "bytes_written": weights.bytes_written, "seconds": round(seconds, 2)}


def _fp8_weights(ctx: BuildContext) -> dict:
    from clover_export.quantize.weights import quantize_weights

    folder, t = ctx.out / FP8_WEIGHTS.folder, time.perf_counter()
    if ctx.writer is not None:
        weights = ctx.writer.result()
        waited = time.perf_counter() - t
        sec, how = ctx.writer.seconds, f"in the background beside the stages above (waited {waited:.1f} s)"
    else:
        from tqdm import tqdm

        from clover_export.artifact.manifest import load_artifact
        from clover_export.model.sizing import fp8_weight_names
        from clover_export.quantize.graph import source_plans

        art = load_artifact(ctx.out / EXPORT["fp32"].folder)
        weights = quantize_weights(source_plans(art), fp8_weight_names(art.config), folder,
                                   progress=lambda it: tqdm(it, desc="quantize", unit="tensor", leave=False))
        sec, how = time.perf_counter() - t, "here"
    log.info(f"[quantize] {folder.name}: {len(weights.index)} tensors, {weights.bytes_written / 2**30:.2f} GiB "
             f"written once in {sec:.1f} s ({weights.bytes_written / max(sec, 1e-9) / 2**20:.0f} MiB/s), {how}")
    ctx.weights = weights
    return fp8_weights_record(weights, sec)


def _fp8_weights_before(ctx: BuildContext, rec: dict) -> str:
    from clover_export.quantize.weights import load_fp8_weights

    ctx.weights = load_fp8_weights(ctx.out / FP8_WEIGHTS.folder)
    return f"[quantize] reused {FP8_WEIGHTS.folder} ({ctx.weights.bytes_written / 2**30:.2f} GiB)"


# the FP8 weight file both FP8 graphs link: taken from the background writer (`background.py`) or written here
FP8_WEIGHTS = Stage("fp8-weights", _fp8_weights, folder="fp8-weights", reuse=_fp8_weights_before,
                    key=lambda ctx: ("fp8-weights", *ctx.base),
                    disk=lambda ctx: disk_plan.fp8_weight_file_bytes(ctx.cfg))


def _quantize(source: str, name: str, ctx: BuildContext) -> dict:
    from clover_export.quantize.graph import quantize_graph

    # force: the build's own folder
    rep = quantize_graph(ctx.out / source, ctx.out / name, ctx.amax, force=True, weights=ctx.weights)
    placed = f"{rep.bytes_written} bytes copied" if rep.bytes_written else "linked"  # small files are copied
    log.info(f"[quantize] {name}: {rep.gemms} GEMMs with Q/DQ, {rep.expert_tensors} expert tensors e4m3, "
             f"weights from {ctx.weights.dir.name}/ ({placed})")
    return {"gemms": rep.gemms, "experts": rep.expert_tensors}


def quantize(source: str, name: str) -> Stage:
    """The FP8 Q/DQ graph `name` made from the graph `source`, its weights linked from fp8-weights/."""
    return Stage(f"quantize-{name}", partial(_quantize, source, name), folder=name,
                 reuse=lambda ctx, rec: f"[quantize] reused {name}",
                 key=lambda ctx: ("quantize", name, ctx.key(CALIBRATE), ctx.key(FP8_WEIGHTS)),
                 disk=lambda ctx: disk_plan.GRAPH_BYTES)


# FP8 on fp32 activations (its accuracy measured in ONNX Runtime), and on bf16 ones (what TensorRT builds from)
QUANTIZE_FP32 = quantize(EXPORT["fp32"].folder, "onnx-fp8")
QUANTIZE_BF16 = quantize(EXPORT["bf16"].folder, "onnx-fp8-bf16")


def _agreement(ctx: BuildContext) -> dict | None:
    if not ctx.whole:
        log.info("[validate onnx-fp8] skipped: top-1 agreement plays the whole fp32 and FP8 graphs in ONNX Runtime, "
                 "and this build validates a slice, not whole graphs (see [validate] above)")
        return None
    from clover_export.verify.agreement import HELDOUT_PROMPTS, agreement

    a = agreement(ctx.out / EXPORT["fp32"].folder, ctx.out / QUANTIZE_FP32.folder, ctx.model_dir, HELDOUT_PROMPTS)
    log.info(f"[validate onnx-fp8] {a.line()}")
    ctx.agreement = {"line": a.line(), "top1_agreement": a.top1_agreement, "max_abs_logit_error": a.max_abs_logit_error}
    return ctx.agreement


def _agreed_before(ctx: BuildContext, rec: dict) -> str:
    ctx.agreement = rec
    return f"[validate onnx-fp8] reused: {rec['line']}"


# top-1 agreement of onnx-fp8 with onnx-fp32 on held-out prompts (whole-graph validation only)
FP8_AGREEMENT = Stage(f"validate-{QUANTIZE_FP32.folder}", _agreement, reuse=_agreed_before,
                      key=lambda ctx: ("agreement", ctx.key(CALIBRATE)))


def _fp8_gate(ctx: BuildContext) -> None:
    agr = ctx.agreement
    if agr is not None and agr["top1_agreement"] < FP8_MIN_AGREEMENT:  # the engine stage never sees it
        raise CloverError("build", f"onnx-fp8 is below the FP8 gate: {agr['line']} (gate: top-1 agreement "
                          f">= {100 * FP8_MIN_AGREEMENT:.0f}%); no engine was built",
                          "calibrate on prompts like your traffic (--calib FILE), or build --precision bf16")


# the agreement, measured or reused, at least FP8_MIN_AGREEMENT: else the build fails before the engine
FP8_GATE = Stage("fp8-gate", _fp8_gate)


def _twins(ctx: BuildContext) -> None:
    from clover_export.verify.twins import require_twins

    fp32, bf16 = ctx.out / QUANTIZE_FP32.folder, ctx.out / QUANTIZE_BF16.folder
    log.info(f"[validate {bf16.name}] {require_twins(fp32, bf16)}")


# onnx-fp8-bf16 is onnx-fp8 up to dtype, so the agreement measured on onnx-fp8 holds for it (`verify.twins`)
TWINS = Stage(f"validate-{QUANTIZE_BF16.folder}", _twins)


# --- engine ---------------------------------------------------------------------------------------------------
def _facts(ctx: BuildContext):
    from clover_export.pipeline.doctor import collect

    if ctx.facts is None:
        ctx.facts = collect()
    return ctx.facts


def _engine_blocker(ctx: BuildContext) -> str | None:
    """Why no engine of the build's precision can be built here (`doctor.engine_blocker`), or None."""
    from clover_export.pipeline.doctor import engine_blocker

    return engine_blocker(ctx.opts.precision, _facts(ctx))


def _engine_key(ctx: BuildContext) -> tuple | None:
    if _engine_blocker(ctx):
        return None
    facts = _facts(ctx)
    return "engine", ctx.opts.precision, ctx.opts.strip_weights, facts.tensorrt, facts.gpus[0]["name"], *ctx.base


def _engine_bytes(ctx: BuildContext) -> int | None:
    """The plan's size (its weights, unless stripped); None where no engine will be built."""
    from clover_export.model.sizing import weight_bytes

    if _engine_blocker(ctx):
        return None
    return 0 if ctx.opts.strip_weights else weight_bytes(ctx.cfg, ctx.opts.precision)


def _engine_problems(ctx: BuildContext) -> list[CloverError]:
    why = _engine_blocker(ctx) if ctx.opts.require_engine else None
    return [CloverError("build", f"--require-engine: no engine can be built here: {why}",
                        "run `clover-export doctor` to see what is missing")] if why else []


def _engine(graph_name: str, ctx: BuildContext) -> dict | None:
    why = _engine_blocker(ctx)
    if why:
        log.info(f"[engine] skipped: {why}; the ONNX graphs above are complete and validated")
        ctx.result.skipped.append(why)
        ctx.stages.record(ENGINE_STAGE, "skipped", {"skipped": why})
        if ctx.opts.require_engine:
            raise CloverError("build", f"no engine was built: {why}",
                              "run `clover-export doctor` to see what is missing")
        return None
    from clover_export.artifact.manifest import load_artifact
    from clover_export.engines.builder import build_engine
    from clover_export.engines.profiles import BuildSettings
    from clover_export.exporter.trt_graph import TRT_GRAPH

    graph = ctx.out / graph_name
    plan_path = graph / ENGINE_FILE  # beside its graph: `generate GRAPH_DIR --backend trt` finds it there
    settings = BuildSettings(ctx.opts.precision, 4 * 1024**3, ctx.opts.strip_weights, str(ctx.out / "timing.cache"))
    info = build_engine(graph / TRT_GRAPH, plan_path, load_artifact(graph).manifest.profiles, settings)
    record_engine(graph, info)
    log.info(f"[engine] {plan_path}: {info['bytes'] / 2**20:.1f} MiB, TensorRT {info['tensorrt']}")
    ctx.result.engine = plan_path
    return {**info, "graph": graph.name}


def record_engine(graph: Path, info: dict) -> None:
    """The graph folder's manifest names the engine built beside it (ENGINE_FILE) with the builder's record
    (`engines.builder.build_engine`): where the trt backend finds the plan and the graph to refit it from."""
    from clover_export.artifact.manifest import Engine, Manifest

    Manifest.load(graph).replace(engine=Engine.from_json(ENGINE_FILE, info)).write(graph)


def _engine_before(graph_name: str, ctx: BuildContext, rec: dict) -> str:
    ctx.result.engine = ctx.out / graph_name / ENGINE_FILE
    return f"[engine] reused {ctx.result.engine}"


def engine(graph_name: str) -> Stage:
    """The TensorRT engine of the graph `graph_name`, beside it; skipped with the reason where no engine can
    be built here (the build still succeeds, unless --require-engine)."""
    return Stage(ENGINE_STAGE, partial(_engine, graph_name), folder=f"{graph_name}/{ENGINE_FILE}",
                 reuse=partial(_engine_before, graph_name), key=_engine_key, disk=_engine_bytes,
                 checks=_engine_problems)


ENGINE_STAGE = "engine"


def stage_list(whole: bool, fp8: bool) -> tuple[Stage, ...]:
    """Every stage of a build, in order, the engine last (`build.py` runs it after the work beside the
    stages has been collected). `whole`: whole-graph validation, else the full-width slice
    (`checks.validation_mode`)."""
    stages = [EXPORT["fp32"], VALIDATE["fp32"] if whole else VALIDATE_SLICES]
    if whole:
        stages += [EXPORT["bf16"], VALIDATE["bf16"]]
    if fp8:
        stages.append(CALIBRATE)
    if not whole:  # the background export, collected after the calibration that runs beside it
        stages += [EXPORT["bf16"], BF16_CHECKED_AT_EXPORT]
    if fp8:
        stages += [FP8_WEIGHTS, QUANTIZE_FP32, QUANTIZE_BF16, FP8_AGREEMENT, FP8_GATE, TWINS]
    return (*stages, engine(QUANTIZE_BF16.folder if fp8 else EXPORT["bf16"].folder))
