"""TensorRT optimisation profiles and build settings, decided without TensorRT (STEP_GRAPH.md 1, 4).

The step graph has four dynamic dimensions (names as in the manifest):
batch (B rows), step_len (T = C causal + N block rows), slots (S) and
pool_len (L). One engine serves
every kind of step through two profiles:
- decode: T in [N, 2N] (plain denoise steps, or a commit folded into the next block);
- prefill: T in [N, chunk + N] (prompt chunks, the last one folded with the first block).
Pools are allocated once, so S = max_batch and L = max_context exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from clover_export.errors import CloverError

B, T, S, L = "batch", "step_len", "slots", "pool_len"
DYNAMIC_DIMS = (B, T, S, L)


@dataclass(frozen=True)
class Profile:
    name: str
    dims: dict[str, tuple[int, int, int]]  # dynamic dim -> (min, opt, max)

    def shape_ranges(self, inputs: dict[str, list]) -> dict[str, tuple[tuple, tuple, tuple]]:
        """Input name -> (min, opt, max) shapes, from symbolic shapes like ["B", "T"]."""
        out = {}
        for name, shape in inputs.items():
            trio = []
            for k in range(3):
                dims = []
                for d in shape:
                    if isinstance(d, int):
                        dims.append(d)
                    elif d in self.dims:
                        dims.append(self.dims[d][k])
                    else:
                        raise CloverError("build", f"input '{name}' has dynamic dim {d!r} that no profile covers",
                                          f"known dynamic dims: {', '.join(self.dims)}")
                trio.append(tuple(dims))
            out[name] = tuple(trio)
        return out


def step_profiles(block_size: int, chunk: int, max_batch: int, max_context: int) -> list[Profile]:
    if block_size < 1 or chunk < 1 or max_batch < 1 or max_context < chunk + block_size:
        raise CloverError("build", f"bad profile sizes: block_size={block_size}, chunk={chunk}, "
                                   f"max_batch={max_batch}, max_context={max_context}",
                          "max_context must hold at least one chunk plus one block")
    N = block_size
    pools = {S: (max_batch,) * 3, L: (max_context,) * 3}
    batch = (1, max_batch, max_batch)
    return [
        Profile("decode", {B: batch, T: (N, 2 * N, 2 * N), **pools}),
        Profile("prefill", {B: batch, T: (N, chunk + N, chunk + N), **pools}),
    ]


def profile_for(profiles: list[Profile], batch: int, rows: int) -> int:
    """Index of the first profile whose ranges hold a step of `batch` rows of `rows` each (the runtime's choice)."""
    for i, p in enumerate(profiles):
        if p.dims[B][0] <= batch <= p.dims[B][2] and p.dims[T][0] <= rows <= p.dims[T][2]:
            return i
    raise CloverError("runtime", f"no engine profile holds a step of batch {batch} x {rows} rows",
                      "rebuild with a larger --max-batch or --chunk")


@dataclass(frozen=True)
class BuildSettings:
    precision: str  # bf16 | fp8
    workspace_bytes: int
    strip_weights: bool  # weight-stripped plan + refit from the ONNX at load
    timing_cache: str | None
    builder_optimization_level: int = 3

    def flags(self, trt_major: int) -> list[str]:
        """BuilderFlag names to set. TensorRT 11 is strongly typed only (no precision flags);
        on 10.x the network is created STRONGLY_TYPED too, so precision flags are never set."""
        flags = []
        if self.strip_weights:
            flags += ["STRIP_PLAN", "REFIT_IDENTICAL"]
        return flags

    @staticmethod
    def network_flags(trt_major: int) -> list[str]:
        """NetworkDefinitionCreationFlag names: STRONGLY_TYPED on 10.x (11.x has only strong typing)."""
        return ["STRONGLY_TYPED"] if trt_major == 10 else []
