#!/usr/bin/env bash
# Runs the GPU suite and the GPU benchmark on a machine with one (or more) GPUs, ranks as processes under a
# private CUDA MPS daemon (started here, stopped on exit).
#   scripts/gpu_run.sh [BIN_DIR] [test|bench|all] [ranks, e.g. "2,4,8"]
# BIN_DIR holds test_gpu_ht, test_gpu_ll, epcomm-bench, epcomm-run and libepcomm.so* (scripts/gpu_stage.sh fills one
# from a build); default: build/.
set -uo pipefail
BIN=${1:-build}
WHAT=${2:-all}
RANKS=${3:-2,4,8}
OUT=${OUT:-/tmp/epcomm-gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$BIN:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true

# NO_MPS=1: one rank per GPU, no MPS (several GPUs).
if [ "${NO_MPS:-0}" != 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/mps-pipe.XXXX) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/mps-log.XXXX)
  nvidia-cuda-mps-control -d && echo "MPS daemon started"
  trap 'echo quit | nvidia-cuda-mps-control; echo "MPS daemon stopped"' EXIT
fi

rc=0
if [ "$WHAT" = test ] || [ "$WHAT" = all ]; then
  for t in ${GPU_TESTS:-test_gpu_ht test_gpu_ll}; do
    EPCOMM_GPU_TEST_RANKS=$RANKS timeout ${GPU_TEST_TIMEOUT:-1200} "$BIN/$t" ${GTEST_ARGS:-} 2>&1 | tee -a "$OUT/gpu_tests.log" | grep -vE "^\[ *RUN|^vm|WARN"
    trc=${PIPESTATUS[0]}
    echo "$t exit code: $trc"
    [ "$trc" -ne 0 ] && rc=$trc
  done
  echo "gpu suite exit code: $rc"
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  IFS=, read -ra RS <<< "$RANKS"
  for r in "${RS[@]}"; do
    timeout 300 "$BIN/epcomm-run" -n "$r" -- "$BIN/epcomm-bench" ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/gpu_bench.log"
  done
fi
exit $rc
