"""Timing on one CUDA GPU, and random full-size weights initialised there (PERF.md 1, 3).

The copy bandwidth is measured from eager copies timed with CUDA events: a
copy captured in a CUDA graph becomes a graph memcpy node, which reads far
slower than an eager copy on the same GPU (2.76 vs 4.17 TB/s on an H200,
`python bench/gdn_decode_gpu.py`), so a bound computed from it would be too
generous.
"""

from __future__ import annotations

import torch


def copy_bandwidth(n: int = 1 << 30, reps: int = 20) -> float:
    """Bytes/s (read + write) of a device-to-device copy of n bytes: the median of `reps` eager copies timed
    with CUDA events (PERF.md 1's bandwidth)."""
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return 2 * n / sorted(ts)[len(ts) // 2]


def graph_ms(fn, n: int = 10, reps: int = 5) -> float:
    """Median time per call of `fn` replayed from a CUDA graph of n calls (host time excluded)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / n)
    return sorted(times)[len(times) // 2]


def bench_ms(fn, rep_ms: int = 100) -> float:
    """Median ms per call by `triton.testing.do_bench` (L2 flushed between calls)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def arch() -> int:
    """The GPU's compute capability as one number (90 for sm_90)."""
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def init_random_on_device_(model, seed: int = 0, router_std: float = 0.02) -> None:
    """Random weights drawn on the model's CUDA device (a full-size model does not fit in fp32 on the host):
    GDN decay and gate parameters in their trained ranges, `router_std` for the routers (0.02: near-uniform
    routing, where bf16 noise flips experts; 0.5: decisive routing), 0.02 elsewhere."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p, dtype=torch.float32).uniform_(1, 16, generator=g).log())
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            elif name.endswith("block_softmax_scale"):
                p.fill_(4.0)
            elif p.dim() == 1 or name.endswith("block_softmax_gate"):
                p.normal_(0, 0.1, generator=g)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, router_std, generator=g)
            elif name.endswith(("conv1d.weight", "conv1d_right.weight")):
                p.normal_(0, 0.5, generator=g)
            else:
                p.normal_(0, 0.02, generator=g)
