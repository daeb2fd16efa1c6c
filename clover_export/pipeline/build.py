"""`clover-export build`: export -> validate -> (fp8: calibrate, quantize, validate) -> engine.

Every stage writes its own folder atomically and records a key of what it
was made from in `build.json`; re-running reuses a stage whose key matches
and redoes one whose inputs changed (`context.py`: `BuildContext.run`; the
stages are in `stages.py`). Without TensorRT or a GPU the engine
stage is skipped with the reason, and the build still succeeds (unless
`require_engine`).

At the real model's size nothing is loaded whole and no weight
is converted into a new file: the graphs reference the checkpoint's bf16
shards (the fp32 graph casts inside the graph), the FP8 weights are
quantized once, tensor by tensor, into `fp8-weights/` and linked by both
FP8 graphs, calibration streams the reference model layer by layer
(`quantize/stream_calib.py`), and where whole-graph validation would not fit in
memory, a slice at full width (the first layer of each kind, the embedding,
norm and lm_head) is validated instead (`verify/slice.py`).

Before the first stage, `check_inputs` (`checks.py`) checks everything the stages will
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

from pathlib import Path

from clover_export.pipeline import stages as S
from clover_export.pipeline.background import beside_the_stages
from clover_export.pipeline.checks import check_inputs
from clover_export.pipeline.context import BuildOptions, BuildResult

__all__ = ["BuildOptions", "BuildResult", "build"]


def build(model, out: str | Path, opts: BuildOptions) -> BuildResult:
    """MODEL -> validated ONNX graphs (and, where TensorRT and a GPU are here, an engine) in OUT; progress on
    the `clover_export` loggers (the CLI prints it)."""
    ctx = check_inputs(model, out, opts)  # every problem at once, before anything is written; ctx.plan: the stages
    S.begin(ctx)
    *graphs, engine = ctx.plan  # `stages.stage_list`: the engine last
    with beside_the_stages(ctx):  # the FP8 weight file (thread), with slice validation the bf16 export (process)
        ctx.run(*graphs)
    ctx.run(engine)
    return S.finish(ctx)
