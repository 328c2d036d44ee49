#!/bin/bash
# s30's device call, on a build made here and carried (carry [".gpupack"]):
#   bash scripts/gpu_stage.sh build-gpu .gpupack/new && strip --strip-debug .gpupack/new/*
#   bash bench/gpu/s30-run.sh PART [DIR]   (DIR default .gpupack/new)
# first: (1) test_gpu_ht's implicit-registration, bit-exact and graph-replay tests at R = 2 and 8; (2) issue 11's
#   HT shapes with implicit registration on (the default) and off (EPCOMM_GPU_HT_AUTO_REGISTER=0) in turn, R = 8
#   three rounds; (3) the whole of test_gpu_ht at R = 4, then at R = 2 across 2 virtual hosts (~100 s on an H100).
# verify: the whole of test_gpu_ht at R = 2, 4 and 8 (but the two-host test); issue 11's HT shapes on / off once,
#   and R = 8 with 128 tokens (where the host-side lookup would show); then compute-sanitizer memcheck of
#   test_gpu_ht's implicit and bit-exact tests at R = 2, after the proof that it instruments every rank (needs
#   test_gpu_ll staged too), while the call's LIMIT (560) s last.
cd "$(dirname "$0")/../.."
part=${1:-first}; D=${2:-.gpupack/new}
source bench/gpu/common.sh
gpu_log s30 $part
# torchseg: where PyTorch's caching allocator puts tensors of a combine's x sizes (and smaller): whether each
#   segment starts a 2 MiB page, which implicit registration needs (registry_implicit.cc).
if [ "$part" = torchseg ]; then
  python3 - <<'PY'
import torch
ts = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in
      (4096 * 8 * 7168 * 2, 33 * 7168 * 2, 600 * 7168 * 2, 1 << 20, 300 << 10, 4096)]
segs = torch.cuda.memory_snapshot()
for t in ts:
    p = t.data_ptr()
    s = next(s for s in segs if s["address"] <= p < s["address"] + s["total_size"])
    print(f"tensor {t.numel():>10} B: segment {s['segment_type']:5} {s['total_size']:>10} B at {s['address']:#x}, "
          f"starts a 2 MiB page: {s['address'] % (2 << 20) == 0}")
PY
  exit 0
fi
# pages: whether CUDA puts small cudaMallocs into the tail page of a large one (3 MiB + 16 bytes) or beside a small
#   one that starts a page (implicit registration takes allocations of 2 MiB or more that start a page).
if [ "$part" = pages ]; then
  python3 - <<'PY'
import ctypes, glob
rt = ctypes.CDLL(sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so*") + glob.glob(".gpupack/new/libcudart.so*"))[0])
def alloc(n):
    p = ctypes.c_void_p()
    assert rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(n)) == 0
    return p.value
P = 2 << 20
for big_n in (3 * (1 << 20) + 16, 512 << 10):
    big = alloc(big_n)
    end = (big + big_n + P - 1) // P * P
    smalls = [alloc(n) for n in [4096, 65536, 300 << 10] * 8]
    inside = [hex(a) for a in smalls if big <= a < end]
    print(f"allocation of {big_n} B at {big:#x} (starts a 2 MiB page: {big % P == 0}); "
          f"{len(inside)} of {len(smalls)} later small allocations in its pages {inside[:4]}")
PY
  exit 0
