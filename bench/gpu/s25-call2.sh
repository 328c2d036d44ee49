#!/bin/bash
# s25 call 2: branch s24-ll-writers head (.gpuwr2) against main (.gpubin) at #9's goal shape, the R = 8 tests
# that call 1's 170 s guard cut, then compute-sanitizer on test_gpu_ll at R = 2 (OOB proof first).
cd "$(dirname "$0")/.."
for t in .gpupack/main.tgz .gpupack/wr2.tgz; do tar xzf $t; done
exec > >(tee -a "$OUT/call2.log") 2>&1
T0=$(date +%s); el() { echo "## elapsed $(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d && echo "MPS started"
b() { local d=$1 ch=$2; shift 2; echo "### $d chain=$ch $*"; LD_LIBRARY_PATH=$d EPCOMM_GPU_LL_PDL_CHAIN=$ch timeout 40 .gpubin/epcomm-run "$@" -- $d/epcomm-bench --ops ll "${BARGS[@]}" 2>&1 | grep -E "^dispatch|^combine|rror"; }
echo "## goal shape (R = 2, 64 tokens, 64 experts, --iters 100), chain 2: main / wr2, 4 rounds"
BARGS=(--ll-tokens 64 --experts 64 --iters 100)
for i in 1 2 3 4; do for d in .gpubin .gpuwr2; do b $d 2 -n 2; done; done; el
echo "## standard shape R = 8 (--iters 20): main / wr2"
BARGS=(--iters 20)
for d in .gpubin .gpuwr2; do b $d 1 -n 8; done; el
F='*LateBlocks*:*Chained*:*SplitHalves*:*RejectedCalls*:*ZeroCopyCombineWithAnother*'
LD_LIBRARY_PATH=.gpuwr2 EPCOMM_GPU_TEST_RANKS=8 timeout 200 .gpuwr2/test_gpu_ll --gtest_filter="$F" > $OUT/wr2_ll_r8_rest.log 2>&1
echo "### wr2 test_gpu_ll R=8 (the 5 tests call 1 cut) rc $?"; grep -E "OK \]|FAILED|PASSED" $OUT/wr2_ll_r8_rest.log | tail -8; el
echo quit | nvidia-cuda-mps-control; echo "MPS stopped"
SAN_TESTS=test_gpu_ll OUT=$OUT timeout $(( 560 - ($(date +%s) - T0) )) bash scripts/gpu_sanitize.sh .gpuwr2 2
echo "### san rc $?"; el
