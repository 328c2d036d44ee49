#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck) on the GPU suite's multi-rank tests, ranks under a private
# MPS daemon. Rank processes are forked without exec, so the run first proves that the tool instruments every
# rank: rank 1 writes past the end of a buffer and memcheck must report it.
#   scripts/gpu_sanitize.sh [BIN_DIR] [ranks]      (defaults: .gpubin, 2); logs in $OUT (default /tmp/epcomm-san)
# FILTER: a gtest filter (default: every test but the proof); SAN_TESTS: the binaries (default: test_gpu_ll test_gpu_ht);
# SAN_TOOLS: the tools (default: memcheck racecheck synccheck); SAN_ARGS: more compute-sanitizer options (e.g.
# "--report-api-errors no", where a test makes CUDA calls fail on purpose). The tools slow the ranks tenfold and more, so the
# tests' short deadlines (rendezvous, stalled peers) are scaled by EPCOMM_GPU_TEST_DEADLINE_SCALE (default 10 here).
set -uo pipefail
BIN=${1:-.gpubin}
export EPCOMM_GPU_TEST_RANKS=${2:-2}
OUT=${OUT:-/tmp/epcomm-san}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$BIN:${LD_LIBRARY_PATH:-}"
export EPCOMM_GPU_TEST_DEADLINE_SCALE=${EPCOMM_GPU_TEST_DEADLINE_SCALE:-10}
S=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
[ -n "$S" ] || { echo "no compute-sanitizer"; exit 77; }
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/mps-pipe.XXXX) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/mps-log.XXXX)
nvidia-cuda-mps-control -d
trap 'echo quit | nvidia-cuda-mps-control' EXIT
echo "== proof: rank 1 writes out of bounds; memcheck must report it"
EPCOMM_GPU_TEST_OOB_RANK=1 timeout 120 "$S" --tool memcheck --target-processes all "$BIN/test_gpu_ll" \
  --gtest_filter='*SanitizerSeesEveryRank*' > "$OUT/san_proof.log" 2>&1
grep -E "Invalid __global__ write|rank [0-9]+ \(pid|ERROR SUMMARY" "$OUT/san_proof.log"
rc=0
for tool in ${SAN_TOOLS:-memcheck racecheck synccheck}; do
  for t in ${SAN_TESTS:-test_gpu_ll test_gpu_ht}; do
    echo "== $tool $t"
    EPCOMM_GPU_TEST_REPLAYS=10 EPCOMM_GPU_TEST_LATE_OPS=40 EPCOMM_GPU_TEST_CHAIN_OPS=40 timeout ${SAN_TIMEOUT:-300} "$S" --tool $tool --target-processes all ${SAN_ARGS:-} \
      --error-exitcode 3 "$BIN/$t" --gtest_filter="${FILTER:--*Sanitizer*}" > "$OUT/san_${tool}_$t.log" 2>&1
    r=$?
    echo "exit $r"
    [ $r -ne 0 ] && rc=$r
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|\[  PASSED|\[  FAILED" "$OUT/san_${tool}_$t.log" | sort | uniq -c
  done
done
exit $rc
