#!/bin/bash
# Session s26, call 5 (carry [".gpupack3"]): branch s26-ll-probe's last commit, the last block's flags stored by
# thread 0 behind lastBlockDone's fence (lastFlags) instead of a release store per flag. Builds: .gpulanes = main
# 9fd1653's GPU code, .gpuv3 = the branch, .gpuv3p = the branch with -DEPCOMM_LL_PROBE.
#   (a) goal shape (R = 2, 64 tokens, 64 experts, hidden 7168, chain 2, --iters 100): main / v3, 4 rounds
#   (b) v3 probe lines at hidden 7168 and 128; (c) standard shape R = 2, 4, 8 main / v3; (d) v3 test_gpu_ll R = 2, 4
cd "$(dirname "$0")/.."
for t in .gpupack3/*.tgz; do tar xzf $t; done
exec > >(tee -a "$OUT/s26-call5.log") 2>&1
T0=$(date +%s); el() { echo "## elapsed $(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d && echo "MPS started"
trap 'echo quit | nvidia-cuda-mps-control; echo "MPS stopped"' EXIT
b() { local d=$1 ch=$2 n=$3; shift 3; echo "### $d chain=$ch -n $n $*"
  env "$@" LD_LIBRARY_PATH=$d EPCOMM_GPU_LL_PDL_CHAIN=$ch timeout 40 .gpulanes/epcomm-run -n $n -- $d/epcomm-bench --ops ll "${BARGS[@]}" 2>&1 \
    | grep -E "^dispatch|^combine|rror"; }
echo "## (a) goal shape, chain 2: main / v3, 4 rounds"
BARGS=(--ll-tokens 64 --experts 64 --iters 100)
for i in 1 2 3 4; do for d in .gpulanes .gpuv3; do b $d 2 2; done; done; el
echo "## (b) v3 probe lines"
for H in 7168 128; do echo "### probe .gpuv3p hidden $H"
  LD_LIBRARY_PATH=.gpuv3p EPCOMM_GPU_LL_PDL_CHAIN=2 timeout 40 .gpulanes/epcomm-run -n 2 -- .gpuv3p/epcomm-bench --ops ll \
    --ll-tokens 64 --experts 64 --hidden $H --iters 50 2>&1 | grep -E "^PROBE dispatch zero-copy r|^dispatch zero-copy  " | head -14
done; el
echo "## (c) standard shape main / v3"
BARGS=(--iters 20)
for R in 2 4 8; do for d in .gpulanes .gpuv3; do b $d 1 $R; done; done; el
echo "## (d) v3 test_gpu_ll"
for R in 2 4; do
  left=$(( 185 - ($(date +%s) - T0) )); [ $left -lt 30 ] && { echo "### R=$R skipped ($left s left)"; break; }
  LD_LIBRARY_PATH=.gpuv3 EPCOMM_GPU_TEST_RANKS=$R timeout $left .gpuv3/test_gpu_ll > $OUT/v3_ll_r$R.log 2>&1
  echo "### v3 test_gpu_ll R=$R rc $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|^\[       OK \]" $OUT/v3_ll_r$R.log | tail -20; el
done
