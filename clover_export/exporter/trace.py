"""Trace one step of the reference model to ONNX on the meta device (STEP_GRAPH.md 1-2).

The model is built with `build_model(cfg, dtype, device="meta")`: no weight
is read or allocated. Its cores are swapped for the `clover::*` custom ops,
which export as opaque nodes (`onnx_ops.translation_table`); the graph keeps
referencing parameters by their checkpoint names, and gets no initializers
here (`weights.py` adds them as external data). Only one layer of each kind
is traced; `replicate.py` stamps out the rest (tracing costs ~0.7 s CPU per
layer). The model-local functions are attached afterwards, and the opset /
IR version pinned.
"""

from __future__ import annotations

import copy
import logging
import warnings
from dataclasses import dataclass

import onnx
import torch

from clover_export.artifact.manifest import BATCH, LOGIT_ROWS, POOL_LEN, SLOTS, STEP_LEN
from clover_export.core import names
from clover_export.core.config import CloverConfig
from clover_export.core.errors import CloverError

OPSET = 20
IR_VERSION = 9
_EXAMPLE = {BATCH: 2, SLOTS: 3, POOL_LEN: 64, LOGIT_ROWS: 4}  # distinct sizes, so no two dims get unified by accident
_ONNX_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int32: "int32"}


@dataclass
class TracedGraph:
    model: onnx.ModelProto  # no initializers; parameters referenced by canonical name
    parameters: dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (shape, dtype) the graph expects
    inputs: list[dict]  # {"name", "shape", "dtype"} in graph order; shapes use the dim names above
    outputs: list[dict]


def io_specs(cfg: CloverConfig, block_size: int, dtype: torch.dtype) -> tuple[list[dict], list[dict]]:
    """Graph inputs / outputs with symbolic shapes (the manifest's record; names from `names.py`)."""
    from clover_export.model.model import pool_dtype, pool_shape

    def spec(name, shape, dt):
        return {"name": name, "shape": list(shape), "dtype": _ONNX_DTYPE[dt]}

    ins = [spec(names.INPUT_IDS, (BATCH, STEP_LEN), torch.int32)]
    ins += [spec(n, (BATCH,), torch.int32) for n in names.STEP_SCALARS[1:]]
    ins += [spec(names.LOGIT_ROWS, (BATCH, LOGIT_ROWS), torch.int32)]
    pools = [spec(n, pool_shape(cfg, n, SLOTS, POOL_LEN), pool_dtype(n, dtype)) for n in names.pool_names(cfg)]
    outs = [spec(names.LOGITS, (BATCH, block_size, cfg.vocab_size), torch.float32),
            spec(names.CORESET_SIZE, (BATCH, cfg.num_hidden_layers), torch.int32)]
    outs += [dict(p, name=names.present_name(p["name"])) for p in pools]
    outs += [spec(names.CAUSAL_LOGITS, (BATCH, LOGIT_ROWS, cfg.vocab_size), torch.float32)]
    return ins + pools, outs


def _example_inputs(cfg, block_size, dtype):
    from clover_export.model.model import allocate_pools

    B, S, L = _EXAMPLE[BATCH], _EXAMPLE[SLOTS], _EXAMPLE[POOL_LEN]
    T = block_size + 5
    with torch.device("meta"):
        ids = torch.zeros(B, T, dtype=torch.int32)
        scalars = tuple(torch.zeros(B, dtype=torch.int32) for _ in names.STEP_SCALARS[1:])
        rows = torch.zeros(B, _EXAMPLE[LOGIT_ROWS], dtype=torch.int32)
    pools = tuple(allocate_pools(cfg, S, L, dtype=dtype, device="meta").values())
    return (ids, *scalars, rows, *pools)


def _dynamic_shapes(cfg, block_size):
    from torch.export import Dim

    b, t = Dim(BATCH), Dim(STEP_LEN, min=block_size)
    s, l_, r = Dim(SLOTS), Dim(POOL_LEN), Dim(LOGIT_ROWS, min=1)
    pools = tuple({0: s, 2: l_} if n.endswith((".key", ".value")) else {0: s} for n in names.pool_names(cfg))
    return ({0: b, 1: t}, *({0: b} for _ in names.STEP_SCALARS[1:]), {0: b, 1: r}, pools)


_CACHE: dict[tuple, TracedGraph] = {}
_TRACES: dict[tuple, bytes] = {}  # torch.onnx traces by (config, dtype, block size): a prototype is a model too


def trace_step(cfg: CloverConfig, dtype: torch.dtype, block_size: int, replicate: bool = True) -> TracedGraph:
    """Export one step graph of `cfg` (no weights touched); repeated calls in a process reuse the trace.

    replicate: trace one layer of each kind and stamp out the rest (`replicate.py`); False traces every layer.
    """
    key = (cfg.fingerprint(), dtype, block_size, replicate)
    if key not in _CACHE:
        _CACHE[key] = _trace(cfg, dtype, block_size, replicate)
    return copy.deepcopy(_CACHE[key])


