"""CLI: `clover-export export | validate | check` (STEP_GRAPH.md 1-3, 5)."""

from __future__ import annotations

from pathlib import Path

import click

from clover_export.artifact.manifest import COPY_BELOW, WEIGHT_MODES
from clover_export.core.step_shape import MAX_BATCH, PREFILL_CHUNK


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@click.command("export")
@click.argument("model", required=False)
@click.option("--out", "out", required=True, type=click.Path(file_okay=False),
              help="Output folder: new or empty (written atomically), or an earlier export with --force.")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
              help="Graph dtype. bf16: TensorRT / GPU; fp32: ONNX Runtime on CPU (the stored weights are cast "
                   "inside the graph: no weight file is converted).")
@click.option("--weights", type=click.Choice(WEIGHT_MODES), default="link", show_default=True,
              help="link: reflink the shards where the filesystem can (zero copy); else copy them when the "
                   f"checkpoint is small (up to {COPY_BELOW // 2**20} MiB), else hard-link them (zero copy; ONNX "
                   "Runtime and TensorRT read hard links, onnx >= 1.21's onnx.load / onnx.checker and polygraphy "
                   "inspect refuse them; export says so). map: reference the checkpoint in place through "
                   "weights.json (zero copy, ONNX Runtime through clover_export's loader only: no model.trt.onnx). "
                   "copy: a self-contained folder every tool loads. See docs/exports.md.")
@click.option("--block-size", type=int, default=None, help="Block rows per step (default: the config's block_size).")
@click.option("--chunk", type=int, default=PREFILL_CHUNK, show_default=True, help="Causal rows of the prefill profile.")
@click.option("--max-batch", type=int, default=MAX_BATCH, show_default=True, help="Largest batch of the profiles.")
@click.option("--slots", type=int, default=None, help="Cache slots per pool in the profiles (default: --max-batch).")
@click.option("--max-len", type=int, default=None, help="Pool length L in the profiles (default: max_context).")
@click.option("--allow-qwen", is_flag=True,
              help="Accept a plain Qwen3.5-MoE checkpoint (block-mixer tensors zero-filled).")
@click.option("--force", is_flag=True, help="Replace OUT when it holds an earlier export (never any other folder).")
def export_cmd(model, out, dtype, weights, block_size, chunk, max_batch, slots, max_len, allow_qwen, force):
    """Export MODEL's step graph (ONNX, opset 20 / IR 9) with manifest.json to OUT.

    One graph serves every kind of step: per batch row C causal rows (C >= 0)
    then block_size block rows; dynamic batch, T = C + block_size, slots and
    pool length. The model is traced on the meta device: no weight is loaded or
    converted (the graph references the checkpoint's shards, placed per
    --weights; the output says how and which tools will read them). The readiness
    check (`clover-export check`) runs at the end; nothing is written unless
    everything succeeds.
    """
    from clover_export.exporter.export import export

    res = export(model, out, dtype=dtype, weights=weights, block_size=block_size, chunk=chunk,
                 max_batch=max_batch, slots=slots, max_len=max_len, allow_qwen=allow_qwen, force=force)
    w = res.weights
    for msg in w.messages:
        click.echo(f"{'warning' if msg in w.warnings else 'note'}: {msg}")
    click.echo(f"weights: --weights {w.mode}" + (f" (requested {w.requested})" if w.mode != w.requested else "")
               + f" [{w.placement}]: {_mib(w.bytes_referenced)} referenced, {_mib(w.bytes_copied)} copied, "
               f"{_mib(w.bytes_converted)} converted ({len(w.converted)} tensors)")
    click.echo(f"wrote {res.dir} in {res.seconds:.1f} s ({_mib(res.bytes_written)} written); readiness check passed")


