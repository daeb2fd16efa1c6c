#!/usr/bin/env bash
# One prepared device call: the GPU tests of the runtime, the triton backend on the embedded default, the
# MoE AOT sub-op chain as TensorRT launches it, then the end-to-end bench (bench/e2e_gpu.sh).
#   bash gpu_checks/device_run.sh [E2E_BUDGET_S, 0 = checks only]
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/clover_device}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1  # the package from this checkout
E2E="${1:-280}"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  echo "== triton backend on the embedded default"; timeout -k 5 100 python3 gpu_checks/triton_backend_gpu.py --dtype fp32; echo "rc $?"
  echo "== MoE AOT sub-op chain"; timeout -k 5 90 python3 gpu_checks/moe_trt_chain_gpu.py; echo "rc $?"
  echo "== runtime CUDA tests"; timeout -k 5 80 python3 -m pytest -q -p no:cacheprovider -x tests/runtime/test_runtime_cuda.py 2>&1 | tail -15; echo "rc $?"
} 2>&1 | tee "$OUT/device_checks.log"
if [ "$E2E" != 0 ]; then
  echo "== e2e"; bash bench/e2e_gpu.sh --budget-s "$E2E" > "$OUT/e2e_stdout.log" 2>&1; echo "e2e rc $?"; tail -40 "$OUT/e2e_stdout.log"
fi
ls "$OUT"
