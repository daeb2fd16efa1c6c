"""GPU check of the `triton` runtime backend on the embedded default.

Greedy tokens of a staggered batch (requests in different phases) in each decoding mode
(low_confidence, ar, self_spec) from the `triton` backend (kernels + CUDA graphs, and eager kernels)
against the `torch` backend on the same GPU and dtype (whose ar and self_spec tokens must also equal),
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


MODES = {"low_confidence": {"threshold": 0.9}, "ar": {}, "self_spec": {}}


def staggered(gen: Generator, mode: str) -> tuple[list[list[int]], float, int]:
    """The prompts in one batch, each joining two steps after the one before: (token ids, ms/step, steps)."""
    params = dict(max_new_tokens=64, decoding=mode, **MODES[mode])
    torch.cuda.synchronize()
    handles = [gen.submit(PROMPTS[0], **params)]
    steps = 0
    t0 = time.perf_counter()
    for p in PROMPTS[1:]:  # staggered admissions: the others join while the first is mid-block
        for _ in range(2):
            gen.step()
            steps += 1
        handles.append(gen.submit(p, **params))
    while not all(h.done for h in handles):
        gen.step()
        steps += 1
    torch.cuda.synchronize()
    return [h.result.token_ids for h in handles], 1e3 * (time.perf_counter() - t0) / steps, steps


def run(backend: str, dtype: str, **opts) -> dict[str, tuple[list[list[int]], float, int]]:
    """Each decoding mode's staggered batch on one loaded backend (warmed up first: kernels compile)."""
    gen = Generator.load(None, backend=backend, device="cuda", dtype=dtype, max_slots=4, **opts)
    for mode in MODES:
        gen.generate(PROMPTS[0], max_new_tokens=8, decoding=mode)
    return {mode: staggered(gen, mode) for mode in MODES}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = run("torch", args.dtype)
    fails = 0
    if ref["ar"][0] != ref["self_spec"][0]:
        print(f"FAIL torch {args.dtype}: ar and self_spec tokens differ", flush=True)
        fails += 1
    for label, opts in (("triton+graphs", {}), ("triton eager", {"cuda_graphs": False})):
        try:
            got = run("triton", args.dtype, **opts)
        except Exception as e:  # noqa: BLE001
            print(f"FAIL {label} {args.dtype}: {type(e).__name__}: {e}", flush=True)
            fails += 1
            continue
        for mode, (toks, ms, steps) in got.items():
            want, ref_ms, ref_steps = ref[mode]
            same = sum(a == b for a, b in zip(toks, want))
            ok = same == len(want)
            fails += not ok
            print(f"{'PASS' if ok else 'FAIL'} {label} {args.dtype} {mode}: {same}/{len(want)} requests with the "
                  f"torch backend's greedy tokens", flush=True)
            print(f"BENCH {label} {args.dtype} {mode}: {ms:.2f} ms/step ({steps} steps) vs torch {ref_ms:.2f} "
                  f"ms/step ({ref_steps} steps): {ref_ms / ms:.1f}x", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
