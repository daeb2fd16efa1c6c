"""GPU check of the `triton` runtime backend on the embedded default.

Greedy tokens of a staggered batch (requests in different phases) from the `triton` backend
(kernels + CUDA graphs, and eager kernels) against the `torch` backend on the same GPU and dtype,
plus the mean step time of each. Prints PASS/FAIL and BENCH lines.

    python gpu_checks/triton_backend_gpu.py [--dtype fp32|bf16]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from clover_export.runtime import Generator

PROMPTS = ["Sort: 3 1 2 9 4", "Reverse: 5 6 7 1 2 8 9", "Sort: 9 8 7 6 5 4 3 2 1 0 5 5", "Reverse: 1 2"]


def run(backend: str, dtype: str, **opts):
    gen = Generator.load(None, backend=backend, device="cuda", dtype=dtype, max_slots=4, **opts)
    gen.generate(PROMPTS[0], max_new_tokens=8)  # warm-up (compiles kernels)
    torch.cuda.synchronize()
    handles = [gen.submit(PROMPTS[0], max_new_tokens=64, threshold=0.9)]
    steps = 0
    t0 = time.perf_counter()
    for p in PROMPTS[1:]:  # staggered admissions: the others join while the first is mid-block
        for _ in range(2):
            gen.step()
            steps += 1
        handles.append(gen.submit(p, max_new_tokens=64, threshold=0.9))
    while not all(h.done for h in handles):
        gen.step()
        steps += 1
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return [h.result.token_ids for h in handles], 1e3 * dt / steps, steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, ref_ms, ref_steps = run("torch", args.dtype)
    fails = 0
    for label, opts in (("triton+graphs", {}), ("triton eager", {"cuda_graphs": False})):
        try:
            toks, ms, steps = run("triton", args.dtype, **opts)
        except Exception as e:  # noqa: BLE001
            print(f"FAIL {label} {args.dtype}: {type(e).__name__}: {e}", flush=True)
            fails += 1
            continue
        same = sum(a == b for a, b in zip(toks, ref))
        ok = same == len(ref)
        fails += not ok
        print(f"{'PASS' if ok else 'FAIL'} {label} {args.dtype}: {same}/{len(ref)} requests with the torch "
              f"backend's greedy tokens", flush=True)
        print(f"BENCH {label} {args.dtype}: {ms:.2f} ms/step ({steps} steps) vs torch {ref_ms:.2f} ms/step "
              f"({ref_steps} steps): {ref_ms / ms:.1f}x", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
