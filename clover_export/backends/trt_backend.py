"""The `trt` backend: a TensorRT engine (10.x / 11.x Python API), caches aliased in place.

Deserialize the engine, then per step: `set_input_shape` for every input,
`set_tensor_address` bound to the torch tensors' `data_ptr()` (step inputs,
pools, and the `present.*` outputs bound to the same memory as their
`past_key_values.*` inputs, which the plugins declare as aliases), and
`execute_async_v3` on the current CUDA stream. No host copies. A step
returns `model.model.StepResult`, `causal_logits` [B, R, V] bound like the
logits (R: the rows of `logit_rows`, row 0 when the step gives none).

Engine location: a `.engine`/`.plan` file, or a folder with `manifest.json`
naming it (`Manifest.engine`, written by `build`) or holding exactly one such
file. Beside an artifact's manifest (`artifact.manifest.Manifest`) the config,
block size, dtype, context (the profiles' pool length) and tokenizer folder
come from it; beside none, from the folder's `config.json`. The clover::
plugins are registered by the engine loader (`engines.builder.load_engine`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from clover_export.artifact.manifest import GRAPH, MANIFEST, Artifact, Manifest
from clover_export.backends.base import StepShape
from clover_export.core import names
from clover_export.core.config import CloverConfig, load_config
from clover_export.core.errors import CloverError
from clover_export.engines.builder import import_tensorrt
from clover_export.model.model import StepResult, allocate_pools, with_logit_rows

RUNTIME_NOTE = "install TensorRT 10+ (pip install tensorrt) on a CUDA machine, or use --backend ort/torch"
ENGINE_SUFFIXES = (".engine", ".plan", ".trt")


@dataclass(frozen=True)
class EngineFolder:
    """What the trt backend takes from beside an engine (`read_engine_folder`), read without TensorRT."""

    plan: Path
    cfg: CloverConfig
    block_size: int
    max_context: int  # the profiles' pool length (at most the config's); the engine's pools cap it again
    source_dir: Path  # tokenizer and generation config
    bf16: bool  # the model dtype of the graph it was built from
    refit_graph: Path  # a weight-stripped plan is refit from this ONNX file
    stripped: bool


def read_engine_folder(path) -> EngineFolder:
    """The engine at PATH (module docstring) and what its artifact's manifest says about it; an engine beside
    no manifest takes the folder's config.json (bf16: the engine dtype `build` makes)."""
    plan, manifest = locate_engine(path)
    folder = plan.parent
    if manifest is None:
        cfg = load_config(folder)
        return EngineFolder(plan, cfg, cfg.block_size, cfg.max_context, folder, True, folder / GRAPH, False)
    built, cfg = manifest.engine, manifest.config
    return EngineFolder(plan, cfg, manifest.block_size, min(manifest.max_context, cfg.max_context),
                        Artifact(folder, manifest).source_dir(), manifest.dtype == "bf16",
                        folder / (built.graph if built else manifest.graph), built is not None and built.stripped)


def _manifest_beside(folder: Path) -> Manifest | None:
    return Manifest.load(folder, component="runtime") if (folder / MANIFEST).is_file() else None


def locate_engine(path) -> tuple[Path, Manifest | None]:
    """(engine file, the manifest of the artifact folder it lies in, or None)."""
    if path is None:
        raise CloverError("runtime", "the trt backend needs an engine file or folder")
    p = Path(path)
    if p.is_file():
        return p, _manifest_beside(p.parent)
    if not p.is_dir():
        raise CloverError("runtime", f"{p}: no such engine file or folder")
    manifest = _manifest_beside(p)
    if manifest is not None and manifest.engine is not None:
        return p / manifest.engine.file, manifest
    found = sorted(f for f in p.iterdir() if f.suffix in ENGINE_SUFFIXES)
    if len(found) != 1:
        raise CloverError(
            "runtime", f"{p}: expected one engine file ({', '.join(ENGINE_SUFFIXES)}), found {len(found)}"
        )
    return found[0], manifest


