"""Validation that scales: a slice of the model at full width.

Whole-graph validation runs the fp32 step graph in ONNX Runtime next to the
fp32 reference model: ~5x the bf16 weights in RAM, ~330 GB for the 35B
model. The slice is the model cut down to the first decoder layer of each
kind (GDN, attention), in model order, with the embedding, final norm and
lm_head, every tensor the real one at full width. It is exported by the same
code as the whole graph (`export(..., config=, tensor_plans=)`, weights
referenced in place -- `map`: ONNX Runtime gets the shards' memory-mapped
bytes -- and cast in the graph; its config is the whole export's traced
prototype, so after an fp32 export in the same process `trace.py` reuses
that trace), then played in
ONNX Runtime (CPU, graph optimisations off, so the in-graph casts are not
folded into resident fp32 copies; the graph as `lean_casts` rewrites it, so
no cast is of a whole embedding or expert tensor) and, after that session is
gone, by the reference model built from the same checkpoint tensors; the
scenario, runners and fp32 tolerances are whole-graph validation's
(`scenario.py`, `runners.py`, `compare.py`). The slice's layers are
resident at a time (~3.3 GiB of bf16 at full size, most of it experts),
read past the page cache (`direct_io.read_plan`); the reference keeps the
embedding as stored, and hands it and its fp32 lm_head to whoever asks
(`keep`: the build's streamed calibration, which comes next).

One slice of all kinds, not one per kind: the embedding, lm_head (the
largest GEMM of the scenario: ~0.33 TFLOP over its 320 block rows, run by both
sides) and the trace are paid once. A wrong layer still shows: the report
names each slice layer's model layer, and its `present.*` states are
compared one by one.

`whole_validation_bytes` is the estimate `build` compares with the machine's
memory to pick whole-graph or slice validation.
"""

from __future__ import annotations

import gc
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from clover_export.backends.torch_backend import TorchBackend
from clover_export.core import names
from clover_export.core.checkpoint import TORCH_DTYPES, TensorPlan, locate_tensors, plan_tensors
from clover_export.core.config import CloverConfig, config_from_dict
from clover_export.verify.compare import ValidationReport, compare, fp32_tolerance
from clover_export.verify.runners import OrtRunner, TorchRunner
from clover_export.verify.scenario import NUM_SLOTS, initial_pools, make_feeds, play, pool_len, scenario

KINDS = ("linear_attention", "full_attention")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def whole_validation_bytes(cfg: CloverConfig) -> int:
    """RAM of whole-graph validation: ONNX Runtime's fp32 graph (bf16 + fp32 weights) + the fp32 reference."""
    from clover_export.model.sizing import weight_bytes

    return 5 * weight_bytes(cfg, "bf16")


