"""Everything `build` needs, checked before its first stage; the stages' keys.

`check_inputs` reports every problem at once, one line each, with nothing
written (docs/build.md), and hands the stages their context.
"""

from __future__ import annotations

import logging
from pathlib import Path

from clover_export.core.errors import CloverError
from clover_export.pipeline.context import BuildContext, BuildOptions, Stages, stage_key

log = logging.getLogger(__name__)

BUILD_WEIGHT_MODES = ("link", "copy")  # export's weight modes a build accepts (STEP_GRAPH.md 2: files beside the graph)


def checkpoint_key(model_dir: Path) -> str:
    """Identity of the weights without reading them: shard names, sizes and mtimes."""
    from clover_export.core.checkpoint import shard_files

    return stage_key([(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in shard_files(model_dir)])


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


def check_inputs(model, out, opts: BuildOptions) -> BuildContext:
    """Everything `build` will need, checked before its first stage: the options, the model folder, its
    config and checkpoint headers, each stage's own checks (`Stage.checks`: the calibration's tokenizer,
    chat template, mask token and prompts; TensorRT where --require-engine asks for an engine), OUT, GPU
    memory, disk space. Every problem is reported at once, one line each, and nothing is written (not even
    OUT). Returns the stages' context, its `plan` the build's stages (`stages.stage_list`)."""
    import warnings

    from clover_export.artifact.outdir import claim_dir
    from clover_export.core.checkpoint import locate_tensors, plan_tensors
    from clover_export.core.config import load_config
    from clover_export.engines.memory_plan import plan_memory
    from clover_export.engines.memory_plan import shortfall as memory_shortfall
    from clover_export.model.loading import resolve_model_dir
    from clover_export.pipeline.disk_plan import plan_disk
    from clover_export.pipeline.disk_plan import shortfall as disk_shortfall
    from clover_export.pipeline.stages import stage_list

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
    max_context = cfg.max_context if opts.max_context is None else opts.max_context
    ctx = BuildContext(opts=opts, out=out, stages=Stages(out) if out is not None else None, model_dir=model_dir,
                       cfg=cfg, max_context=max_context, validation=validation or (True, ""))
    ctx.plan = stage_list(ctx.whole, ctx.fp8) if precision_ok else ()
    for stage in ctx.plan:
        for e in stage.checks(ctx) if stage.checks is not None else []:
            problem(e)
    ctx.memory = attempt(plan_memory, cfg, opts.precision, opts.max_batch, max_context, opts.chunk, gpu_bytes) \
        if precision_ok else None
    if ctx.memory is not None and (short := memory_shortfall(ctx.memory)):
        for line in ctx.memory.lines():  # the figures behind the problem line
            log.info(line)
        problem(CloverError("build", short))
    if out is not None and planned is not None and precision_ok:
        if opts.force:
            ctx.stages.data["stages"] = {}
        ctx.base = (str(model_dir.resolve()), checkpoint_key(model_dir), cfg.fingerprint(), opts.max_batch,
                    max_context, opts.chunk, opts.weights, opts.allow_qwen)
        ctx.disk = plan_disk(ctx, ctx.plan)
        if short := disk_shortfall(ctx.disk):
            for line in ctx.disk.lines():
                log.info(line)
            problem(CloverError("build", short))
    refuse(problems)
    return ctx


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
