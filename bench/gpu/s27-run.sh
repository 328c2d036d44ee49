#!/bin/bash
# Staged in s26 for the next session's device calls (carry [".gpupack"]; .gpupack/STAGED says what each build is):
#   .gpumain27 = main's GPU code after s26 (lastFlags landed: 55e6648), .gpuprobe27 = branch s26-ll-probe2 (main
#   + two probe-only stamps in the zero-copy row loop: a part's destinations ready, its stores issued), probe build,
#   .gpufa = branch s26-ll-fences f5fa438 (the zero-copy entries' epoch and `routed` released by a fence and a
#   relaxed store, not a fence then a release store), .gpufab = its head (+ lastBlockDoneAcqRel: the completion
#   count an acquire-release atomic instead of a fence and a relaxed add). The branch was NOT RUN ON A GPU.
#   bash .gpupack/s27-run.sh bench (~60 s)  goal shape (R = 2, 64 tokens, 64 experts, chain 2) main / fa / fab,
#                                           4 rounds; standard shape R = 2, 4, 8; probe lines (probe27)
#   bash .gpupack/s27-run.sh suite (~480 s) test_gpu_ll: fa and fab at R = 2, main at R = 8 (lastFlags ran only
#                                           at R = 2, 4 in s26) and at R = 4 across 2 virtual hosts
#   bash .gpupack/s27-run.sh san   (~540 s) compute-sanitizer on main's test_gpu_ll at R = 2 (lastFlags has not
#                                           been under the tools)
# Land the faster of fa / fab only if it is faster than main in the same run and its tests (R = 2 here; R = 4, 8
# and the sanitizer in a later call) pass; lastBlockDoneAcqRel is an experiment: if it wins, apply it to
# lastBlockDone itself (HT and alltoallv use it too) and run their suites.
cd "$(dirname "$0")/.."
for t in .gpupack/*.tgz; do tar xzf $t; done
part=${1:-bench}
exec > >(tee -a "$OUT/s27-$part.log") 2>&1
T0=$(date +%s); el() { echo "## elapsed $(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
if [ "$part" = san ]; then
  SAN_TESTS=test_gpu_ll SAN_TOOLS="memcheck synccheck" OUT=$OUT bash scripts/gpu_sanitize.sh .gpumain27 2; echo "### rc $?"; el
  SAN_TESTS=test_gpu_ll SAN_TOOLS=racecheck FILTER='-*Sanitizer*:Fp8Conversion*' SAN_TIMEOUT=$(( 560 - ($(date +%s) - T0) )) \
    OUT=$OUT bash scripts/gpu_sanitize.sh .gpumain27 2; echo "### racecheck rc $?"; el; exit 0
fi
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d && echo "MPS started"
trap 'echo quit | nvidia-cuda-mps-control; echo "MPS stopped"' EXIT
b() { local d=$1 ch=$2 n=$3; shift 3; echo "### $d chain=$ch -n $n $*"
  env "$@" LD_LIBRARY_PATH=$d EPCOMM_GPU_LL_PDL_CHAIN=$ch timeout 40 .gpumain27/epcomm-run -n $n -- $d/epcomm-bench --ops ll "${BARGS[@]}" 2>&1 \
    | grep -E "^dispatch|^combine|rror"; }
if [ "$part" = bench ]; then
  echo "## (a) goal shape, chain 2: main / fa / fab, 4 rounds"
  BARGS=(--ll-tokens 64 --experts 64 --iters 100)
  for i in 1 2 3 4; do for d in .gpumain27 .gpufa .gpufab; do b $d 2 2; done; done; el
  echo "## (b) standard shape (128 tokens, 256 experts, --iters 20) main / fa / fab, R = 2, 4, 8"
  BARGS=(--iters 20)
  for R in 2 4 8; do for d in .gpumain27 .gpufa .gpufab; do b $d 1 $R; done; done; el
  echo "## (c) probe lines of main, goal shape, hidden 7168 then 128"
  for H in 7168 128; do echo "### probe .gpuprobe27 hidden $H"
    LD_LIBRARY_PATH=.gpuprobe27 EPCOMM_GPU_LL_PDL_CHAIN=2 timeout 40 .gpumain27/epcomm-run -n 2 -- .gpuprobe27/epcomm-bench --ops ll \
      --ll-tokens 64 --experts 64 --hidden $H --iters 50 2>&1 | grep -E "^PROBE dispatch zero-copy r|^dispatch zero-copy  " | head -14
  done; el
fi
if [ "$part" = suite ]; then
  # build ranks hosts timeout: main across 2 virtual hosts too (lastFlags changed the kX instances' flags)
  for run in "fa 2 1 100" "fab 2 1 100" "main27 8 1 250" "main27 4 2 150"; do set -- $run
    left=$(( 585 - ($(date +%s) - T0) )); [ $left -lt 40 ] && { echo "### $run skipped ($left s left)"; continue; }
    LD_LIBRARY_PATH=.gpu$1 EPCOMM_GPU_TEST_RANKS=$2 EPCOMM_GPU_TEST_HOSTS=$3 timeout $(( $4 < left ? $4 : left )) .gpu$1/test_gpu_ll \
      > $OUT/$1_ll_r$2_h$3.log 2>&1
    echo "### $1 test_gpu_ll R=$2 hosts=$3 rc $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" $OUT/$1_ll_r$2_h$3.log | tail -6; el
  done
fi
