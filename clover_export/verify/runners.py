"""Runners: numpy feeds (step inputs and pools) in, every output by name out (Polygraphy's runners).

The torch and ONNX Runtime runners are adapters over the runtime's backends
(`backends/torch_backend.py`, `backends/ort_backend.py`): the same code runs a
step for the runtime and for validation. What validation adds: numpy at the
edges (bf16 as `ml_dtypes.bfloat16`), every output kept (the `present.*`
pools too, in fresh buffers, so each step's results outlive the next step),
and the reference model run functionally (`TorchBackend(in_place=False)`:
the semantics the graph is exported from, with the given pools left as they
are). `onnx.reference` is no backend; `ReferenceEvaluatorRunner` runs the
graph there.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from clover_export.artifact.manifest import Artifact
from clover_export.backends.ort_backend import OrtBackend
from clover_export.backends.torch_backend import TorchBackend
from clover_export.core import names
from clover_export.core.errors import CloverError

REFERENCE = "reference-torch"  # the runner every other one is compared with
REFERENCE_EVALUATOR = "onnx-reference"


def to_torch(a) -> torch.Tensor:
    """A numpy array (bf16 as `ml_dtypes.bfloat16`) as a torch tensor, sharing its memory where the array is
    contiguous and writable (a read-only array, e.g. a memory-mapped weight, is copied); a tensor as is."""
    if isinstance(a, torch.Tensor):
        return a
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
    a = np.ascontiguousarray(a)
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as numpy (bf16 as `ml_dtypes.bfloat16`), sharing its memory."""
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.contiguous().view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _split(feeds: dict, pool_names: list[str], device: torch.device) -> tuple[dict, dict]:
    """(step inputs, pools) of the feeds as torch tensors on `device`."""
    tensors = {n: to_torch(v).to(device) for n, v in feeds.items()}
    return ({n: t for n, t in tensors.items() if n not in pool_names},
            {n: tensors[n] for n in pool_names})


class TorchRunner:
    """The reference model through the torch backend, run functionally (module docstring)."""

    def __init__(self, backend: TorchBackend, outputs: list[str], name: str = REFERENCE):
        if backend.in_place:
            raise ValueError("validation runs the reference model functionally: TorchBackend(in_place=False)")
        self.backend, self.outputs, self.name = backend, outputs, name

    @classmethod
    def load(cls, art: Artifact, dtype: torch.dtype, cores_in_fp32: bool = False) -> TorchRunner:
        """The model the graph was exported from, in `dtype`; `cores_in_fp32`: its cores compute in fp32 on the
        model-dtype inputs (`fp32_cores`)."""
        from clover_export.model.loading import load_model

        model_dir = art.model_dir
        if not model_dir.exists():
            raise CloverError("validate", f"{model_dir}: the model folder the graph was exported from is gone",
                              "validate needs the reference model; export again from an existing folder")
        model = load_model(model_dir, dtype=dtype, block_size=art.block_size, allow_qwen=True)
        if cores_in_fp32:
            model.cores = fp32_cores(model.cores)
        return cls(TorchBackend(model, model_dir, in_place=False), art.output_names,
                   f"{REFERENCE}-fp32-cores" if cores_in_fp32 else REFERENCE)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        be = self.backend
        inputs, pools = _split(feeds, names.pool_names(be.cfg), be.device)
        res = be.step(inputs, pools)
        logits, coreset, present = res
        out = {names.LOGITS: logits, names.CORESET_SIZE: coreset,
               **{names.present_name(p): t for p, t in present.items()}, names.CAUSAL_LOGITS: res.causal_logits}
        return {n: to_numpy(out[n].cpu()) for n in self.outputs}


def fp32_cores(cores):
    """`Cores` computing in fp32 on their inputs, each output cast back as its op contract says (`like:<input>`):
    the precision policy of the graph's function bodies (`plugins/onnx_bodies.py`), which the plain cores
    follow only in part (they keep the conv, SiLU, beta and the experts in the model dtype)."""
    from dataclasses import replace

    from clover_export.model.model import OP_CORES
    from clover_export.plugins.contracts import CONTRACTS, output_dtype_source

    by_reference = {c.reference: c for c in CONTRACTS.values()}

    def upcast(fn):
        contract = by_reference[f"{fn.__module__}:{fn.__name__}"]
        inputs = [s.name for s in contract.inputs]

        def core(*args):
            out = fn(*(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args))
            like = [output_dtype_source(s) for s in contract.outputs]
            return tuple(o.to(args[inputs.index(src)].dtype) if src else o for o, src in zip(out, like))

        return core

    return replace(cores, **{name: upcast(getattr(cores, name)) for name in OP_CORES})


class OrtRunner:
    """The graph in ONNX Runtime through the ort backend; named after the execution provider."""

    def __init__(self, backend: OrtBackend, name: str | None = None):
        self.backend, self.outputs = backend, backend.art.output_names
        self.name = name or f"onnxruntime-{backend.device.type}"

    @classmethod
    def load(cls, art: Artifact, provider: str = "CPUExecutionProvider", **session) -> OrtRunner:
        """`session`: `ort_session`'s session_options and fed_weights."""
        from clover_export.exporter.session import ort_session

        return cls(OrtBackend(art, ort_session(art, providers=[provider], **session)))

    def run(self, feeds: dict) -> dict[str, np.ndarray]:
        """`feeds`: numpy arrays, or torch tensors on the backend's device (weights fed to every step)."""
        be = self.backend
        inputs, pools = _split(feeds, be.art.pool_names, be.device)
        present = {n: torch.empty_like(t) for n, t in pools.items()}  # fresh: earlier results stay as they were
        logits, coreset, causal = be.step_into(inputs, pools, present)
        out = {names.LOGITS: logits.cpu().clone(), names.CORESET_SIZE: coreset.cpu().clone(),
               **{names.present_name(p): t.cpu() for p, t in present.items()},
               names.CAUSAL_LOGITS: causal.cpu().clone()}
        return {n: to_numpy(out[n]) for n in self.outputs}


class ReferenceEvaluatorRunner:
    """The graph in `onnx.reference` (slow; runs bf16 graphs, which ONNX Runtime's CPU EP cannot)."""

    name = REFERENCE_EVALUATOR

    def __init__(self, art: Artifact):
        import onnx
        from onnx.reference import ReferenceEvaluator

        proto = onnx.load(str(art.graph_path), load_external_data=False)
        load_weights(proto, art)
        self.evaluator = ReferenceEvaluator(proto)
        self.outputs = art.output_names

    def run(self, feeds):
        return dict(zip(self.outputs, self.evaluator.run(self.outputs, feeds)))


def load_weights(proto, art: Artifact) -> None:
    """Fill the proto's external initializers from the weight map (any mode), for onnx.reference."""
    from onnx import numpy_helper

    from clover_export.artifact.manifest import read_weight_map
    from clover_export.exporter.weights import storage_dtype

    wmap = read_weight_map(art)
    for i, t in enumerate(proto.graph.initializer):
        if t.data_location != t.EXTERNAL:
            continue
        e = wmap[t.name]
        path = Path(e["file"]) if Path(e["file"]).is_absolute() else art.dir / e["file"]
        raw = np.fromfile(path, dtype=storage_dtype(e["dtype"]), count=int(np.prod(e["shape"])), offset=e["offset"])
        if e["dtype"] == "BF16":
            import ml_dtypes

            raw = raw.view(ml_dtypes.bfloat16)
        proto.graph.initializer[i].CopyFrom(numpy_helper.from_array(raw.reshape(e["shape"]), t.name))
