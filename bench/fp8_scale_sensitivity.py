"""FP8 accuracy of a build's graph with every activation scale multiplied by a factor.

    clover-export build --out build/tiny --max-batch 2          # once (fp8 is the default precision)
    python bench/fp8_scale_sensitivity.py build/tiny [1 10 0.1 100 1000 ...]

Re-quantizes the build's onnx-fp32 with the calibrated amax times each factor and prints top-1
agreement and logit error against onnx-fp32 on the held-out prompts (the figures the FP8 gate and
tests/quantize/test_fp8_graph.py's trained-default thresholds are set from). Writes only to a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from clover_export.artifact.manifest import load_artifact
from clover_export.quantize import graph as fp8
from clover_export.verify.agreement import HELDOUT_PROMPTS, agreement


def main(build_dir: str, factors: list[float]) -> None:
    build = Path(build_dir)
    amax = json.loads((build / "build.json").read_text())["stages"]["calibrate"]["result"]["amax"]
    fp32 = build / "onnx-fp32"
    model_dir = load_artifact(fp32).model_dir
    with tempfile.TemporaryDirectory() as tmp:
        for f in factors:
            t = time.perf_counter()
            out = Path(tmp) / f"x{f}"
            fp8.quantize_graph(fp32, out, {k: v * f for k, v in amax.items()})
            a = agreement(fp32, out, model_dir, HELDOUT_PROMPTS)
            print(f"act scale x{f:g}: {a.line()} ({time.perf_counter() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build", help="a finished fp8 build folder (its build.json and onnx-fp32)")
    ap.add_argument("factors", type=float, nargs="*", default=[1, 10, 0.1, 100, 1000],
                    help="activation scale factors (default: 1 10 0.1 100 1000)")
    args = ap.parse_args()
    main(args.build, args.factors)
