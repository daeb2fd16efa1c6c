"""The `ort` backend: an exported step graph through ONNX Runtime (STEP_GRAPH.md 1).

Inputs and outputs are bound to torch tensors with IOBinding (no host
copies; CPU or CUDA). ONNX Runtime computes `present.*` functionally, so the
backend keeps two pool sets and alternates: this step's `present.*` are
written into the set that becomes next step's `past_key_values.*`.
A step returns `model.model.StepResult`; the graph always takes `logit_rows`
(the causal rows whose next-token logits come back as `causal_logits`), so
a step without it asks for row 0.
"""

from __future__ import annotations

from pathlib import Path

import torch

from clover_export.artifact.manifest import MANIFEST
from clover_export.backends.threads import check_threads, flops_per_row, ort_threads, torch_thread_scope, torch_threads
from clover_export.core import names
from clover_export.core.errors import CloverError
from clover_export.model.loading import DEFAULT_MODEL
from clover_export.model.model import StepResult, allocate_pools, with_logit_rows

# torch dtype -> ONNX TensorProto element type
_ONNX_TYPES = {torch.float32: 1, torch.int32: 6, torch.int64: 7, torch.bool: 9, torch.float16: 10,
               torch.bfloat16: 16}
_TORCH_DTYPES = {"float32": torch.float32, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
                 "float16": torch.float16, "bfloat16": torch.bfloat16}


def _is_model(path) -> bool:
    """The embedded default or a model folder (config.json, no manifest.json), not an exported artifact."""
    if path is None or str(path) == DEFAULT_MODEL:
        return True
    return (Path(path) / "config.json").is_file() and not (Path(path) / MANIFEST).is_file()


class OrtBackend:
    name = "ort"
    step_shapes = None  # the graph's dims are symbolic: any C, any batch

    def __init__(self, art, session, source: Path | None = None):
        self.art, self.session = art, session
        self.cfg = art.config
        self.block_size = art.block_size
        self.max_context = min(art.manifest.max_context, self.cfg.max_context)
        self.source_dir = source  # `load` resolves it (`source_dir`); a graph run alone needs no tokenizer
        self.model_dtype = torch.bfloat16 if art.dtype == "bf16" else torch.float32
        cuda = session.get_providers()[0] == "CUDAExecutionProvider"
        self.device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        self.input_dtypes = {s.name: _TORCH_DTYPES[s.dtype] for s in art.inputs}
        self.io = session.io_binding()
        self.spare: dict[str, torch.Tensor] | None = None  # the other pool set (present.* go there)
        self._out: tuple[torch.Tensor, torch.Tensor] | None = None
        self._causal: torch.Tensor | None = None
        self.threads: int | None = None  # explicit thread count, else the policy of backends/threads.py

    @classmethod
    def load(cls, artifact=None, *, providers: list | None = None, threads: int | None = None) -> "OrtBackend":
        """An exported artifact folder; or a model folder / None / "tiny", exported (fp32) into the cache
        on first use (backends/ort_cache.py). `threads`: intra-op threads (backends/threads.py)."""
        try:
            from clover_export.exporter import load_artifact
            from clover_export.exporter.session import ort_session
        except ImportError:
            raise CloverError("runtime", "the ONNX exporter is not available in this installation",
                              "use --backend torch") from None
        import onnxruntime as ort

        threads = check_threads(threads)
        if _is_model(artifact):
            from clover_export.backends.ort_cache import exported_artifact

            artifact = exported_artifact(artifact)
        art = load_artifact(artifact)
        so = ort.SessionOptions()
        # ORT's pool threads spin after each run by default, starving other processes and the selection that
        # follows on the same cores
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.add_session_config_entry("session.inter_op.allow_spinning", "0")
        so.intra_op_num_threads = ort_threads(threads, flops_per_row(art.config) * 2 * art.block_size)
        so.inter_op_num_threads = 1
        backend = cls(art, ort_session(art, providers=providers, session_options=so), art.source_dir())
        backend.threads = threads
        return backend

    def thread_scope(self, rows: int):
        """torch threads for the runner's selection around a step (ONNX Runtime has its own)."""
        return torch_thread_scope(torch_threads(self.threads, 0.0))

    def allocate_pools(self, num_slots: int, max_len: int) -> dict[str, torch.Tensor]:
        if max_len > self.max_context:
            raise CloverError("runtime", f"pools of {max_len} positions exceed the artifact's {self.max_context}")
        self.spare = allocate_pools(self.cfg, num_slots, max_len, dtype=self.model_dtype, device=self.device)
        return allocate_pools(self.cfg, num_slots, max_len, dtype=self.model_dtype, device=self.device)

    def _outputs(self, B: int, R: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Output buffers, reused while the batch size (and R) stays (fresh pages cost more than the copy-free
        reuse; the caller may overwrite the logits until the next step)."""
        V = self.cfg.vocab_size
        if self._out is None or self._out[0].shape[0] != B:
            self._out = (torch.empty(B, self.block_size, V, dtype=torch.float32, device=self.device),
                         torch.empty(B, self.cfg.num_hidden_layers, dtype=torch.int32, device=self.device))
        if self._causal is None or self._causal.shape[:2] != (B, R):
            self._causal = torch.empty(B, R, V, dtype=torch.float32, device=self.device)
        return (*self._out, self._causal)

    def _bind(self, name: str, t: torch.Tensor, output: bool = False) -> None:
        dev = "cuda" if t.is_cuda else "cpu"
        idx = t.device.index or 0
        args = (name, dev, idx, _ONNX_TYPES[t.dtype], list(t.shape), t.data_ptr())
        (self.io.bind_output if output else self.io.bind_input)(*args)

    def step(self, inputs, pools) -> StepResult:
        spare = self.spare
        logits, coreset, causal = self.step_into(inputs, pools, spare)
        self.spare = pools
        return StepResult(logits, coreset, spare, causal)

    def step_into(self, inputs, pools, present: dict[str, torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step with its `present.*` written into `present` (a pool set shaped like `pools`); returns
        the logits, coreset sizes and causal logits (buffers reused by the next step)."""
        io = self.io
        io.clear_binding_inputs()
        io.clear_binding_outputs()
        B = inputs[names.INPUT_IDS].shape[0]
        inputs = with_logit_rows(inputs)
        keep = []  # converted inputs must outlive the run
        for name, t in inputs.items():
            want = self.input_dtypes.get(name, t.dtype)
            if t.dtype != want or not t.is_contiguous():
                t = t.to(want).contiguous()
                keep.append(t)
            self._bind(name, t)
        logits, coreset, causal = self._outputs(B, inputs[names.LOGIT_ROWS].shape[1])
        self._bind(names.LOGITS, logits, output=True)
        self._bind(names.CORESET_SIZE, coreset, output=True)
        for name, t in pools.items():
            self._bind(name, t)
            self._bind(names.present_name(name), present[name], output=True)
        self._bind(names.CAUSAL_LOGITS, causal, output=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        self.session.run_with_iobinding(io)
        return logits, coreset, causal
