#!/bin/bash
# s33's device calls (issue 12), on builds made here and carried (carry [".gpupack"]; .gpupack/new as in s32-run.sh:
# scripts/gpu_stage.sh of build-gpu plus bench/net/proxy_bench):
#   bash bench/gpu/s33-run.sh PART
# suite:  the GPU suite under MPS on main's defaults (common.sh suite: test_gpu_ll R = 8, R = 4 across 2 virtual
#         hosts, test_gpu_ht R = 2), then NCCL through the plugin (scripts/nccl_plugin_gpu.sh, 2 and 4 ranks) with
#         what is left of the call's 585 s
# xplace: the GPU engine across 2 virtual hosts (HT and LL, xhost/raw) with EPCOMM_GPU_PROXY_PLACE 4096 against 0,
#         alternating, XR (2) rounds at -n 4 and N8 (1) at -n 8
# verify: call 1's filtered test_gpu_ll with placement ran out of its 100 s inside LateBlocksManyOperations (10000
#         operations of 256-byte rows, which place nothing): test_gpu_ll R = 4 across 2 virtual hosts whole with
#         EPCOMM_GPU_PROXY_PLACE=4096 (default rings), then LateBlocksManyOperations alone with 0 (how long it takes
#         without placement), then (VX=1, the default) the engine at -n 8 with 4096 and with 0
cd "$(dirname "$0")/../.."
part=${1:-suite}; D=.gpupack/new
source bench/gpu/common.sh
gpu_log s33 $part
case $part in
  suite)
    ( mps_start; suite $D )
    left=$(( 585 - ($(date +%s) - T0) )); echo "### NCCL through the plugin, $left s left"
    [ $left -gt 60 ] && WORLDS=${WORLDS:-2 4} timeout $left bash scripts/nccl_plugin_gpu.sh 2>&1 \
      | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -40
    el ;;
  verify)
    ( mps_start
      for v in "4096 *" "0 *LateBlocks*"; do set -f; set -- $v; set +f  # (no globbing of the filter)
        EPCOMM_GPU_PROXY_PLACE=$1 LD_LIBRARY_PATH=$D EPCOMM_GPU_TEST_RANKS=4 EPCOMM_GPU_TEST_HOSTS=2 timeout 200 \
          $D/test_gpu_ll --gtest_filter="$2" > $OUT/ll-place$1.log 2>&1
        echo "### test_gpu_ll R=4 hosts=2 PLACE=$1 filter '$2' rc $?"
        grep -E "^\[ +(OK|FAILED) |^\[  PASSED" $OUT/ll-place$1.log | sed 's/Ranks\/GpuLl\.//' | tail -16; el; done
      [ "${VX:-1}" = 1 ] && { for v in 4096 0; do xhost $D 8 EPCOMM_GPU_PROXY_PLACE=$v; done; el; } ) ;;
  xplace)
    ( mps_start
      for n in 4 8; do for i in $(seq $([ $n = 4 ] && echo ${XR:-2} || echo ${N8:-1})); do
        for v in 4096 0; do xhost $D $n EPCOMM_GPU_PROXY_PLACE=$v; done; el; done; done ) ;;
esac
