#!/usr/bin/env python3
"""The copy bandwidth measured both ways, and the BlockGDN kernel per step kind at real layer sizes (GPU).

BlockGDN's forward substitution stops at the chunk's last valid row, so an AR decode step (1 row) should
cost far less than a denoise step (32 rows).

    python bench/gdn_decode_gpu.py [--out DIR]     # CUDA GPU, ~1 minute (mostly compiling)

Prints one JSON line and writes DIR/gdn_decode_gpu.json: copy TB/s from eager copies timed with CUDA
events (what step_bound.py and e2e_gpu.py use) and from a CUDA-graph replayed copy (a graph memcpy node);
check_gdn (bf16, fp32) against the plain-torch core; kernel ms for an AR decode step (1 causal row, no
block), a denoise step (block only) and commit + denoise (32 + 32 rows).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as gpu_checks/gpu_check.py measures the kernels

import torch  # noqa: E402

from clover_export.plugins.triton.ops import block_gdn  # noqa: E402
from clover_export.testing.cuda import copy_bandwidth, graph_ms  # noqa: E402
from clover_export.testing.kernel_cases import REAL, check_gdn, gdn_inputs  # noqa: E402


def gdn_ms(B: int, Tc: int, N: int) -> float:
    R = REAL
    args, (cp, rp), slots, nc = gdn_inputs(B, R["Hk"], R["Hv"], R["dk"], R["dv"], R["K"], N, Tc, B,
                                           torch.bfloat16, torch.bfloat16, seed=3)
    return graph_ms(lambda: block_gdn(*args, cp, rp, slots, nc, R["Hk"], R["dk"], R["dv"], N))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    out = ap.parse_args().out
    n = 1 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    replay_ms = graph_ms(lambda: y.copy_(x), n=5)
    res = {"gpu": torch.cuda.get_device_name(), "copy_TBps_eager_events": copy_bandwidth() / 1e12,
           "copy_TBps_graph_replay": 2 * n / (replay_ms / 1e3) / 1e12}
    res["check_gdn_bf16"] = check_gdn(torch.bfloat16)
    res["check_gdn_fp32"] = check_gdn(torch.float32)
    for name, (B, Tc, N) in {"ar_decode_b1": (1, 1, 0), "ar_decode_b8": (8, 1, 0), "denoise_b1": (1, 0, 32),
                             "commit_denoise_b8": (8, 32, 32)}.items():
        res[f"gdn_ms_{name}"] = gdn_ms(B, Tc, N)
    print(json.dumps(res))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gdn_decode_gpu.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
