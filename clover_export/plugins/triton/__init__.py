"""Triton kernels of the three plugin ops (STEP_GRAPH.md 2, 4, 5).

- `gdn.py`, `attention.py`, `moe.py`: the @triton.jit kernels (import triton only);
- `launch.py`: grids, kernel argument lists, compile-time sizes (plain functions);
- `ops.py`: torch entry points (in-place cache updates, CUDA-graph capturable);
- `aot.py`: ahead-of-time PTX per GPU architecture, with the entry ABI checked.

Nothing here is imported by `clover_export` itself: triton stays optional.
"""