class TrtBackend:
    name = "trt"

    def __init__(self, src: EngineFolder):
        trt = import_tensorrt("runtime", RUNTIME_NOTE)
        if not torch.cuda.is_available():
            raise CloverError("runtime", "the trt backend needs a CUDA GPU; none is visible")
        self.trt = trt
        self.cfg, self.block_size, self.max_context = src.cfg, src.block_size, src.max_context
        self.source_dir = src.source_dir
        self.model_dtype = torch.bfloat16 if src.bf16 else torch.float32
        self.device = torch.device("cuda", torch.cuda.current_device())
        from clover_export.engines.builder import load_engine

        # one loader for build and runtime: registers the clover:: plugins, refits a weight-stripped plan
        self.engine = load_engine(src.plan, src.refit_graph, src.stripped)
        self.context = self.engine.create_execution_context()
        self.tensor_names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.input_dtypes = {n: self._torch_dtype(self.engine.get_tensor_dtype(n)) for n in self.tensor_names}
        # per profile: (min T, max T, max batch) of input_ids; pools take the profile's fixed shapes
        self.profiles = []
        for p in range(self.engine.num_optimization_profiles):
            lo, _, hi = self.engine.get_tensor_profile_shape(names.INPUT_IDS, p)
            self.profiles.append((lo[1], hi[1], hi[0]))
        N = self.block_size
        self.step_shapes = [StepShape(t_lo - N, t_hi - N, b_hi) for t_lo, t_hi, b_hi in self.profiles]
        self.active_profile = 0
        pool = names.pool_names(self.cfg)
        self.pool_shapes = {n: tuple(self.engine.get_tensor_profile_shape(n, 0)[2]) for n in pool}
        attn = next((n for n in pool if n.endswith(".key")), None)
        if attn is not None:
            self.max_context = min(self.max_context, self.pool_shapes[attn][2])

    @classmethod
    def load(cls, path=None, **_options) -> "TrtBackend":
        import_tensorrt("runtime", RUNTIME_NOTE)
        return cls(read_engine_folder(path))

    def _torch_dtype(self, dt) -> torch.dtype:
        trt = self.trt
        table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32,
                 trt.int64: torch.int64, trt.bool: torch.bool, trt.bfloat16: torch.bfloat16}
        return table[dt]

    def allocate_pools(self, num_slots: int, max_len: int) -> dict[str, torch.Tensor]:
        """The engine's fixed pool shapes (its profiles pin slots and pool length)."""
        any_pool = next(iter(self.pool_shapes.values()))
        slots = any_pool[0]
        if num_slots > slots or max_len > self.max_context:
            raise CloverError("runtime", f"the engine was built for {slots} slots x {self.max_context} positions; "
                                         f"{num_slots} x {max_len} asked", "lower max_slots / max_context")
        pools = allocate_pools(self.cfg, slots, self.max_context, dtype=self.model_dtype, device=self.device)
        for n, t in pools.items():
            if tuple(t.shape) != self.pool_shapes[n]:
                raise CloverError("runtime", f"engine input {n} has shape {self.pool_shapes[n]}, the config gives "
                                             f"{tuple(t.shape)}", "was the engine built from this model?")
        return pools

    def _select_profile(self, B: int, T: int, stream) -> None:
        for p, (t_lo, t_hi, b_hi) in enumerate(self.profiles):
            if t_lo <= T <= t_hi and B <= b_hi:
                if p != self.active_profile:
                    self.context.set_optimization_profile_async(p, stream)
                    self.active_profile = p
                return
        raise CloverError("runtime", f"no optimisation profile of the engine takes batch {B} x {T} rows")

    def step(self, inputs, pools) -> StepResult:
        ctx, keep = self.context, []
        stream = torch.cuda.current_stream().cuda_stream
        B = inputs[names.INPUT_IDS].shape[0]
        inputs = with_logit_rows(inputs)
        self._select_profile(*inputs[names.INPUT_IDS].shape, stream)
        for name, t in list(inputs.items()) + list(pools.items()):
            want = self.input_dtypes[name]
            if t.dtype != want or not t.is_contiguous():
                t = t.to(want).contiguous()
                keep.append(t)
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        for name, t in pools.items():  # outputs alias the pools: updated in place
            ctx.set_tensor_address(names.present_name(name), t.data_ptr())
        V, R = self.cfg.vocab_size, inputs[names.LOGIT_ROWS].shape[1]
        logits = torch.empty(B, self.block_size, V, dtype=torch.float32, device=self.device)
        coreset = torch.empty(B, self.cfg.num_hidden_layers, dtype=torch.int32, device=self.device)
        causal = torch.empty(B, R, V, dtype=torch.float32, device=self.device)
        ctx.set_tensor_address(names.LOGITS, logits.data_ptr())
        ctx.set_tensor_address(names.CORESET_SIZE, coreset.data_ptr())
        ctx.set_tensor_address(names.CAUSAL_LOGITS, causal.data_ptr())
        if not ctx.execute_async_v3(stream):
            raise CloverError("runtime", "TensorRT execution failed (see the TensorRT log above)")
        return StepResult(logits, coreset, pools, causal)
