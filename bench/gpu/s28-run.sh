#!/bin/bash
# The next session's device calls (written in s27, when no device was lent; s27's staged builds and branches did not
# survive into a fresh checkout, so this builds main on the device: build-gpu/, staged into .gpumain).
#   bash bench/gpu/s28-run.sh bench  (build + ~90 s)  issue 9's goal shape (R = 2, 64 tokens, 64 experts, hidden
#                                    7168, chain 2), 4 rounds: on an H200 this answers "<= 13 us" for the zero-copy
#                                    dispatch (14.0 on an H100 in s26); the standard shape at R = 2, 4, 8
#   bash bench/gpu/s28-run.sh suite  (~480 s) test_gpu_ll at R = 8 and at R = 4 across 2 virtual hosts (s26's
#                                    lastFlags, 55e6648, ran only at R = 2, 4 on one host), test_gpu_ht at R = 2
#   bash bench/gpu/s28-run.sh san    (~540 s) compute-sanitizer on test_gpu_ll at R = 2 (lastFlags has not been under
#                                    the tools), with the out-of-bounds proof
#   bash bench/gpu/s28-run.sh host   (~240 s) bench/net/host_xhost_diag.sh: issue 12's host engine on the 16 cores
# Run bench first (it builds); the others reuse .gpumain while the machine stays warm, else build again.
cd "$(dirname "$0")/../.."
part=${1:-bench}
OUT=${OUT:-/tmp/s28}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/s28-$part.log") 2>&1
source bench/gpu/common.sh
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
if [ "$part" = host ]; then OUT=$OUT bash bench/net/host_xhost_diag.sh; el; exit 0; fi
gpu_build .gpumain || { echo "### build failed"; exit 1; }; el
if [ "$part" = san ]; then
  SAN_TESTS=test_gpu_ll SAN_TOOLS="memcheck synccheck" OUT=$OUT bash scripts/gpu_sanitize.sh .gpumain 2; echo "### rc $?"; el
  SAN_TESTS=test_gpu_ll SAN_TOOLS=racecheck FILTER='-*Sanitizer*:Fp8Conversion*' SAN_TIMEOUT=$(( 560 - ($(date +%s) - T0) )) \
    OUT=$OUT bash scripts/gpu_sanitize.sh .gpumain 2; echo "### racecheck rc $?"; el; exit 0
fi
mps_start
if [ "$part" = bench ]; then
  echo "## (a) goal shape, chain 2, 4 rounds"
  BARGS=(--ll-tokens 64 --experts 64 --iters 100)
  for i in 1 2 3 4; do b .gpumain 2 2; done; el
  echo "## (b) standard shape (128 tokens, 256 experts, --iters 20), R = 2, 4, 8"
  BARGS=(--iters 20)
  for R in 2 4 8; do b .gpumain 1 $R; done; el
fi
if [ "$part" = suite ]; then
  for run in "ll 8 1 250" "ll 4 2 150" "ht 2 1 120"; do set -- $run
    left=$(( 585 - ($(date +%s) - T0) )); [ $left -lt 40 ] && { echo "### $run skipped ($left s left)"; continue; }
    LD_LIBRARY_PATH=.gpumain EPCOMM_GPU_TEST_RANKS=$2 EPCOMM_GPU_TEST_HOSTS=$3 timeout $(( $4 < left ? $4 : left )) \
      .gpumain/test_gpu_$1 > $OUT/$1_r$2_h$3.log 2>&1
    echo "### test_gpu_$1 R=$2 hosts=$3 rc $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" $OUT/$1_r$2_h$3.log | tail -6; el
  done
fi
