"""FP8 calibration alone on the full-size sparse checkpoint: the routing it gives vs routing as trained weights do.

The sparse checkpoint (`clover_export.testing.fullsize`: zero weights) sends every row to
the same 8 experts (zero router logits tie; top-k takes the first 8), so a
build on it runs 8 experts a layer. Trained weights spread the rows over all
256: `routed_moe_core` then casts and runs every expert of every layer, twice
(prefill and denoise). This runs the build's calibration (`streamed_model` +
`calibrate`, 10 built-in prompts, layer by layer on the CPU) both ways in one
run, each in its own subprocess: as the checkpoint routes, and with random
hidden states and router weights handed to the MoE core (`routed_moe_core`
wrapped), so that the router and the block coreset both see spread scores
and the rows reach all experts (the values computed do not matter here; the
experts are zero either way). Printed: wall, CPU seconds, peak RSS of each,
and the ratio.

    python bench/calib_routing.py [--work DIR]   (DIR holds or gets the sparse checkpoint)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from clover_export.testing.fullsize import write_sparse_checkpoint

CHILD = """
import resource, sys, time
from pathlib import Path
import torch
if sys.argv[2] == "spread":  # random hidden states and router at the MoE: which experts run is what costs
    import clover_export.quantize.stream_calib as sc
    real, g = sc.routed_moe_core, torch.Generator().manual_seed(0)
    sc.routed_moe_core = lambda x, w, *a: real(torch.randn(x.shape, generator=g, dtype=x.dtype),
                                               torch.randn(w.shape, generator=g, dtype=w.dtype), *a)
from clover_export.quantize.calibration import prompt_batch, read_prompts
from clover_export.quantize.calibration import calibrate
from clover_export.quantize.stream_calib import streamed_model
m = Path(sys.argv[1])
t = time.perf_counter()
model = streamed_model(m, 32)
amax = calibrate(m, prompt_batch(m, read_prompts(None), 32), 32, model=model)
model.stream_progress.close()
u = resource.getrusage(resource.RUSAGE_SELF)
print("RESULT", time.perf_counter() - t, u.ru_utime + u.ru_stime, u.ru_maxrss * 1024, len(amax))
"""


def run(ckpt: Path, routing: str) -> tuple[float, float, int, int]:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ckpt), routing], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"calibration ({routing}) failed:\n{proc.stderr[-3000:]}")
    w = next(line.split() for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return float(w[1]), float(w[2]), int(w[3]), int(w[4])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=None, help="folder for the sparse checkpoint (default: a temp folder)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="clover-calib-routing-"))
    ckpt = work / "checkpoint"
    write_sparse_checkpoint(ckpt)
    res = {}
    for routing in ("checkpoint", "spread"):
        t = time.perf_counter()
        res[routing] = run(ckpt, routing)
        wall, cpu, rss, n = res[routing]
        print(f"{routing:10s} routing: calibration {wall:6.1f} s (CPU {cpu:6.1f} s, peak RSS {rss / 2**30:.2f} GiB, "
              f"{n} ranges; subprocess {time.perf_counter() - t:.1f} s)")
    print(f"spread / checkpoint: wall {res['spread'][0] / res['checkpoint'][0]:.2f} x, "
          f"CPU {res['spread'][1] / res['checkpoint'][1]:.2f} x")


if __name__ == "__main__":
    main()
