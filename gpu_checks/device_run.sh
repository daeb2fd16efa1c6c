#!/usr/bin/env bash
# One prepared device call, within a deadline (default 450 s), stages in order of what they prove:
#   1. the runtime's CUDA tests (tests/runtime/test_runtime_cuda.py)
#   2. the plugin kernels at layer sizes against their cores (gpu_check.sh --no-sweep)
#   3. the triton backend's greedy tokens in every decoding mode against the torch backend (triton_backend_gpu.py)
#   4. `clover-export serve --backend triton` through the openai client (serve_triton_gpu.py)
#   5. the end-to-end bench: every step against its bound, tokens/s, self_spec (bench/e2e_gpu.py)
#   6. with the time left: the MoE AOT sub-op chain, then bench/step_bound.py's per-kernel profile
# Each stage gets the smaller of its own cap and the time left; one that does not fit is skipped with a line.
# Output: $OUT/device_run.log (everything printed) and $OUT/device_run.tgz (every stage's files).
#   bash gpu_checks/device_run.sh [DEADLINE_S]
#   STAGES="kernels moe" KERNEL_BUDGET=200 bash gpu_checks/device_run.sh 300   # a rerun of some stages
# Stage ids: cuda_tests kernels backend serve e2e moe profile (STAGES empty: all). KERNEL_BUDGET: gpu_check.py's
# own budget (default 80 s, no tile sweeps; past 150 s the sweeps run too).
# The serve stage needs FastAPI, uvicorn, pydantic, openai and llguidance; where the machine lacks them, wheels
# in .whl/ are installed to /tmp/site first (gpu_checks/README.md says how to fetch them).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/clover_device}"; mkdir -p "$OUT"
WORK="$(mktemp -d /tmp/clover_device_run.XXXX)"
END=$(( $(date +%s) + ${1:-450} ))
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || echo "FAIL installing the wheels in .whl/"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this checkout

left() { echo $(( END - $(date +%s) )); }
# stage ID NAME CAP_S MIN_S COMMAND...: runs COMMAND under min(CAP_S, time left - 10), or skips it below MIN_S
stage() {
  local id="$1" name="$2" cap="$3" min="$4"; shift 4
  case " ${STAGES:-$id} " in *" $id "*) ;; *) return ;; esac
  local t=$(( $(left) - 10 )); [ "$t" -gt "$cap" ] && t="$cap"
  if [ "$t" -lt "$min" ]; then echo "SKIP $name: ${t} s left of the deadline, needs ${min} s"; return; fi
  echo "== $name (up to ${t} s, $(date -u +%T))"
  local s=$(date +%s)
  timeout -k 5 "$t" "$@"
  local rc=$?
  echo "== $name: rc $rc in $(( $(date +%s) - s )) s"
}

{
  echo "== $(date -u +%FT%TZ) clover-export device run"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  stage cuda_tests "runtime CUDA tests" 60 20 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_runtime_cuda.py
  kb=${KERNEL_BUDGET:-80}; sweep=(); [ "$kb" -le 150 ] && sweep=(--no-sweep)
  stage kernels "kernels at layer sizes" $(( kb + 40 )) 60 env OUT="$WORK/gpu_check" bash gpu_checks/gpu_check.sh "${sweep[@]}" --budget "$kb"
  stage backend "triton backend, every mode" 120 60 python3 gpu_checks/triton_backend_gpu.py --dtype fp32
  stage serve "serve --backend triton" 130 60 python3 gpu_checks/serve_triton_gpu.py --log "$WORK/serve.log"
  budget=$(( $(left) - 40 )); [ "$budget" -gt 300 ] && budget=300
  stage e2e "e2e bench" $(( budget + 30 )) 90 env OUT="$WORK/e2e" bash bench/e2e_gpu.sh --budget-s "$budget"
  stage moe "MoE AOT sub-op chain" 60 40 python3 gpu_checks/moe_trt_chain_gpu.py
  budget=$(( $(left) - 30 ))
  stage profile "step bound profile" $(( budget + 20 )) 90 env OUT="$WORK/step_bound" bash bench/step_bound.sh --budget "$budget" --routers random
  echo "== done $(date -u +%T), $(left) s before the deadline"
} 2>&1 | tee "$OUT/device_run.log"
tar -czf "$OUT/device_run.tgz" -C "$WORK" --exclude='*.ptx' --exclude='*.cubin' . 2>/dev/null
ls -la "$OUT"
