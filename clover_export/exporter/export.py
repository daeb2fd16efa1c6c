"""`clover-export export`: one step graph + manifest + weights, written atomically (STEP_GRAPH.md 1-3).

Order: config and checkpoint headers are checked first (no weight byte read),
the step graph is traced on the meta device, the weights are attached as
external data per the chosen mode (`weights.py`; how they were placed --
reflink, copy, hard link, mapped -- is in the manifest and decides which
tools read the folder: docs/exports.md), the folder is checked (`check.py`) and
only then moved into place (`outdir.commit_dir`). Any failure removes
the temporary folder: an existing export at OUT stays as it was.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

import onnx

from clover_export.artifact import manifest as A
from clover_export.artifact.outdir import claim_dir, commit_dir
from clover_export.core import names
from clover_export.core.checkpoint import locate_tensors, plan_tensors
from clover_export.core.config import CloverConfig, load_config
from clover_export.core.errors import CloverError
from clover_export.core.step_shape import MAX_BATCH, PREFILL_CHUNK
from clover_export.exporter.trace import BATCH, IR_VERSION, OPSET, POOL_LEN, SLOTS, STEP_LEN, trace_step
from clover_export.exporter.trt_graph import TRT_GRAPH, write_trt_graph
from clover_export.exporter.weights import WeightReport, WeightWriter, shard_bytes
from clover_export.model.loading import parse_dtype, resolve_model_dir
from clover_export.plugins import contracts


@dataclass
class ExportResult:
    dir: Path
    weights: WeightReport
    seconds: float
    bytes_written: int  # everything the export wrote (graph, json, copied / converted weights)
    check_failures: int


def profiles(block_size: int, chunk: int, max_batch: int, slots: int, max_len: int) -> list[dict]:
    """The optimisation profiles the graph needs: decode (C in 0..block_size: plain denoise steps and a
    commit folded into the next block) and prefill (C in 0..chunk: prompt chunks, the last one folded
    with the first block). Pools are allocated once: slots and pool_len are fixed."""

    def profile(name: str, c: int, batch_opt: int) -> dict:
        return {
            "name": name, "causal_rows": c, "block_rows": block_size,
            "dims": {BATCH: [1, batch_opt, max_batch], STEP_LEN: [block_size, c + block_size, c + block_size],
                     SLOTS: [slots] * 3, POOL_LEN: [max_len] * 3},
        }

    return [profile("decode", block_size, max_batch), profile("prefill", chunk, 1)]


def profile_shapes(io: list[dict], profile: dict) -> dict[str, dict[str, list[int]]]:
    """Input name -> {"min", "opt", "max"} shapes of one profile (as TensorRT wants them)."""
    out = {}
    for spec in io:
        out[spec["name"]] = {
            k: [profile["dims"][d][i] if isinstance(d, str) else d for d in spec["shape"]]
            for i, k in enumerate(("min", "opt", "max"))
        }
    return out


def tool_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("clover-export", "torch", "onnx", "onnxscript", "onnx-ir", "onnxruntime", "safetensors"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def export(
    model: str | Path | None,
    out: str | Path,
    dtype: str = "bf16",
    weights: str = "link",
    block_size: int | None = None,
    chunk: int = PREFILL_CHUNK,
    max_batch: int = MAX_BATCH,
    slots: int | None = None,
    max_len: int | None = None,
    allow_qwen: bool = False,
    log: Callable[[str], None] = lambda s: None,
    force: bool = False,
    config: CloverConfig | None = None,
    tensor_plans: dict | None = None,
) -> ExportResult:
    """Export MODEL's step graph into OUT (see the module docstring); returns what was done.

    OUT follows `clover_export.artifact.outdir`: a new or empty folder, or (with `force`) an earlier export.
    `config` + `tensor_plans` replace the folder's config and checkpoint plan (a slice of the model:
    `exporter/slice.py`); the manifest still names MODEL's folder."""
    t0 = time.perf_counter()
    if weights not in A.WEIGHT_MODES:
        raise CloverError("export", f"unknown weights mode {weights!r}", f"expected one of {', '.join(A.WEIGHT_MODES)}")
    torch_dtype = parse_dtype(dtype)
    model_dir = resolve_model_dir(model)
    cfg = load_config(model_dir) if config is None else config
    N = cfg.block_size if block_size is None else block_size
    slots = max_batch if slots is None else slots
    max_len = cfg.max_context if max_len is None else max_len
    for name, v in (("--block-size", N), ("--chunk", chunk), ("--max-batch", max_batch), ("--slots", slots), ("--max-len", max_len)):
        if not isinstance(v, int) or v <= 0:
            raise CloverError("export", f"{name} must be a positive integer, got {v!r}")
    if slots < max_batch:
        raise CloverError("export", f"--slots ({slots}) is below --max-batch ({max_batch})", "each batch row owns one slot")
    out = Path(out).absolute()
    _refuse_overlap(model_dir, out)
    claim_dir(out, "export", command="export", force=force, model_dirs=[model_dir])
    plans = tensor_plans if tensor_plans is not None else \
        plan_tensors(cfg, locate_tensors(model_dir), allow_qwen=allow_qwen)  # every problem, before any work
    log(f"model: {model_dir} ({cfg.model_type}, {cfg.num_hidden_layers} layers), graph dtype {dtype}, block {N}")
    t = time.perf_counter()
    traced = trace_step(cfg, torch_dtype, N)
    log(f"traced on the meta device in {time.perf_counter() - t:.1f} s")
    _match_parameters(traced.parameters, plans, cfg)

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as e:
        raise CloverError("export", f"cannot create a folder beside {out} ({e.strerror or e})") from None
    try:
        _chmod_like_umask(tmp)
        used = [plans[name] for name in traced.parameters if name in plans]
        writer = WeightWriter(tmp, weights, torch_dtype, checkpoint_bytes=shard_bytes(used))
        try:
            for name in traced.parameters:
                if name in plans:
                    writer.add(plans[name])
                else:
                    writer.add_zeros(name, traced.parameters[name][0])
        finally:
            writer.close()
        proto = traced.model
        proto.graph.initializer.extend(writer.initializers)
        nodes = weight_nodes_before_use(list(writer.nodes), list(proto.graph.node))
        del proto.graph.node[:]
        proto.graph.node.extend(nodes)
        onnx.save_model(proto, str(tmp / A.GRAPH))
        (tmp / A.WEIGHT_MAP).write_text(json.dumps({"mode": writer.report.mode, "tensors": writer.weight_map}))
        manifest = _manifest(cfg, model_dir, dtype, N, chunk, max_batch, slots, max_len, traced, writer.report)
        engine_bound = dtype != "fp32" and writer.report.mode != "map"  # map mode cannot reach TensorRT
        if engine_bound:  # what TensorRT parses: no clover functions, MoE as AOT sub-ops, same external data
            manifest["tensorrt"] = write_trt_graph(tmp, proto, cfg.num_experts, max_len)
        (tmp / A.MANIFEST).write_text(json.dumps(manifest, indent=2))
        for fname in A.COMPANION_FILES:  # the runtime needs them; the model folder may move
            if (model_dir / fname).is_file():
                shutil.copyfile(model_dir / fname, tmp / fname)
        from clover_export.exporter.check import check_folder

        report = check_folder(tmp, proto=proto, tensorrt=writer.report.mode != "map")
        if report.failures:
            raise CloverError("check", f"the exported graph fails {len(report.failures)} readiness check(s):\n"
                              + report.format(only_failures=True),
                              "nothing was written; this is an exporter bug worth reporting")
        written = writer.report.weight_bytes_written + sum(
            (tmp / f).stat().st_size for f in (A.GRAPH, A.WEIGHT_MAP, A.MANIFEST) + ((TRT_GRAPH,) if engine_bound else ()))
        commit_dir(tmp, out, "export", command="export", force=force, model_dirs=[model_dir])
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        raise CloverError("export", f"writing the export failed: {e.strerror or e}{where}",
                          f"nothing was written; {out} is as it was before") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(out, writer.report, time.perf_counter() - t0, written, len(report.failures))


