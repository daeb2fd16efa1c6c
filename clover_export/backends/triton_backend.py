"""The `triton` backend: the reference model's layers around the plugin kernels, CUDA graphs per step shape.

The three cores are the Triton kernels' torch entry points
(`plugins/triton/ops.py`, the in-place twins `cuda_ops` registers): the
pools are updated in place by slot id (no per-step copy), nothing syncs with
the host. On a CUDA GPU the step is captured once per bucket of (batch
rows, causal rows) at load (`cuda_graphs.py`) and replayed into static
outputs; steps outside every bucket run eagerly (or raise with
`eager_fallback=False`). Padding causal rows select no expert (PERF.md 1).
Experts can be FP8 (`fp8_experts`: quantized at load, or an FP8 artifact).

On the CPU it runs the same kernels under TRITON_INTERPRET=1 (fp32, no
graphs): how CI checks it against the torch backend.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from clover_export.backends.base import StepShape
from clover_export.backends.cuda_graphs import StepGraphs, default_buckets
from clover_export.backends.fp8_experts import Fp8Experts, from_artifact, quantize_at_load
from clover_export.backends.torch_backend import check_device
from clover_export.core import names
from clover_export.core.errors import CloverError
from clover_export.model.loading import load_model, resolve_model_dir
from clover_export.model.model import CloverModel, Cores, StepResult, allocate_pools


def check_target(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) the backend can run, else one CloverError saying why."""
    dev = torch.device(check_device(device))
    if dev.type not in ("cuda", "cpu"):
        raise CloverError(
            "runtime", f"the triton backend runs on cuda (or cpu under TRITON_INTERPRET=1), not {dev.type}"
        )
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise CloverError("runtime", "the triton backend on the CPU needs TRITON_INTERPRET=1 (set before start-up)",
                          "use --device cuda, or --backend torch on the CPU")
    if dtype == "auto":
        dtype = "bf16" if dev.type == "cuda" else "fp32"
    if dtype not in ("fp32", "bf16") or (dev.type == "cpu" and dtype != "fp32"):
        raise CloverError("runtime", f"the triton backend runs {dtype} on {dev.type}: unsupported",
                          "fp32 or bf16 on cuda; fp32 on the CPU interpreter")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise CloverError("runtime", "the triton backend needs the triton package", "pip install triton") from None
    return dev, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]


class KernelMoE:
    """The MoE core: `CoresetMoE` / `CoresetMoEFP8` kernels, padding causal rows routed to no expert.

    `n_causal` is the step's tensor (a graph's static buffer while capturing),
    set by the backend before the model runs; the kernels read it on the device.
    Benchmarks may set `router_bias` (router weight's id -> [E] logit bias, a
    planted skew) and `selected` (a list: each call appends the number of
    experts any row selected, the union of PERF.md 1; a host read, so never
    while capturing).
    """

    def __init__(self, fp8: Fp8Experts | None):
        self.fp8 = fp8
        self.n_causal: torch.Tensor | None = None
        self.router_bias: dict[int, torch.Tensor] = {}
        self.selected: list[int] | None = None

    def __call__(self, x, router_w, gate_up, down, top_k, top_p, coreset, block_size):
        from clover_export.plugins.triton import ops

        scales = self.fp8.scales(gate_up, down) if self.fp8 is not None else None
        if gate_up.dtype == torch.float8_e4m3fn and scales is None:
            raise CloverError("runtime", "FP8 expert weights without scales", "load them with fp8_experts")
        gs, ds = scales if scales else (None, None)
        bias = self._router_bias(x, router_w, top_k, top_p, coreset, block_size)
        return ops.coreset_moe(x, router_w, gate_up, down, top_k, top_p, coreset, block_size, gate_up_scale=gs,
                               down_scale=ds, n_causal=self.n_causal, router_bias=bias)

    def _router_bias(self, x, router_w, top_k, top_p, coreset, block_size):
        """The planted router bias of this layer (or None); counts the selected experts when asked to."""
        from clover_export.plugins.triton import ops

        bias = self.router_bias.get(id(router_w))
        if self.selected is not None:
            idx = ops.moe_route(x, router_w, top_k, top_p, coreset, block_size, self.n_causal, bias)[0]
            self.selected.append(int(idx[idx < router_w.shape[0]].unique().numel()))
        return bias

    def block(self, x, router_w, gate_up, down, shared_gate, shared_up, shared_down, shared_gate_w, top_k, top_p,
              coreset, block_size):
        """The whole MoE block, the shared expert as one more expert of the grouped GEMMs (ops.moe_block)."""
        from clover_export.plugins.triton import ops

        bias = self._router_bias(x, router_w, top_k, top_p, coreset, block_size)
        return ops.moe_block(x, router_w, gate_up, down, shared_gate, shared_up, shared_down, shared_gate_w, top_k,
                             top_p, coreset, block_size, n_causal=self.n_causal, router_bias=bias)


def kernel_cores(moe: KernelMoE, cfg=None) -> Cores:
    """The kernels' Cores; with the config, the shared expert joins the grouped GEMMs where
    launch.moe_shared_fusable allows (not with FP8 experts)."""
    from clover_export.plugins.triton import launch, ops

    fuse = cfg is not None and launch.moe_shared_fusable(cfg.moe_intermediate_size,
                                                         cfg.shared_expert_intermediate_size, moe.fp8 is not None)
    return Cores(gdn=ops.block_gdn, attention=ops.block_attention, moe=moe, **ops.GLUE,
                 moe_block=moe.block if fuse else None)