def available_memory() -> int:
    """MemAvailable of this machine (bytes); monkeypatched in tests."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def slice_layers(cfg: CloverConfig) -> list[int]:
    """The first layer of each kind the model has, in model order."""
    return sorted(cfg.layer_types.index(k) for k in KINDS if k in cfg.layer_types)


def slice_config(cfg: CloverConfig, layers: list[int]) -> CloverConfig:
    d = cfg.to_dict()
    d.update(num_hidden_layers=len(layers), layer_types=[cfg.layer_types[i] for i in layers])
    return config_from_dict(d, source=f"{cfg.source} (slice: layers {', '.join(map(str, layers))})")


def slice_plans(plans: dict[str, TensorPlan], layers: list[int]) -> dict[str, TensorPlan]:
    """The checkpoint plans of model layer `layers[j]` renamed to layer j, plus every non-layer tensor."""
    index = {layer: j for j, layer in enumerate(layers)}
    out = {}
    for name, plan in plans.items():
        m = _LAYER.match(name)
        if m is None:
            out[name] = plan
        elif int(m.group(1)) in index:
            new = f"model.layers.{index[int(m.group(1))]}.{name[m.end():]}"
            out[new] = TensorPlan(new, plan.shape, plan.parts, plan.fused)
    return out


def graph_plans(plans: dict[str, TensorPlan], layers: list[int]) -> dict[str, TensorPlan]:
    """The tensors the slice GRAPH is exported with (tests swap this to plant a wrong layer)."""
    return slice_plans(plans, layers)


@dataclass
class SliceResult:
    layers: list[int]  # model layers, in slice order
    kinds: list[str]
    passed: bool
    report: str
    seconds: float

    def line(self) -> str:
        which = ", ".join(f"{layer} ({kind})" for layer, kind in zip(self.layers, self.kinds))
        return (f"slice of layers {which} + embedding, norm, lm_head at full width: "
                f"{'PASS' if self.passed else 'FAIL'} in {self.seconds:.1f} s")


def validate_slices(model_dir: Path, work: Path, block_size: int, chunk: int, max_batch: int,
                    keep: dict[str, torch.Tensor] | None = None) -> SliceResult:
    """Export and validate the slice (module docstring) under WORK (removed afterwards). keep: filled with
    the reference's fp32 lm_head and its embedding table as stored, for a streamed reference model that
    comes next (`stream_calib.streamed_model(preloaded=)`: 3 GiB not read, cast and paged in again)."""
    import time

    from clover_export.core.config import load_config
    from clover_export.exporter.export import export

    cfg = load_config(model_dir)
    plans = plan_tensors(cfg, locate_tensors(model_dir), allow_qwen=True)
    layers = slice_layers(cfg)
    t = time.perf_counter()
    scfg = slice_config(cfg, layers)
    folder = work / "slice"
    try:
        export(model_dir, folder, dtype="fp32", weights="map", block_size=block_size, chunk=chunk,
               max_batch=max_batch, max_len=max(64, 2 * block_size + 16), config=scfg,
               tensor_plans=graph_plans(plans, layers))
        passed, text = _play_and_compare(folder, scfg, slice_plans(plans, layers), layers, keep)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return SliceResult(layers, [cfg.layer_types[i] for i in layers], passed, text, time.perf_counter() - t)


def _play_and_compare(folder: Path, scfg: CloverConfig, plans: dict[str, TensorPlan],
                      layers: list[int], keep: dict | None = None) -> tuple[bool, str]:
    """The scenario (draw 0) on ONNX Runtime, then on the reference slice; never both resident."""
    import onnxruntime as ort

    from clover_export.artifact.manifest import load_artifact

    art = load_artifact(folder)
    steps = scenario(art.block_size, art.chunk)
    feeds = make_feeds(steps, art.config, art.block_size, seed=0)
    pools = initial_pools(art, NUM_SLOTS, pool_len(steps, art.block_size), seed=1)
    so = ort.SessionOptions()
    # no folded fp32 weight copies (folding them also took longer than it saved: 29 s to build the session).
    # The arena stays on: the graph's casts are per expert and per gathered row (lean_casts), and without
    # it each fresh buffer costs its page faults again (5 steps: 71 s without, 23 s with, at full width).
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # no spin-waiting between ops: the build runs the bf16 export and the FP8 file writer beside this session
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    fed = _fed_weights(plans)
    runner = OrtRunner.load(art, session_options=so,
                            fed_weights={n: (t.onnx_type, list(t.value.shape)) for n, t in fed.items()})
    weights = {n: t.value for n, t in fed.items()}  # bound in place, step after step
    got = play(runner, [{**f, **weights} for f in feeds], pools)
    ort_name = runner.name
    del runner, weights
    _release_memory()
    ref = TorchRunner(TorchBackend(reference_slice(scfg, plans, art, {t.param: t.value for t in fed.values()}),
                                   in_place=False), art.output_names)
    del fed
    expected = play(ref, feeds, pools)
    if keep is not None:  # not per layer: the same tensors in the whole model
        keep.update((n, p.detach()) for n, p in ref.backend.model.named_parameters()
                    if n in (names.EMBED, names.LM_HEAD))
    del ref
    _release_memory()
    rep = ValidationReport(steps=[p.name for p in steps], runners=[ort_name])
    rep.errors = compare(ort_name, got, expected, fp32_tolerance)
    rep.notes.append("slice layer -> model layer: " + ", ".join(
        f"{j} -> {layer} ({kind})" for j, (layer, kind) in enumerate(zip(layers, scfg.layer_types))))
    return rep.passed, rep.format()


@dataclass
class _Fed:
    """A weight prepared once and fed to every ONNX Runtime run of the slice (lean_casts.feed_weights)."""

    param: str  # the model parameter (the reference reuses the tensor)
    value: torch.Tensor
    onnx_type: int


def _fed_weights(plans: dict[str, TensorPlan]) -> dict[str, _Fed]:
    """Graph value -> weight fed instead of computed by every step: the lm_head in fp32 (a 2 GiB cast per step
    otherwise) and per-expert experts fused once in bf16 (a 2.4 GiB Concat per step, and their mapped pages)."""
    from onnx import TensorProto

    from clover_export.core.direct_io import DirectReader, read_plan
    from clover_export.exporter.weights import stored_name

    reader, out = DirectReader(), {}  # past the page cache: each GiB of it costs as much again in page faults
    head = plans.get(names.LM_HEAD)
    if head is not None and head.parts[0][0].dtype != "F32":  # the fp32 graph casts it
        out[names.LM_HEAD] = _Fed(names.LM_HEAD, read_plan(reader, head, torch.float32), TensorProto.FLOAT)
    for name, plan in plans.items():
        if ".mlp.experts." in name and not plan.fused and {loc.dtype for g in plan.parts for loc in g} == {"BF16"}:
            out[stored_name(name, "BF16")] = _Fed(name, read_plan(reader, plan), TensorProto.BFLOAT16)
    return out


def _release_memory() -> None:
    """Collect, then hand freed heap pages back to the OS (glibc may keep ONNX Runtime's freed buffers
    resident otherwise, under the reference run's own ~7 GiB at full size)."""
    import ctypes

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def reference_slice(scfg: CloverConfig, plans: dict[str, TensorPlan], art, preloaded=None):
    """The fp32 reference model of the slice, its weights read from the checkpoint tensors (`preloaded`:
    parameter -> tensor already read, `_fed_weights`' tensors shared with the ONNX Runtime run)."""
    from dataclasses import replace

    from clover_export.core.direct_io import DirectReader, empty, plan_targets, read_into
    from clover_export.model.loading import build_model
    from clover_export.quantize.stream_calib import (
        embedding_as_stored,
        reference_dtype,
        reference_weight,
        routed_moe_core,
    )

    model = build_model(scfg, torch.float32, device="meta", block_size=art.block_size)
    pre = preloaded or {}
    state, targets = {}, {}
    for n, p in model.named_parameters():
        if n in pre:
            state[n] = pre[n]
        elif n not in plans:  # opted-in Qwen: zero-filled
            state[n] = reference_weight(n, torch.zeros(p.shape), torch.float32)
        else:  # read in file order past the page cache, cast on the way (`read_into`)
            dtype = reference_dtype(n, TORCH_DTYPES[plans[n].parts[0][0].dtype], torch.float32)
            state[n] = empty(plans[n].shape, dtype)
            targets.update(plan_targets(plans[n], state[n]))
    read_into(DirectReader(), targets)
    model.load_state_dict(state, strict=True, assign=True)
    embedding_as_stored(model, torch.float32)
    # the dense reference core runs all 256 experts on every row; the routed one equals it (tested in fp64)
    model.cores = replace(model.cores, moe=routed_moe_core)
    return model.eval().requires_grad_(False)
