"""A full-size (40-layer, 35B) random-weight BF16 step: Triton kernels + CUDA graph vs the eager reference.

Needs a CUDA GPU with ~80 GB free (weights 69 GB in bf16). Prints the step time of the eager
plain-torch cores, of the kernels (eager launch and CUDA-graph replay), their ratio, the logit
agreement, and the bytes-read bound by PERF.md 1 (`clover_export.model.perf_bound`: dense weights, per layer
the union of the experts selected by any row of the step, the embedding as gathered rows only, K/V and
GDN states) at the measured copy bandwidth.

    python bench/full_step.py [--batch 8] [--past 4096] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from clover_export.core import names
from clover_export.model import perf_bound
from clover_export.model.model import CloverModel, Cores, allocate_pools
from clover_export.testing.cuda import init_random_on_device_
from clover_export.testing.fullsize import full_size_config


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--past", type=int, default=4096)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--router-std", type=float, default=0.5)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (same pattern) for a quick comparison")
    args = ap.parse_args()
    cfg = full_size_config()
    if args.layers:
        cfg = cfg.replace(num_hidden_layers=args.layers, layer_types=cfg.layer_types[:args.layers])
    B, N, C = args.batch, cfg.block_size, cfg.block_size
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)  # allocate the 69 GB directly in bf16 (fp32 would not fit)
    with torch.device("cuda"):
        model = CloverModel(cfg).eval().requires_grad_(False)
    torch.set_default_dtype(torch.float32)
    init_random_on_device_(model, router_std=args.router_std)
    print(
        f"model on GPU in {time.perf_counter() - t0:.1f} s, {torch.cuda.memory_allocated() / 2**30:.1f} GiB", flush=True
    )
    L = args.past + C + N
    g = torch.Generator(device="cuda").manual_seed(1)
    inputs = {
        names.INPUT_IDS: torch.randint(0, cfg.vocab_size, (B, C + N), device="cuda", generator=g, dtype=torch.int32),
        names.N_CAUSAL: torch.full((B,), C, dtype=torch.int32, device="cuda"),
        names.HAS_BLOCK: torch.ones(B, dtype=torch.int32, device="cuda"),
        names.SLOT_IDS: torch.arange(B, dtype=torch.int32, device="cuda"),
        names.PAST_LEN: torch.full((B,), args.past, dtype=torch.int32, device="cuda"),
    }
    pools = allocate_pools(cfg, B, L, dtype=torch.bfloat16, device="cuda")
    for k, v in pools.items():  # a filled prefix: random caches
        v.normal_(0, 0.5 if "key" in k or "value" in k else 0.05, generator=g)
    res = {"batch": B, "past": args.past, "rows": C + N, "router_std": args.router_std, "layers": cfg.num_hidden_layers}

    model.cores = Cores()
    with torch.no_grad():
        logits_eager, sizes, _ = model.step(inputs, {k: v.clone() for k, v in pools.items()})
        res["eager_ms"] = 1e3 * timed(lambda: model.step(inputs, pools), 2)
    print(f"eager step {res['eager_ms']:.1f} ms", flush=True)

    from clover_export.plugins.cuda_ops import cuda_cores

    model.cores = cuda_cores()
    work = {k: v.clone() for k, v in pools.items()}
    with torch.no_grad():
        logits_k, _, _ = model.step(inputs, {k: v.clone() for k, v in pools.items()})
        res["kernel_eager_launch_ms"] = 1e3 * timed(lambda: model.step(inputs, work), 3)
        rel = float((logits_k - logits_eager).norm() / logits_eager.norm())
        agree = float((logits_k.argmax(-1) == logits_eager.argmax(-1)).float().mean())
        res.update(logits_rel=rel, top1_agreement=agree)
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            model.step(inputs, work)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            model.step(inputs, work)
        res["kernel_graph_ms"] = 1e3 * timed(graph.replay, 10)
    res["speedup_graph_vs_eager"] = res["eager_ms"] / res["kernel_graph_ms"]
    # bytes the step must read, by PERF.md 1 (clover_export.model.perf_bound): dense weights, the union of the
    # experts selected by any row of the step per layer (counted in one uncaptured kernel step), the
    # embedding as gathered rows, K/V read up to past_len plus the step's own, GDN states read and written
    from clover_export.backends.triton_backend import KernelMoE, kernel_cores

    counting = KernelMoE(None)
    counting.n_causal, counting.selected = inputs[names.N_CAUSAL], []
    model.cores = kernel_cores(counting)
    with torch.no_grad():
        model.step(inputs, {k: v.clone() for k, v in pools.items()})
    sel = counting.selected
    step = perf_bound.step_bytes(cfg, rows=B * (C + N), past_len=[args.past] * B, experts_per_layer=sel)
    bytes_read = step.total
    res.update(experts_per_layer=sum(sel) / len(sel), bytes_by_part_GB={k: v / 1e9 for k, v in step.to_dict().items()})
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    bw = 2 * x.numel() / timed(lambda: y.copy_(x), 10)
    res.update(bytes_read_GB=bytes_read / 1e9, copy_TBps=bw / 1e12, bound_ms=1e3 * bytes_read / bw,
               fraction_of_bound=(1e3 * bytes_read / bw) / res["kernel_graph_ms"])
    print(json.dumps(res, indent=1))
    Path(args.out, "full_step.json").write_text(json.dumps(res, indent=1))
    print(f"SUMMARY full 40-layer bf16 step B={B} past={args.past}: eager {res['eager_ms']:.1f} ms, kernels+graph "
          f"{res['kernel_graph_ms']:.2f} ms ({res['speedup_graph_vs_eager']:.1f}x, target >= 5x), bytes bound "
          f"{res['bound_ms']:.2f} ms ({100 * res['fraction_of_bound']:.0f}% of bound), logits rel {rel:.2e}")


if __name__ == "__main__":
    main()
