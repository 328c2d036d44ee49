#!/bin/bash
# Session s28's device calls, on builds staged here (carry [".gpupack"]; ~50 MB, debug info stripped):
#   .gpupack/main   = main d096db1 (GPU code of 05b0b34): epcomm-bench, libepcomm, cudart
#   .gpupack/fences = branch s28-ll-fences (LL zero-copy dispatch: the entries' epoch and `routed` released by one
#                     fence and a strong store): the same plus epcomm-run, test_gpu_ll, test_gpu_ht
#   bash bench/gpu/s28-ab.sh ab     (~150 s) issue 9's goal shape (R = 2, 64 tokens, 64 experts, hidden 7168, chain
#                                   2), main and fences alternating, 4 rounds; the standard shape at R = 2, 4, 8 once
#                                   each; then test_gpu_ll (fences) at R = 8 and at R = 4 across 2 virtual hosts, and
#                                   test_gpu_ht at R = 2, while the call's 585 s last
#   bash bench/gpu/s28-ab.sh san    (~540 s) compute-sanitizer on the fences test_gpu_ll at R = 2 with the proof
#   bash bench/gpu/s28-ab.sh one    (~480 s) all in one call, for a session whose device starts keep failing: the
#                                   goal shape 3 rounds, the standard shape at R = 8, the fences test_gpu_ll at R = 8,
#                                   then memcheck and synccheck (with the proof) on it at R = 2
cd "$(dirname "$0")/../.."
part=${1:-ab}
source bench/gpu/common.sh
gpu_log s28 $part
M=.gpupack/main F=.gpupack/fences
cp -n $F/epcomm-run $M/  # the launcher does not depend on the kernels
if [ "$part" = san ]; then san_ll $F; exit 0; fi
if [ "$part" = one ]; then
  ( mps_start
    BARGS=(--ll-tokens 64 --experts 64 --iters 100)
    echo "## (a) goal shape, chain 2, 3 rounds, main / fences alternating"
    for i in 1 2 3; do if [ $((i % 2)) = 1 ]; then b $M 2 2; b $F 2 2; else b $F 2 2; b $M 2 2; fi; done; el
    BARGS=(--iters 20)
    echo "## (b) standard shape (128 tokens, 256 experts, --iters 20), R = 8"; b $M 1 8; b $F 1 8; el
    LD_LIBRARY_PATH=$F EPCOMM_GPU_TEST_RANKS=8 timeout 230 $F/test_gpu_ll > $OUT/ll_r8.log 2>&1
    echo "### fences test_gpu_ll R=8 rc $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" $OUT/ll_r8.log | tail -6; el )
  SAN_TESTS=test_gpu_ll SAN_TOOLS="memcheck synccheck" SAN_TIMEOUT=$(( (575 - ($(date +%s) - T0)) / 2 - 20 )) OUT=$OUT \
    bash scripts/gpu_sanitize.sh $F 2; echo "### san rc $?"; el; exit 0
fi
mps_start
echo "## (a) goal shape, chain 2, 4 rounds, main / fences alternating"
BARGS=(--ll-tokens 64 --experts 64 --iters 100)
for i in 1 2 3 4; do
  if [ $((i % 2)) = 1 ]; then b $M 2 2; b $F 2 2; else b $F 2 2; b $M 2 2; fi
done; el
echo "## (b) standard shape (128 tokens, 256 experts, --iters 20), R = 2, 4, 8"
BARGS=(--iters 20)
for R in 2 4 8; do b $M 1 $R; b $F 1 $R; done; el
suite $F fences
