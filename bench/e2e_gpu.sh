#!/usr/bin/env bash
# End-to-end GPU run of the `triton` backend (bench/README.md, "e2e_gpu").
#
#   bash bench/e2e_gpu.sh [e2e_gpu.py options, e.g. --budget-s 380 --no-fp8]
#
# From anywhere inside the repository on a machine with one CUDA GPU (~110 GB free: 69 GB of bf16
# weights, then 32 GB of FP8 experts beside them, pools for 64 rows), torch and Triton. Writes
# $OUT/e2e_gpu.{log,json,md} (json rewritten after every measurement) and copies them to
# bench/results/ (without $OUT: bench/results/ only). The Python part skips sections once its budget
# (default 400 s) runs low and is killed at 450 s, so the script stays under 8 minutes.
# On the lent H200 (device tool): run(command="bash bench/e2e_gpu.sh", timeout_s=540).
set -u
cd "$(dirname "$0")/.."
RESULTS="$PWD/bench/results"
OUT="${OUT:-$RESULTS}"
mkdir -p "$OUT" "$RESULTS"
PY="${PYTHON:-python3}"
{
  echo "== $(date -u +%FT%TZ) clover-export e2e GPU run"
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version \
    --format=csv || echo "NOTE nvidia-smi not found (torch decides whether there is a GPU)"
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())" \
    || echo "FAIL python with torch and triton"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this checkout, installed or not
  timeout -k 10 450 "$PY" -u bench/e2e_gpu.py --out "$OUT" "$@"
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "FAIL e2e_gpu.py hit the 450 s timeout (partial results in $OUT/e2e_gpu.json)"
  fi
  echo "e2e_gpu.py exit code $rc"
} 2>&1 | tee "$OUT/e2e_gpu.log"
if [ "$OUT" != "$RESULTS" ]; then
  stamp="$(date -u +%F)"
  for f in e2e_gpu.log e2e_gpu.json e2e_gpu.md; do
    [ -f "$OUT/$f" ] && cp "$OUT/$f" "$RESULTS/${f%%.*}_$stamp.${f#*.}"
  done
fi
