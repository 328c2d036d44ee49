#!/bin/bash
# Session s26, call 4 (carry [".gpupack2"]): branch s26-ll-probe. Builds (scripts/gpu_stage.sh, in .gpupack2):
#   .gpulanes = main 9fd1653's GPU code (s25-ll-lanes 21b9497), .gpuprobe26 = main + finer probe stamps (publisher,
#   row blocks done, receive-side layout / recv_src_info, a fence before each block's completion), .gpuv2 = + the
#   publisher block leaves the receive side to the other receive-side blocks, .gpuv2p = that with the probe.
#   (a) goal shape (R = 2, 64 tokens, 64 experts, hidden 7168, chain 2, --iters 100): main / v2, 4 rounds
#   (b) probe lines: probe26 and v2p at hidden 7168 and 128
#   (c) v2 knobs: receive-side blocks 2, 6, 8; standard shape R = 2, 4, 8 main / v2
#   (d) v2's test_gpu_ll at R = 2, 4, then 8 while the elapsed time allows
cd "$(dirname "$0")/.."
for t in .gpupack2/*.tgz; do tar xzf $t; done
exec > >(tee -a "$OUT/s26-call4.log") 2>&1
T0=$(date +%s); el() { echo "## elapsed $(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d && echo "MPS started"
trap 'echo quit | nvidia-cuda-mps-control; echo "MPS stopped"' EXIT
b() { local d=$1 ch=$2 n=$3; shift 3; echo "### $d chain=$ch -n $n $*"
  env "$@" LD_LIBRARY_PATH=$d EPCOMM_GPU_LL_PDL_CHAIN=$ch timeout 40 .gpulanes/epcomm-run -n $n -- $d/epcomm-bench --ops ll "${BARGS[@]}" 2>&1 \
    | grep -E "^dispatch|^combine|rror"; }
echo "## (a) goal shape, chain 2: main / v2, 4 rounds"
BARGS=(--ll-tokens 64 --experts 64 --iters 100)
for i in 1 2 3 4; do for d in .gpulanes .gpuv2; do b $d 2 2; done; done; el
echo "## (b) probe lines, goal shape, chain 2"
for d in .gpuprobe26 .gpuv2p; do for H in 7168 128; do
  echo "### probe $d hidden $H"
  LD_LIBRARY_PATH=$d EPCOMM_GPU_LL_PDL_CHAIN=2 timeout 40 .gpulanes/epcomm-run -n 2 -- $d/epcomm-bench --ops ll \
    --ll-tokens 64 --experts 64 --hidden $H --iters 50 2>&1 | grep -E "^PROBE dispatch zero-copy r|^dispatch zero-copy  " | head -14
done; done; el
echo "## (c) v2 receive-side blocks; standard shape main / v2"
BARGS=(--ll-tokens 64 --experts 64 --iters 100)
for S in 2 6 8; do b .gpuv2 2 2 EPCOMM_GPU_LL_ZD_RSIDE=$S | grep -E "^###|^dispatch zero-copy  "; done
BARGS=(--iters 20)
for R in 2 4 8; do for d in .gpulanes .gpuv2; do b $d 1 $R | grep -E "^###|^dispatch zero-copy"; done; done; el
echo "## (d) v2 test_gpu_ll"
for R in 2 4 8; do
  left=$(( 520 - ($(date +%s) - T0) )); [ $R = 8 ] && [ $left -lt 200 ] && { echo "### R=8 skipped ($left s left)"; break; }
  LD_LIBRARY_PATH=.gpuv2 EPCOMM_GPU_TEST_RANKS=$R timeout $([ $R = 8 ] && echo $left || echo 150) .gpuv2/test_gpu_ll > $OUT/v2_ll_r$R.log 2>&1
  echo "### v2 test_gpu_ll R=$R rc $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|^\[       OK \]" $OUT/v2_ll_r$R.log | tail -20; el
done
