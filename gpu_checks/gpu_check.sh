#!/usr/bin/env bash
# One prepared GPU check of the plugin kernels (gpu_checks/README.md, "gpu_check").
#
#   bash gpu_checks/gpu_check.sh [--no-sweep] [--budget SECONDS]
#
# Run from anywhere inside the repository on a machine with a CUDA GPU, torch, Triton and (ideally) CuPy;
# TensorRT is not needed. Prints PASS/FAIL/SKIP/BENCH lines and a summary; writes $OUT/gpu_check.log,
# $OUT/gpu_check_results.json (rewritten after every step) and $OUT/ptx/. Without $OUT: /tmp/clover_gpu_check.
# Wall time: about 5-7 minutes on an H200 (mostly Triton compiling); the Python part is killed at 460 s
# and skips late benchmarks once its budget (default 400 s) runs low, so the whole script stays under 8 minutes.
# Optional, on the project machine before: python -m clover_export.plugins.triton.aot --out gpu_checks/ptx --arch 90 --trt-only
# (then gpu_checks/ptx travels with the tree and that PTX, built by the project's Triton, is launched too).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/clover_gpu_check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
{
  echo "== $(date -u +%FT%TZ) clover-export GPU check"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
      --format=csv || echo "FAIL nvidia-smi query"
  else
    echo "FAIL nvidia-smi not found (continuing: torch decides whether there is a GPU)"
  fi
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())" \
    || echo "FAIL python with torch and triton"
  if "$PY" -c "import cupy; print('cupy', cupy.__version__)" 2>/dev/null; then :; else
    echo "NOTE cupy missing: the AOT PTX is launched through libcuda (ctypes) instead"
  fi
  export TRITON_DEFAULT_FP_FUSION=1
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this checkout, installed or not
  timeout -k 10 460 "$PY" -u gpu_checks/gpu_check.py --out "$OUT" "$@"
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "FAIL gpu_check.py hit the 460 s timeout (partial results in $OUT/gpu_check_results.json)"
  fi
  echo "gpu_check.py exit code $rc"
} 2>&1 | tee "$OUT/gpu_check.log"
