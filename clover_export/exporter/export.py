"""`clover-export export`: one step graph + manifest + weights, written atomically (STEP_GRAPH.md 1-3).

Order: config and checkpoint headers are checked first (no weight byte read),
the step graph is traced on the meta device, the weights are attached as
external data per the chosen mode (`weights.py`; how they were placed --
reflink, copy, hard link, mapped -- is in the manifest and decides which
tools read the folder: docs/exports.md), the folder is checked (`check.py`) and
only then moved into place (`writer.ArtifactWriter`). Any failure removes
the temporary folder: an existing export at OUT stays as it was.
"""

from __future__ import annotations

import logging
import platform
import time
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

import onnx

from clover_export.artifact import manifest as A
from clover_export.core import names
from clover_export.core.checkpoint import locate_tensors, plan_tensors
from clover_export.core.config import CloverConfig, load_config
from clover_export.core.errors import CloverError
from clover_export.core.step_shape import MAX_BATCH, PREFILL_CHUNK
from clover_export.exporter.check import check_folder
from clover_export.exporter.onnx_graph import node_reads
from clover_export.exporter.trace import BATCH, IR_VERSION, LOGIT_ROWS, OPSET, POOL_LEN, SLOTS, STEP_LEN, trace_step
from clover_export.exporter.weights import WeightReport, WeightWriter, shard_bytes
from clover_export.exporter.writer import ArtifactWriter
from clover_export.model.loading import parse_dtype, resolve_model_dir
from clover_export.plugins import contracts

log = logging.getLogger(__name__)


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
    with the first block). Pools are allocated once: slots and pool_len are fixed. `logit_rows` R (the causal
    rows whose next-token logits a step returns) is 1 to block_size in both."""

    def profile(name: str, c: int, batch_opt: int) -> dict:
        return {
            "name": name, "causal_rows": c, "block_rows": block_size,
            "dims": {BATCH: [1, batch_opt, max_batch], STEP_LEN: [block_size, c + block_size, c + block_size],
                     SLOTS: [slots] * 3, POOL_LEN: [max_len] * 3, LOGIT_ROWS: [1, 1, block_size]},
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


@dataclass(frozen=True)
class ExportOptions:
    """What `export` makes: the `clover-export export` options (defaults: `core.step_shape`). None: from the
    model's config (block_size: its block size; max_len: its max_context) or from max_batch (slots)."""

    dtype: str = "bf16"  # the graph's model dtype: "bf16" | "fp32"
    weights: str = "link"  # how the weights are placed: `artifact.manifest.WEIGHT_MODES`
    block_size: int | None = None
    chunk: int = PREFILL_CHUNK  # causal rows of the prefill profile
    max_batch: int = MAX_BATCH  # largest batch of the profiles
    slots: int | None = None  # cache slots per pool
    max_len: int | None = None  # pool length L
    allow_qwen: bool = False  # a plain Qwen3.5-MoE checkpoint, its block-mixer tensors zero-filled
    force: bool = False  # replace an earlier export at OUT


def export(model: str | Path | None, out: str | Path, options: ExportOptions | None = None, *,
           config: CloverConfig | None = None, tensor_plans: dict | None = None, **fields) -> ExportResult:
    """Export MODEL's step graph into OUT (see the module docstring); returns what was done.

    `options`, with any of its fields given by keyword instead (`export(model, out, dtype="fp32")`).
    OUT follows `clover_export.artifact.outdir`: a new or empty folder, or (with `force`) an earlier export.
    `config` + `tensor_plans` replace the folder's config and checkpoint plan (a slice of the model:
    `verify/slice.py`); the manifest still names MODEL's folder."""
    t0 = time.perf_counter()
    o = replace(options or ExportOptions(), **fields)
    if o.weights not in A.WEIGHT_MODES:
        raise CloverError("export", f"unknown weights mode {o.weights!r}",
                          f"expected one of {', '.join(A.WEIGHT_MODES)}")
    torch_dtype = parse_dtype(o.dtype)
    model_dir = resolve_model_dir(model)
    cfg = load_config(model_dir) if config is None else config
    o = _resolved(o, cfg)
    out = Path(out).absolute()
    _refuse_overlap(model_dir, out)
    dest = ArtifactWriter(out, "export", command="export", what="the export", force=o.force, model_dirs=[model_dir])
    plans = tensor_plans if tensor_plans is not None else \
        plan_tensors(cfg, locate_tensors(model_dir), allow_qwen=o.allow_qwen)  # every problem, before any work
    log.info(f"model: {model_dir} ({cfg.model_type}, {cfg.num_hidden_layers} layers), graph dtype {o.dtype}, "
             f"block {o.block_size}")
    t = time.perf_counter()
    traced = trace_step(cfg, torch_dtype, o.block_size)
    log.info(f"traced on the meta device in {time.perf_counter() - t:.1f} s")
    _match_parameters(traced.parameters, plans, cfg)

    with dest:
        proto, placed = _attach_weights(dest.dir, traced, plans, o.weights, torch_dtype)
        manifest = _manifest(cfg, model_dir, o, traced, placed.report)
        engine_bound = o.dtype != "fp32" and placed.report.mode != "map"  # map mode cannot reach TensorRT
        written = placed.report.weight_bytes_written + dest.write(
            proto, manifest, {"mode": placed.report.mode, "tensors": placed.weight_map}, companions_from=model_dir,
            tensorrt_pool_len=o.max_len if engine_bound else None)
        report = check_folder(dest.dir, proto=proto, tensorrt=placed.report.mode != "map")
        if report.failures:
            raise CloverError("check", f"the exported graph fails {len(report.failures)} readiness check(s):\n"
                              + report.format(only_failures=True),
                              "nothing was written; this is an exporter bug worth reporting")
        dest.commit()
    return ExportResult(out, placed.report, time.perf_counter() - t0, written, len(report.failures))


