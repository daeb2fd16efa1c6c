#!/usr/bin/env bash
# One prepared H200 run of bench/step_bound.py (PERF.md 1-3): whole steps vs their memory bound.
#
#   bash bench/step_bound.sh [--budget SECONDS] [--routers random,zipf]
#
# Run from anywhere inside the repository on a machine with a CUDA GPU (>= 110 GB free: 69 GB bf16
# weights + 32 GB FP8 expert twins), torch and Triton; TensorRT is not needed. Writes
# $OUT/step_bound_<gpu>.json, $OUT/step_bound_<gpu>_profile.txt and $OUT/step_bound.log, and copies the
# first two to bench/results/. Without $OUT: /tmp/clover_step_bound. Wall time about 5-7 minutes on an
# H200 (Triton compiling + weight init + the kernel variants); the Python part is killed at 390 s and
# skips scenarios past its budget (default 330 s; the variants run first), so the whole script stays under 7 minutes.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/clover_step_bound}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
{
  echo "== $(date -u +%FT%TZ) clover-export step bound"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.mem --format=csv \
      || echo "FAIL nvidia-smi query"
  fi
  export TRITON_DEFAULT_FP_FUSION=1
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this checkout, installed or not
  timeout -k 10 390 "$PY" -u bench/step_bound.py --out "$OUT" --budget 330 "$@"
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "FAIL step_bound.py hit the 390 s timeout (partial results in $OUT/step_bound_*.json)"
  fi
  echo "step_bound.py exit code $rc"
} 2>&1 | tee "$OUT/step_bound.log"
