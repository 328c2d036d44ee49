#!/bin/bash
# Staged in s25 for the next session's device calls (carry [".gpupack"]). Builds in .gpupack (see STAGED):
#   .gpubin = main 380f58d (LL before c0e393a), .gpuwr2 = main's LL as landed (c0e393a), .gpuprobe25 = that with
#   -DEPCOMM_LL_PROBE, .gpulanes = branch s25-ll-lanes (c0e393a + the plain dispatch's destinations in registers;
#   NOT RUN ON A GPU when staged).
#   bash .gpupack/s26-run.sh bench  (~120 s) goal shape: landed / before / lanes, 3 rounds (an H200 answers #9's
#                                   <= 13 us for the landed zero-copy dispatch); standard shape R = 2, 4, 8 landed /
#                                   lanes; knob sweep of the landed build; probe at hidden 7168 and 128; the
#                                   host engine across 2 virtual hosts at R = 4, 8 (issue 12's xhost/raw on 16 cores)
#   bash .gpupack/s26-run.sh suite  (~350 s) .gpulanes' test_gpu_ll at R = 2, 4, 8 (R = 8 needs ~250 s on an H100)
#   bash .gpupack/s26-run.sh san    (~420 s) compute-sanitizer on .gpulanes' test_gpu_ll at R = 2
# Land s25-ll-lanes if its suite and sanitizer pass and its plain dispatch rows are no slower.
cd "$(dirname "$0")/.."
for t in .gpupack/*.tgz; do tar xzf $t; done
part=${1:-bench}
exec > >(tee -a "$OUT/s26-$part.log") 2>&1
T0=$(date +%s); el() { echo "## elapsed $(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
if [ "$part" = san ]; then
  SAN_TESTS=test_gpu_ll SAN_TOOLS="memcheck synccheck" OUT=$OUT bash scripts/gpu_sanitize.sh .gpulanes 2; echo "### rc $?"; el
  SAN_TESTS=test_gpu_ll SAN_TOOLS=racecheck FILTER='-*Sanitizer*:Fp8Conversion*' SAN_TIMEOUT=$(( 560 - ($(date +%s) - T0) )) \
    OUT=$OUT bash scripts/gpu_sanitize.sh .gpulanes 2; echo "### racecheck rc $?"; el; exit 0
fi
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d && echo "MPS started"
trap 'echo quit | nvidia-cuda-mps-control; echo "MPS stopped"' EXIT
# b DIR CHAIN RANKS [VAR=VALUE ...]: the LL rows of DIR's bench with BARGS
b() { local d=$1 ch=$2 n=$3; shift 3; echo "### $d chain=$ch -n $n $*"
  env "$@" LD_LIBRARY_PATH=$d EPCOMM_GPU_LL_PDL_CHAIN=$ch timeout 40 .gpubin/epcomm-run -n $n -- $d/epcomm-bench --ops ll "${BARGS[@]}" 2>&1 \
    | grep -E "^dispatch|^combine|rror"; }
if [ "$part" = bench ]; then
  echo "## (a) goal shape (R = 2, 64 tokens, 64 experts, --iters 100), chain 2: landed / before / lanes, 3 rounds"
  BARGS=(--ll-tokens 64 --experts 64 --iters 100)
  for i in 1 2 3; do for d in .gpuwr2 .gpubin .gpulanes; do b $d 2 2; done; done; el
  echo "## (b) standard shape (128 tokens, 256 experts, --iters 20): landed / lanes, R = 2, 4, 8, 2 rounds"
  BARGS=(--iters 20)
  for i in 1 2; do for R in 2 4 8; do for d in .gpuwr2 .gpulanes; do b $d 1 $R; done; done; done; el
  echo "## (c) knobs of the landed build at the goal shape (blocks x parts x receive-side blocks), chain 2"
  BARGS=(--ll-tokens 64 --experts 64 --iters 100)
  for B in 34 40 44; do for P in 16 32; do for S in -1 2 6; do
    b .gpuwr2 2 2 EPCOMM_GPU_LL_BLOCKS=$B EPCOMM_GPU_LL_ZD_PARTS=$P EPCOMM_GPU_LL_ZD_RSIDE=$S | grep -E "^###|^dispatch zero-copy  "
  done; done; done; el
  echo "## (d) probe of the landed build (-DEPCOMM_LL_PROBE), goal shape, hidden 7168 then 128, chain 2"
  for H in 7168 128; do
    echo "### probe hidden $H"
    LD_LIBRARY_PATH=.gpuprobe25 EPCOMM_GPU_LL_PDL_CHAIN=2 timeout 40 .gpubin/epcomm-run -n 2 -- .gpuprobe25/epcomm-bench --ops ll \
      --ll-tokens 64 --experts 64 --hidden $H --iters 50 2>&1 | grep -E "^PROBE dispatch zero-copy r|^dispatch zero-copy  " | head -12
  done; el
  echo "## (e) host engine across 2 virtual hosts on the 16-core host (issue 12's xhost/raw; 2-core VM: 0.19-0.21 at R = 4)"
  for R in 4 8; do
    echo "### host engine --hosts 2 -n $R"
    EPCOMM_ENGINE=host EPCOMM_NET=socket LD_LIBRARY_PATH=.gpuwr2 timeout 120 .gpubin/epcomm-run --hosts 2 -n $R -- .gpuwr2/epcomm-bench \
      --ops ht,ll --hidden 2048 --ht-tokens 1024 --topk 8 --experts 256 --iters 5 --warmup 1 2>&1 | grep -vE "WARN|^$" | tail -12
  done; el
fi
if [ "$part" = suite ]; then
  for R in 2 4 8; do
    LD_LIBRARY_PATH=.gpulanes EPCOMM_GPU_TEST_RANKS=$R timeout $([ $R = 8 ] && echo 280 || echo 150) .gpulanes/test_gpu_ll > $OUT/lanes_ll_r$R.log 2>&1
    echo "### lanes test_gpu_ll R=$R rc $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" $OUT/lanes_ll_r$R.log | tail -6; el
  done
fi