def _trace(cfg: CloverConfig, dtype: torch.dtype, block_size: int, replicate: bool) -> TracedGraph:
    from clover_export.exporter.replicate import ReplicationError, prototype_kinds
    from clover_export.exporter.replicate import replicate as stamp_out
    from clover_export.model.loading import build_model
    from clover_export.plugins.onnx_ops import function_protos

    params = {n: (tuple(p.shape), dtype) for n, p in build_model(cfg, dtype, device="meta").named_parameters()}
    kinds = prototype_kinds(cfg)
    proto = None
    if replicate and len(kinds) < cfg.num_hidden_layers:
        try:
            proto_cfg = cfg.replace(num_hidden_layers=len(kinds), layer_types=kinds)
            proto = stamp_out(_export(proto_cfg, dtype, block_size), kinds, cfg)
        except ReplicationError as e:
            warnings.warn(f"layer replication failed ({e}); tracing all {cfg.num_hidden_layers} layers", stacklevel=2)
    if proto is None:
        proto = _export(cfg, dtype, block_size)
    proto.ir_version = IR_VERSION
    proto.functions.extend(function_protos())
    ins, outs = io_specs(cfg, block_size, dtype)
    _name_dims(proto, ins + outs)
    return TracedGraph(proto, params, ins, outs)


def _export(cfg: CloverConfig, dtype: torch.dtype, block_size: int) -> onnx.ModelProto:
    """torch.onnx.export of cfg's model on the meta device, custom ops opaque, weights left out.

    Repeated calls in a process reuse the trace: the whole graph's prototype [GDN, attention] is also the
    config of the validation slice (`slice.py`; ~10 s of CPU a trace at full width), so validating slices
    after exporting the whole fp32 graph in one process traces once."""
    key = (cfg.fingerprint(), dtype, block_size)
    if key not in _TRACES:
        _TRACES[key] = _torch_export(cfg, dtype, block_size).SerializeToString()
    return onnx.load_from_string(_TRACES[key])


def _torch_export(cfg: CloverConfig, dtype: torch.dtype, block_size: int) -> onnx.ModelProto:
    import onnx_ir as ir

    from clover_export.model.loading import build_model
    from clover_export.plugins.onnx_ops import translation_table
    from clover_export.plugins.torch_ops import export_cores

    model = build_model(cfg, dtype, device="meta", block_size=block_size).eval()
    model.cores = export_cores()
    params = {n for n, _ in model.named_parameters()}
    ins, outs = io_specs(cfg, block_size, dtype)
    with warnings.catch_warnings(), _quiet_torch_onnx():
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(
                model, _example_inputs(cfg, block_size, dtype), dynamo=True, optimize=False,
                opset_version=OPSET, dynamic_shapes=_dynamic_shapes(cfg, block_size),
                custom_translation_table=translation_table(),
                input_names=[s["name"] for s in ins], output_names=[s["name"] for s in outs],
                verbose=False, report=False,
            )
        except Exception as e:  # torch.onnx wraps everything in its own error types
            raise CloverError("export", f"tracing the step graph failed: {type(e).__name__}: {str(e).splitlines()[0]}",
                              "this is a bug in the exporter or the model code, not in the checkpoint") from e
    inits = program.model.graph.initializers
    for name in [n for n in inits if n in params]:  # meta tensors: attached as external data later
        inits[name].const_value = None
        del inits[name]
    stray = [n for n, v in inits.items() if v.const_value is None or v.const_value.device.type == "meta"]
    if stray:
        raise CloverError("export", f"graph constants without values: {stray[:5]}", "an exporter bug")
    _fold_constants(program.model)
    return ir.to_proto(program.model)


def _fold_constants(model) -> None:
    """Fold the constant-only chains `optimize=False` leaves (e.g. Reshape of a constant `axes`): TensorRT
    wants such inputs as build-time constants. Weights have no values here, so nothing touching them folds."""
    import onnx_ir.passes.common as passes
    from onnxscript.optimizer import fold_constants

    fold_constants(model)
    passes.RemoveUnusedNodesPass()(model)


def _name_dims(proto: onnx.ModelProto, specs: list[dict]) -> None:
    """Give every graph input / output the manifest's dimension names (torch names them s0, s1, ...)."""
    by_name = {s["name"]: s["shape"] for s in specs}
    for vi in list(proto.graph.input) + list(proto.graph.output):
        shape = by_name[vi.name]
        dims = vi.type.tensor_type.shape.dim
        if len(dims) != len(shape):
            raise CloverError("export", f"graph {vi.name} has rank {len(dims)}, manifest says {len(shape)}")
        for d, want in zip(dims, shape):
            if isinstance(want, str):
                d.Clear()
                d.dim_param = want
            elif d.HasField("dim_value") and d.dim_value != want:
                raise CloverError("export", f"graph {vi.name} has size {d.dim_value} where {want} is expected")


class _quiet_torch_onnx:
    """torch.onnx logs a few harmless warnings per export (torchvision absent, axis names)."""

    def __enter__(self):
        self._loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._export")]
        self._levels = [lg.level for lg in self._loggers]
        for lg in self._loggers:
            lg.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        for lg, lvl in zip(self._loggers, self._levels):
            lg.setLevel(lvl)