@click.command("check")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--verbose", "-v", is_flag=True, help="Also list warnings and notes.")
def check_cmd(folder, verbose):
    """Check an exported FOLDER for TensorRT: operators and types against TensorRT's ONNX parser matrix
    (and its statically checkable restrictions), opset 20 / IR 9, plugin attributes, external-data paths,
    and that the optimisation profiles cover every dynamic dimension. For TensorRT it reports the graph it
    would parse (model.trt.onnx), its plugin nodes by op, that no clover functions remain and the minimum
    TensorRT version; map-mode weights, a function left in model.trt.onnx or a plugin node without
    plugin_namespace / plugin_version / aot are failures. It also says which tools will read the folder's
    external data and which refuse it (hard links: onnx >= 1.21; map mode: all but clover's loader), and
    what to do (docs/exports.md). Exit status 1 on any failure (one line each)."""
    from clover_export.exporter.check import check_folder

    rep = check_folder(folder)
    for line in rep.tensorrt + rep.readers:
        click.echo(line)
    shown = [f for f in rep.findings if verbose or f.level == "fail"]
    for f in shown:
        click.echo(f"  {f}")
    counts = {lvl: sum(f.level == lvl for f in rep.findings) for lvl in ("fail", "warn", "info")}
    click.echo(f"{folder}: {rep.nodes_checked} nodes checked; {counts['fail']} failure(s), "
               f"{counts['warn']} warning(s), {counts['info']} note(s)" + ("" if verbose else " (-v lists them)"))
    if counts["fail"]:
        raise SystemExit(1)


@click.command("validate")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--steps", type=int, default=None, help="Run only the first N steps of the scenario.")
@click.option("--save-io", type=click.Path(dir_okay=False), default=None,
              help="Save inputs and outputs in Polygraphy's JSON format: FILE (RunResults) and FILE's "
                   "`.inputs.json` sibling (input data list), to replay against TensorRT elsewhere. "
                   "FILE must be new (or, with --force, an earlier --save-io file).")
@click.option("--no-cuda", is_flag=True, help="Do not use ONNX Runtime's CUDA EP even where present.")
@click.option("--reference-evaluator/--no-reference-evaluator", default=None,
              help="Also run one small step with onnx.reference (default: for bf16 graphs).")
@click.option("--force", is_flag=True, help="Replace an earlier --save-io file (never any other file).")
def validate_cmd(folder, steps, save_io, no_cuda, reference_evaluator, force):
    """Run FOLDER's graph in ONNX Runtime (and onnx.reference for bf16) against the reference model on
    the same inputs, at the shapes the graph runs with: a full prefill chunk (the export's --chunk causal
    rows) and the profiles' largest batch, a commit folded with a block, block-only steps, batch rows in
    different phases and cached lengths, cache pools carried between steps. Reports per-output max
    abs / relative error against tolerances; exit status 1 on any failure.

    An FP8 graph (from `build --precision fp8`) is judged against the graph it was quantized from:
    top-1 agreement over denoise positions of held-out prompts and the logit error (pass: >= 97%).
    The FP8 graph on bf16 activations (onnx-fp8-bf16, what TensorRT builds from) must be the same graph
    as its fp32-activation twin beside it up to dtype, which is then judged as above."""
    from clover_export.artifact.manifest import load_artifact
    from clover_export.verify.validate import validate

    if save_io:  # before any work
        from clover_export.artifact.outdir import claim_file
        from clover_export.verify.polygraphy_io import inputs_path

        for option, path in (("--save-io", save_io), ("--save-io's inputs file", inputs_path(Path(save_io)))):
            claim_file(path, "validate-io", command="validate", force=force, option=option)
    art = load_artifact(folder)
    if art.manifest.quantization is not None:
        from clover_export.verify.agreement import validate_fp8

        if art.dtype != "fp32":  # ONNX Runtime's CPU EP runs no bf16: judged as the twin of its fp32 graph
            from clover_export.verify.twins import find_twin, require_twins

            twin = find_twin(art.dir)
            click.echo(f"{art.dir.name}: {require_twins(twin, art.dir)} ({twin.name})")
            art = load_artifact(twin)
        line, passed = validate_fp8(art)
        click.echo(line)
        click.echo("PASSED" if passed else "FAILED")
        if not passed:
            raise SystemExit(1)
        return
    rep = validate(folder, steps=steps, save_io=save_io, cuda=not no_cuda, reference_evaluator=reference_evaluator)
    click.echo(rep.format())
    if not rep.passed:
        raise SystemExit(1)


COMMANDS = [export_cmd, check_cmd, validate_cmd]