def _resolved(o: ExportOptions, cfg: CloverConfig) -> ExportOptions:
    """`o`'s None fields filled in from the config (`ExportOptions`), the sizes checked."""
    o = replace(o, block_size=cfg.block_size if o.block_size is None else o.block_size,
                slots=o.max_batch if o.slots is None else o.slots,
                max_len=cfg.max_context if o.max_len is None else o.max_len)
    for name, v in (("--block-size", o.block_size), ("--chunk", o.chunk), ("--max-batch", o.max_batch),
                    ("--slots", o.slots), ("--max-len", o.max_len)):
        if not isinstance(v, int) or v <= 0:
            raise CloverError("export", f"{name} must be a positive integer, got {v!r}")
    if o.slots < o.max_batch:
        raise CloverError("export", f"--slots ({o.slots}) is below --max-batch ({o.max_batch})",
                          "each batch row owns one slot")
    return o


def _attach_weights(folder: Path, traced, plans: dict, mode: str, torch_dtype) -> tuple[onnx.ModelProto, WeightWriter]:
    """The traced graph with its weights as external data placed in `folder` per `mode` (`weights.py`), each
    weight node (cast, expert Concat + Reshape) right before its first reader; returns it and the writer."""
    used = [plans[name] for name in traced.parameters if name in plans]
    writer = WeightWriter(folder, mode, torch_dtype, checkpoint_bytes=shard_bytes(used))
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
    return proto, writer


def weight_nodes_before_use(weight_nodes: list, nodes: list) -> list:
    """The weight nodes (casts of stored dtypes, per-expert Concat + Reshape) each placed right before the
    first node that reads them: ONNX Runtime follows the order, so a cast weight lives only while used
    (at full size an fp32 embedding or expert tensor is GBs)."""
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
        for i in node_reads(node):
            emit(i)
        out.append(node)
    out += [n for n in weight_nodes if id(n) not in done]
    return out


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


def _manifest(cfg: CloverConfig, model_dir: Path, o: ExportOptions, traced, report: WeightReport) -> A.Manifest:
    N = o.block_size
    profs = profiles(N, o.chunk, o.max_batch, o.slots, o.max_len)
    return A.Manifest(
        config=cfg,
        model_dir=str(model_dir.resolve()),
        dtype=o.dtype,
        block_size=N,
        chunk=o.chunk,
        inputs=tuple(map(A.IOSpec.from_json, traced.inputs)),
        outputs=tuple(map(A.IOSpec.from_json, traced.outputs)),
        profiles=tuple(A.Profile.from_json({**p, "shapes": profile_shapes(traced.inputs, p)}) for p in profs),
        weights=A.Weights.from_json(report.to_dict()),
        opset=OPSET,
        ir_version=IR_VERSION,
        ops=contracts.manifest_entry(),
        tools=tool_versions(),
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        dynamic_dims={
            BATCH: "batch rows of the step",
            STEP_LEN: f"T = C + {N}: C causal rows (C >= 0) then {N} block rows",
            SLOTS: "cache slots in each pool",
            POOL_LEN: "max cached positions per slot (attention pools)",
            LOGIT_ROWS: f"R: causal rows whose next-token logits the step returns (1 to {N})",
        },
    )
