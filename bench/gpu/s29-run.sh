#!/bin/bash
# s29's device calls, on builds made here and carried (carry [".gpupack"]):
#   bash scripts/gpu_stage.sh build-gpu .gpupack/main && strip --strip-debug .gpupack/main/*
#   bash bench/gpu/s29-run.sh quick [DIR]   (~560 s) common.sh's quick on DIR (default .gpupack/main)
cd "$(dirname "$0")/../.."
part=${1:-quick}; D=${2:-.gpupack/main}
source bench/gpu/common.sh
gpu_log s29 $part
[ -x $D/epcomm-bench ] || { echo "### $D has no staged build"; exit 1; }
if [ "$part" = quick ]; then quick $D; fi
# ab: scratch branch s29-ht-comb (b59adb7, not landed), staged as .gpupack/comb: EPCOMM_GPU_HT_COMB_VAR 0-3 picks
# the pull combine's reduce with 4 or 8 rows in flight per lane (bit 0: 8 rows of one 16-byte chunk instead of 4
# rows of two) and evict-first loads and stores of the read-once rows (bit 1), against main at issue 11's R = 8,
# 16 SMs, 3 rounds; its test_gpu_ht BitExact / GraphReplay at R = 2 and 8 with variants 1 and 3; then quick on
# main while the call lasts.
if [ "$part" = ab ]; then
  ( mps_start
    echo "## (ab) HT R=8 sms=16, main and comb variants, 3 rounds"
    for i in 1 2 3; do for v in main 0 1 2 3; do
      if [ $v = main ]; then d=$D; else d=.gpupack/comb; fi; echo "### round $i $v"
      EPCOMM_GPU_HT_COMB_VAR=$v LD_LIBRARY_PATH=$d timeout 60 $d/epcomm-run -n 8 -- $d/epcomm-bench --ops ht \
        --iters 20 --sms 16 2>&1 | grep -E "^HT (dispatch|combine) |rror"; done; el; done
    for v in 1 3; do for R in 2 8; do
      EPCOMM_GPU_HT_COMB_VAR=$v EPCOMM_GPU_TEST_RANKS=$R LD_LIBRARY_PATH=.gpupack/comb timeout 100 \
        .gpupack/comb/test_gpu_ht --gtest_filter='*BitExact*:*GraphReplay*' > $OUT/ht_v${v}_r$R.log 2>&1
      echo "### comb var $v test_gpu_ht R=$R rc $?"
      grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" $OUT/ht_v${v}_r$R.log | tail -4
    done; done; el )
  [ $(( $(date +%s) - T0 )) -lt 300 ] && quick $D
fi
# host: issue 9's goal shape 3 rounds on main (.gpupack/main), then bench/net/host_xhost_diag.sh on the host engine
# with its channels working (until s29 the API turned num_channels 0 into 1: EPCOMM_HOST_CHANNELS and the
# cores-per-rank default were never used), from build-host/ staged here (.gpupack/build-host, moved into place).
if [ "$part" = host ]; then
  ( mps_start; goal $D 3 )
  [ -d .gpupack/build-host ] && [ ! -e build-host ] && cp -a .gpupack/build-host build-host
  SHORT=${SHORT:-} OUT=$OUT bash bench/net/host_xhost_diag.sh; el
fi