class TritonBackend:
    name = "triton"

    def __init__(self, model: CloverModel, source_dir: Path | None = None, *, fp8: Fp8Experts | None = None,
                 cuda_graphs: bool = True, graph_batch_sizes=None, graph_causal_rows=None, eager_fallback: bool = True,
                 progress: bool = True):
        self.model = model.eval().requires_grad_(False)
        self.cfg = model.cfg
        self.block_size = model.block_size
        self.max_context = model.cfg.max_context
        self.device = model.lm_head.weight.device
        self.source_dir = Path(source_dir) if source_dir is not None else None
        self.moe = KernelMoE(fp8)
        self.model.cores = kernel_cores(self.moe, model.cfg)
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        if not eager_fallback and not self.use_graphs:
            raise CloverError("runtime", f"eager_fallback=False needs CUDA graphs, which run on cuda only (not "
                              f"{self.device.type}, cuda_graphs={cuda_graphs})")
        self.graph_batch_sizes, self.graph_causal_rows = graph_batch_sizes, graph_causal_rows
        self.eager_fallback = eager_fallback
        self.progress = progress
        self.graphs: StepGraphs | None = None
        self.pools: dict[str, torch.Tensor] | None = None
        self.step_shapes: list[StepShape] | None = None  # None: any C and batch (eager outside the buckets)

    @classmethod
    def load(cls, model=None, *, dtype: str = "auto", device: str | None = None, block_size: int | None = None,
             allow_qwen: bool = False, fp8_experts: bool | str | Path = False, **options) -> "TritonBackend":
        """model: a model folder (None: the embedded default). fp8_experts: True quantizes the experts at
        load; a path reads them from that FP8 artifact. options: cuda_graphs, graph_batch_sizes,
        graph_causal_rows, eager_fallback, progress."""
        from clover_export.artifact.manifest import is_artifact

        if is_artifact(model):
            raise CloverError("runtime", f"{model}: is an exported artifact; the triton backend runs a model folder",
                              "pass the model folder (and fp8_experts=<the FP8 artifact> for its FP8 experts)")
        dev, torch_dtype = check_target(device or ("cuda" if torch.cuda.is_available() else "cpu"), dtype)
        if block_size is not None and block_size < 1:
            raise CloverError("runtime", f"block_size must be >= 1, got {block_size}")
        model_dir = resolve_model_dir(model)
        ref = load_model(model_dir, dtype=torch_dtype, allow_qwen=allow_qwen, device=str(dev), block_size=block_size)
        fp8 = None
        if fp8_experts is True:
            fp8 = quantize_at_load(ref)
        elif fp8_experts:
            fp8 = from_artifact(ref, fp8_experts)
        return cls(ref, model_dir, fp8=fp8, **options)

    def allocate_pools(self, num_slots: int, max_len: int) -> dict[str, torch.Tensor]:
        """The pools plus one scratch slot (index num_slots) for the graphs' padding rows; captures the graphs."""
        pools = allocate_pools(self.cfg, num_slots + 1, max_len, dtype=self.model.dtype, device=self.device)
        self.num_slots = num_slots
        if self.use_graphs:
            buckets = default_buckets(num_slots, self.block_size, self.graph_batch_sizes, self.graph_causal_rows)
            self.graphs = StepGraphs(lambda inputs: self._run(inputs, pools), buckets, self.block_size, num_slots,
                                     self.device)
            if not self.eager_fallback:  # graphs only: the scheduler keeps every step inside the buckets
                self.step_shapes = [StepShape(0, max(b.causal for b in buckets), max(b.batch for b in buckets))]
            self.graphs.capture(self.progress)
            for pool in pools.values():  # the warm-up ran on the scratch slot
                pool[num_slots].zero_()
        self.pools = pools
        return pools

    @torch.inference_mode()
    def _run(self, inputs, pools):
        self.moe.n_causal = inputs[names.N_CAUSAL]
        try:
            res = self.model.step(inputs, pools)
        finally:
            self.moe.n_causal = None
        return res[0], res[1], res.causal_logits

    @torch.inference_mode()
    def step(self, inputs, pools) -> StepResult:
        B, T = inputs[names.INPUT_IDS].shape
        C = T - self.block_size
        rows = inputs.get(names.LOGIT_ROWS)
        if self.graphs is not None and pools is self.pools:
            bucket = self.graphs.bucket_for(B, C, 1 if rows is None else rows.shape[1])
            if bucket is not None:
                logits, coreset, causal = self.graphs.replay(bucket, inputs)
                return StepResult(logits, coreset, pools, causal)
        if not self.eager_fallback:
            held = sorted(self.graphs.graphs) if self.graphs else []
            wide = f" (logits of {rows.shape[1]} rows)" if rows is not None and rows.shape[1] > self.block_size else ""
            raise CloverError("runtime", f"step of {B} rows x {C} causal rows{wide} is past the CUDA-graph buckets "
                              f"(largest: {max(held) if held else 'none captured'})",
                              "load with eager_fallback=True, or larger graph_batch_sizes / graph_causal_rows")
        logits, coreset, causal = self._run(inputs, pools)
        return StepResult(logits, coreset, pools, causal)
