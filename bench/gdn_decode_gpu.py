#!/usr/bin/env python3
"""One short GPU check (issue 15): the copy bandwidth measured both ways, and the BlockGDN kernel whose
forward substitution now stops at the chunk's last valid row, at the real layer sizes.

    python bench/gdn_decode_gpu.py [--out DIR]     # CUDA GPU, ~1 minute (mostly compiling)

Prints one JSON line and writes DIR/gdn_decode_gpu.json: copy TB/s from eager copies timed with CUDA
events (what step_bound.py / e2e_gpu.py now use) and from a CUDA-graph replayed copy (what step_bound.py
used: a graph memcpy node); check_gdn (bf16, fp32) against the plain-torch core; kernel ms for an AR
decode step (1 causal row, no block), a denoise step (block only) and commit + denoise (32 + 32 rows).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check as G  # noqa: E402


def gdn_ms(B: int, Tc: int, N: int) -> float:
    from clover_export.plugins.triton.ops import block_gdn

    R = G.REAL
    args, (cp, rp), slots, nc = G.gdn_inputs(B, R["Hk"], R["Hv"], R["dk"], R["dv"], R["K"], N, Tc, B,
                                             torch.bfloat16, torch.bfloat16, seed=3)
    return G.graph_ms(lambda: block_gdn(*args, cp, rp, slots, nc, R["Hk"], R["dk"], R["dv"], N))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    out = ap.parse_args().out
    n = 1 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    graph_ms = G.graph_ms(lambda: y.copy_(x), n=5)
    res = {"gpu": torch.cuda.get_device_name(), "copy_TBps_eager_events": G.copy_bandwidth() / 1e12,
           "copy_TBps_graph_replay": 2 * n / (graph_ms / 1e3) / 1e12}
    res["check_gdn_bf16"] = G.check_gdn(torch.bfloat16)
    res["check_gdn_fp32"] = G.check_gdn(torch.float32)
    for name, (B, Tc, N) in {"ar_decode_b1": (1, 1, 0), "ar_decode_b8": (8, 1, 0), "denoise_b1": (1, 0, 32),
                             "commit_denoise_b8": (8, 32, 32)}.items():
        res[f"gdn_ms_{name}"] = gdn_ms(B, Tc, N)
    print(json.dumps(res))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gdn_decode_gpu.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
