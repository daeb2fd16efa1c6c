"""Engine commands: `doctor` (and `build`, below)."""

from __future__ import annotations

import json

import click

from clover_export.cli import quiet
from clover_export.pipeline.context import BuildOptions

BUILD = BuildOptions()  # the options' defaults: one place for the command and the Python API


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the facts as JSON.")
def doctor(as_json):
    """Say what this machine has (torch/CUDA/GPU, ONNX Runtime, TensorRT, Triton) and what will work."""
    from dataclasses import asdict

    from clover_export.pipeline.doctor import capabilities, collect, report

    facts = collect()
    plans = gpu_plans(facts)
    if as_json:
        rows = [{"what": w, "works": ok, "why": why} for w, ok, why in capabilities(facts)]
        click.echo(json.dumps({"facts": asdict(facts), "capabilities": rows,
                                "full_size_max_batch": plans}, indent=2))
    else:
        click.echo("\n".join(report(facts)))
        for line in plans_lines(plans):
            click.echo(line)


def gpu_plans(facts) -> dict:
    """For this GPU: the largest batch of the full-size model at full context, per precision (memory plan)."""
    if not facts.gpus:
        return {}
    import json as _json
    from importlib import resources

    from clover_export.core.config import config_from_dict
    from clover_export.core.step_shape import PREFILL_CHUNK
    from clover_export.engines.memory_plan import plan_memory

    config = resources.files("clover_export").joinpath("data/clover_35b_a3b_config.json")
    cfg = config_from_dict(_json.loads(config.read_text()))
    mem = facts.gpus[0]["memory"]
    return {p: plan_memory(cfg, p, 1, cfg.max_context, PREFILL_CHUNK, mem).max_batch_that_fits()
            for p in ("bf16", "fp8")}


def plans_lines(plans: dict) -> list[str]:
    if not plans:
        return ["memory plan: no GPU here (`clover-export info MODEL --gpu-memory GIB` plans for one)"]
    return [f"memory plan, Clover-35B-A3B at 131072 tokens on this GPU: up to {n} sequence(s) in {p}"
            for p, n in plans.items()]


@click.command()
@click.argument("model", required=False, default=None)
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Build folder: new, empty, or an earlier build (re-running reuses what matches).")
@click.option("--precision", type=click.Choice(["bf16", "fp8"]), default=BUILD.precision, show_default=True,
              help="Engine precision. fp8: e4m3 GEMM and expert weights with per-channel scales, calibrated "
                   "activations.")
@click.option("--max-batch", type=int, default=BUILD.max_batch, show_default=True,
              help="Batch rows per step = cache slots.")
@click.option("--max-context", type=int, default=BUILD.max_context,
              help="Cached positions per slot (default: the model's max_context).")
@click.option("--chunk", type=int, default=BUILD.chunk, show_default=True, help="Prefill chunk (causal rows per step).")
@click.option("--weights", type=click.Choice(["link", "copy"]), default=BUILD.weights, show_default=True,
              help="How the graphs reference the checkpoint (see `clover-export export --help`; not map: TensorRT "
                   "reads the weights from files beside the graph).")
@click.option("--calib", type=click.Path(dir_okay=False, exists=True), default=BUILD.calib,
              help="Calibration prompts for fp8 (one per line, or a JSON list); default: a small built-in set.")
@click.option("--gpu-memory", type=float, default=BUILD.gpu_memory_gib,
              help="GPU memory in GiB for the memory plan (default: the GPU's).")
@click.option("--strip-weights", is_flag=True, default=BUILD.strip_weights,
              help="Weight-stripped plan, refitted from the ONNX graph at load.")
@click.option("--require-engine", is_flag=True, default=BUILD.require_engine,
              help="Exit non-zero, before any work, when no TensorRT engine can be built here.")
@click.option("--allow-qwen", is_flag=True, default=BUILD.allow_qwen,
              help="Allow a plain Qwen3.5-MoE checkpoint (Clover tensors zero-filled).")
@click.option("--force", is_flag=True, default=BUILD.force,
              help="Redo every stage of an earlier build in OUT instead of reusing it.")
@click.option("--validation", type=click.Choice(["auto", "whole", "slice"]), default=BUILD.validation,
              show_default=True,
              help="whole: every graph against the reference model in ONNX Runtime (~5x the bf16 weights in RAM); "
                   "slice: the first layer of each kind (with embedding, norm, lm_head) at full width; "
                   "auto: whole when it fits in half the memory.")
def build(model, out, precision, max_batch, max_context, chunk, weights, calib, gpu_memory, strip_weights,
          require_engine, allow_qwen, force, validation):
    """Turn MODEL into validated ONNX graphs and a TensorRT engine.

    First everything the stages need is checked (config, checkpoint headers,
    OUT, memory and disk plans; for fp8 the tokenizer and calibration
    prompts; TensorRT with --require-engine): every problem is reported at
    once, one line each, and nothing is written.

    Stages: export (fp32 and bf16 step graphs) -> ONNX Runtime
    validation against the reference model -> (fp8: calibrate, quantize,
    measure top-1 agreement with the fp32 graph; below 97% the build fails
    with the figures; compare the TensorRT-bound twin with it) -> TensorRT
    engine. Where TensorRT or a GPU is missing the engine stage is skipped
    with the reason and the command still succeeds (unless --require-engine).

    At the real model's size: no weight is converted into a new file (the
    fp32 graph casts the bf16 shards in the graph); FP8 weights are written
    once and shared by both FP8 graphs; calibration streams the model layer
    by layer; where the whole graph does not fit in memory, the first layer
    of each kind (with embedding, norm and lm_head) is validated at full
    width instead, while the bf16 graph is exported in a background process.
    Ctrl-C keeps finished stages; re-running continues.
    """
    from clover_export.pipeline.build import build as run_build

    opts = BuildOptions(precision=precision, max_batch=max_batch, max_context=max_context, chunk=chunk,
                        weights=weights, calib=calib, gpu_memory_gib=gpu_memory, strip_weights=strip_weights,
                        require_engine=require_engine, allow_qwen=allow_qwen, force=force, validation=validation)
    try:
        with quiet("clover_export.exporter", "clover_export.verify"):  # one line per stage: not theirs too
            res = run_build(model, out, opts)
    except KeyboardInterrupt:  # every stage writes atomically: the finished ones stay reusable
        click.echo(f"build interrupted: finished stages are kept in {out} (build.json); run the same command "
                   "again to continue", err=True)
        raise SystemExit(130) from None
    done = "engine " + str(res.engine) if res.engine else "no engine (" + "; ".join(res.skipped) + ")"
    click.echo(f"build finished: {res.out} ({done})")


COMMANDS = [doctor, build]