fi
[ -x $D/epcomm-bench ] || { echo "### $D has no staged build"; exit 1; }
onoff() {  # ROUNDS: issue 11's HT shapes, implicit registration on and off in turn; R = 2 and 4 in round 1 only
  echo "## (d) HT at issue 11's shapes (4096 tokens, hidden 7168, top-8, 256 experts), implicit registration 1 / 0"
  for i in $(seq $1); do for a in "8 16" "8 14" "2 24" "4 24" ${SMALL:+"8 16 128"}; do set -- $a
    [ $i -gt 1 ] && [ $1 != 8 ] && continue
    for v in 1 0; do echo "### round $i HT R=$1 sms=$2 tokens=${3:-4096} auto=$v"
      EPCOMM_GPU_HT_AUTO_REGISTER=$v LD_LIBRARY_PATH=$D timeout 60 $D/epcomm-run -n $1 -- $D/epcomm-bench --ops ht \
        --iters 20 --warmup 5 --sms $2 --ht-tokens ${3:-4096} 2>&1 | grep -E "^HT |rror|^epcomm-bench"; done; done; el; done
}
htsome() {  # R LIMIT FILTER: test_gpu_ht's tests matching FILTER
  LD_LIBRARY_PATH=$D EPCOMM_GPU_TEST_RANKS=$1 timeout $2 $D/test_gpu_ht --gtest_filter="$3" > $OUT/ht_r$1.log 2>&1
  echo "### test_gpu_ht R=$1 rc $?"
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|read x in place|^\[       OK \]" $OUT/ht_r$1.log | tail -16; el
}
htall() {  # R HOSTS LIMIT: the whole of test_gpu_ht
  local left=$(( 560 - ($(date +%s) - T0) )); [ $left -lt 40 ] && { echo "### test_gpu_ht R=$1 hosts=$2 skipped"; return; }
  LD_LIBRARY_PATH=$D EPCOMM_GPU_TEST_RANKS=$1 EPCOMM_GPU_TEST_HOSTS=$2 timeout $(( $3 < left ? $3 : left )) \
    $D/test_gpu_ht --gtest_filter="${FILTER:-*}" > $OUT/ht_all_r$1_h$2.log 2>&1
  echo "### test_gpu_ht (all) R=$1 hosts=$2 rc $?"
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|^\[       OK \]|read x in place" $OUT/ht_all_r$1_h$2.log | tail -24
  grep -c "already mapped" $OUT/ht_all_r$1_h$2.log | sed 's/^/### "already mapped" lines: /'; el
}
# san: compute-sanitizer memcheck, racecheck and synccheck on test_gpu_ht's implicit, bit-exact and graph tests at
#   R = 2 (proof first: needs test_gpu_ll staged). The implicit path's lazy mapping can meet allocations their owner
#   already freed: cudaIpcOpenMemHandle refuses them (cudaErrorInvalidValue, handled: a refusal is acknowledged),
#   which memcheck counts as API errors (2 in call 3, before allocations under 2 MiB were left out; 0 in call 8);
#   memcheck runs once with and once without --report-api-errors.
# bench: issue 11's shapes on / off, ROUNDS (default 2) rounds at R = 8 (~30 s a round on an H100).
if [ "$part" = bench ]; then ( mps_start; onoff ${ROUNDS:-2} ); exit 0; fi
# recheck: after the review's fixes, test_gpu_ht's implicit, bit-exact and graph tests at R = 2 and 8, one bench
#   round on / off, and the pages check.
if [ "$part" = recheck ]; then
  ( mps_start
    for R in 2 8; do htsome $R 100 '*Implicit*:*BitExact*:*GraphReplay*:*Refusals*'; done
    onoff 1 )
  bash "$0" pages; exit 0
fi
# suite: after the final read's mends, the whole of test_gpu_ht at R = 2, its implicit, bit-exact, graph and
#   registration tests at R = 8, test_gpu_ll at R = 2, and one R = 8 bench pair on / off.
if [ "$part" = suite ]; then
  ( mps_start; htall 2 1 60; htsome 8 60 '*Implicit*:*BitExact*:*GraphReplay*:*Refusals*'
    LD_LIBRARY_PATH=$D EPCOMM_GPU_TEST_RANKS=2 timeout 100 $D/test_gpu_ll > $OUT/ll_r2.log 2>&1
    echo "### test_gpu_ll R=2 rc $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" $OUT/ll_r2.log | tail -4; el
    for v in 1 0; do echo "### HT R=8 sms=16 auto=$v"
      EPCOMM_GPU_HT_AUTO_REGISTER=$v LD_LIBRARY_PATH=$D timeout 60 $D/epcomm-run -n 8 -- $D/epcomm-bench --ops ht \
        --iters 20 --warmup 5 --sms 16 2>&1 | grep -E "^HT |rror|^epcomm-bench"; done; el )
  exit 0
fi
if [ "$part" = san ]; then
  F='*Implicit*:*BitExact*:*GraphReplay*'
  SAN_TESTS=test_gpu_ht SAN_TOOLS=memcheck FILTER=$F SAN_TIMEOUT=80 OUT=$OUT bash scripts/gpu_sanitize.sh $D 2
  echo "### memcheck (API errors reported) rc $?"; mkdir -p $OUT/api; mv $OUT/san_memcheck_test_gpu_ht.log $OUT/api/; el
  SAN_TESTS=test_gpu_ht SAN_TOOLS="memcheck racecheck synccheck" SAN_ARGS="--report-api-errors no" FILTER=$F \
    SAN_TIMEOUT=100 OUT=$OUT bash scripts/gpu_sanitize.sh $D 2; echo "### memcheck, racecheck, synccheck rc $?"; el
  exit 0
fi
if [ "$part" = verify ]; then
  ( mps_start; htall 2 1 60; htall 4 1 90; FILTER='-*TwoHosts*' htall 8 1 120; SMALL=1 onoff 1 )
  left=$(( ${LIMIT:-560} - ($(date +%s) - T0) ))
  [ $left -gt 60 ] && SAN_TESTS=test_gpu_ht SAN_TOOLS=memcheck FILTER='*Implicit*:*BitExact*' SAN_TIMEOUT=$(( left - 40 )) \
    OUT=$OUT bash scripts/gpu_sanitize.sh $D 2 && echo "### memcheck rc 0" || echo "### memcheck rc $?"
  grep -h "ERROR SUMMARY\|PASSED\|FAILED" $OUT/san_*.log 2>/dev/null | sort | uniq -c | head; el
  exit 0
fi
( mps_start
  for R in 2 8; do htsome $R 150 '*Implicit*:*BitExact*:*GraphReplay*'; done
  onoff 3; htall 4 1 200; htall 2 2 120 )