def weight_nodes_before_use(weight_nodes: list, nodes: list) -> list:
    """The weight nodes (casts of stored dtypes, per-expert Concat + Reshape) each placed right before the
    first node that reads them: ONNX Runtime follows the order, so a cast weight lives only while used
    (at full size an fp32 embedding or expert tensor is GBs; issue 11)."""
    producer = {o: n for n in weight_nodes for o in n.output}
    done: set[int] = set()
    out: list = []

    def emit(name: str) -> None:
        n = producer.get(name)
        if n is None or id(n) in done:
            return
        done.add(id(n))
        for i in n.input:
            emit(i)
        out.append(n)

    for node in nodes:
        for i in _reads(node):
            emit(i)
        out.append(node)
    out += [n for n in weight_nodes if id(n) not in done]
    return out


def _reads(node) -> list[str]:
    """A node's inputs and the outer-scope names its subgraphs read."""
    names_ = [i for i in node.input if i]
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            for n in g.node:
                names_ += _reads(n)
    return names_


def _chmod_like_umask(path: Path) -> None:
    """mkdtemp makes 0700 folders; the export should get the usual permissions."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o777 & ~mask)


def _refuse_overlap(model_dir: Path, out: Path) -> None:
    """OUT is replaced wholesale: it must not be, contain, or lie inside the checkpoint folder."""
    m, o = model_dir.resolve(), out.resolve()
    if m == o or o in m.parents:
        raise CloverError("export", f"--out {out} would replace the model folder {model_dir}",
                          "choose an output folder outside the checkpoint")
    if m in o.parents:
        raise CloverError("export", f"--out {out} lies inside the model folder {model_dir}",
                          "choose an output folder outside the checkpoint")


def _match_parameters(params: dict, plans: dict, cfg: CloverConfig) -> None:
    """Every graph parameter has a planned tensor of the same shape (or is a zero-filled Clover tensor)."""
    zero_ok = set(names.clover_tensor_names(cfg))
    missing = [n for n in params if n not in plans and n not in zero_ok]
    shapes = [f"{n}: graph {list(params[n][0])}, checkpoint {list(plans[n].shape)}"
              for n in params if n in plans and tuple(plans[n].shape) != params[n][0]]
    if missing or shapes:
        raise CloverError("export", "graph parameters and checkpoint tensors disagree:\n  - "
                          + "\n  - ".join([f"no tensor for {m}" for m in missing] + shapes))


def _manifest(cfg, model_dir, dtype, N, chunk, max_batch, slots, max_len, traced, report: WeightReport) -> dict:
    profs = profiles(N, chunk, max_batch, slots, max_len)
    for p in profs:
        p["shapes"] = profile_shapes(traced.inputs, p)
    return {
        "format": A.FORMAT,
        "format_version": A.FORMAT_VERSION,
        "graph": A.GRAPH,
        "weight_map": A.WEIGHT_MAP,
        "model_dir": str(model_dir.resolve()),
        "config": cfg.to_dict(),
        "config_fingerprint": cfg.fingerprint(),
        "dtype": dtype,
        "block_size": N,
        "chunk": chunk,
        "opset": OPSET,
        "ir_version": IR_VERSION,
        "inputs": traced.inputs,
        "outputs": traced.outputs,
        "dynamic_dims": {
            BATCH: "batch rows of the step",
            STEP_LEN: f"T = C + {N}: C causal rows (C >= 0) then {N} block rows",
            SLOTS: "cache slots in each pool",
            POOL_LEN: "max cached positions per slot (attention pools)",
        },
        "profiles": profs,
        "ops": contracts.manifest_entry(),
        "weights": report.to_dict(),
        "tools": tool_versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
