#!/bin/bash
# s25 call 3: goal-shape bench main / wr2 again (whatever card comes), then compute-sanitizer on .gpuwr2's
# test_gpu_ll at R = 2: memcheck + synccheck on RecoveryWithoutADeath with the deadlines scaled (call 2's run had
# them unscaled: its rendezvous timed out under the tool), racecheck on every test but the proof and the
# single-process fp8 table (115 s under racecheck in call 2).
cd "$(dirname "$0")/.."
for t in .gpupack/main.tgz .gpupack/wr2.tgz; do tar xzf $t; done
exec > >(tee -a "$OUT/call3.log") 2>&1
T0=$(date +%s); el() { echo "## elapsed $(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d && echo "MPS started"
b() { local d=$1 ch=$2; shift 2; echo "### $d chain=$ch $*"; LD_LIBRARY_PATH=$d EPCOMM_GPU_LL_PDL_CHAIN=$ch timeout 40 .gpubin/epcomm-run "$@" -- $d/epcomm-bench --ops ll "${BARGS[@]}" 2>&1 | grep -E "^dispatch|^combine|rror"; }
BARGS=(--ll-tokens 64 --experts 64 --iters 100)
for i in 1 2 3; do for d in .gpubin .gpuwr2; do b $d 2 -n 2; done; done; el
echo quit | nvidia-cuda-mps-control; echo "MPS stopped"
SAN_TESTS=test_gpu_ll SAN_TOOLS="memcheck synccheck" FILTER='*RecoveryWithoutADeath*' OUT=$OUT bash scripts/gpu_sanitize.sh .gpuwr2 2
echo "### san memcheck+synccheck Recovery rc $?"; el
SAN_TESTS=test_gpu_ll SAN_TOOLS=racecheck FILTER='-*Sanitizer*:Fp8Conversion*' SAN_TIMEOUT=$(( 540 - ($(date +%s) - T0) )) OUT=$OUT bash scripts/gpu_sanitize.sh .gpuwr2 2
echo "### san racecheck rc $?"; el
