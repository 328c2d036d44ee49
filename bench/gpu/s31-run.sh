#!/bin/bash
# s31's device calls (issue 12), on a build made here and carried (carry [".gpupack"]):
#   bash scripts/gpu_stage.sh build-gpu .gpupack/new && cp build-gpu/bench/net/proxy_bench \
#     build-gpu/bench/host-path-probe .gpupack/new/ && strip --strip-debug .gpupack/new/*
#   bash bench/gpu/s31-run.sh PART [DIR]   (DIR default .gpupack/new)
# probe: bench/gpu/host_path_probe.cu, the ceilings of the path between hosts on this machine.
# pb:    proxy_bench (the proxy alone, on the CPU) with the far-copy stores streaming (1) or memcpy (0), alternating,
#        ROUNDS (3) rounds at R = 2 and 4.
# xhost: the GPU engine across 2 virtual hosts (net socket), HT and LL rows with xhost/raw, for each environment of
#        VARIANTS in turn, ROUNDS (2) rounds at -n 4, then N8 (1) at -n 8.
# ab:    before / after across 2 virtual hosts (see the part).
# tests: test_gpu_ht and test_gpu_ll across 2 virtual hosts at R = 4 (TT s each; export EPCOMM_GPU_PROXY_RING_BYTES=1048576
#        for many laps of the rings).
# (Call 2's pbmin part measured a scratch knob that did not land; bench/results/h100-s31.log has it.)
cd "$(dirname "$0")/../.."
part=${1:-probe}; D=${2:-.gpupack/new}
source bench/gpu/common.sh
gpu_log s31 $part
[ -x $D/epcomm-bench ] || { echo "### $D has no staged build"; exit 1; }
nproc; free -g | head -2
# VARIANTS: space-separated environments, each VAR=VALUE[,VAR=VALUE...] ("-" for none), for xhost's A/B
variants() { for v in ${VARIANTS:--}; do [ "$v" = - ] && echo "" || echo "${v//,/ }"; done; }
case $part in
  probe) $D/host-path-probe --mb ${MB:-512}; el ;;
  pb)
    for i in $(seq ${ROUNDS:-3}); do for a in "2 256 2" "4 128 1"; do set -- $a; for v in 1 0; do
      echo -n "round $i R=$1 stream=$v: "
      EPCOMM_GPU_PROXY_STREAM_STORES=$v EPCOMM_NET=socket LD_LIBRARY_PATH=$D timeout 60 $D/proxy_bench --ranks $1 \
        --mb $2 --writers $3 2>&1 | grep -E "^[0-9]+ +[0-9.]+ |rror" | tail -1
    done; done; done; el ;;
  xhost)  # ROUNDS rounds of every variant at -n 4, then N8 (1) at -n 8
    ( mps_start
      for i in $(seq ${ROUNDS:-2}); do variants | while read -r v; do xhost $D 4 $v; done; el; done
      for i in $(seq ${N8:-1}); do variants | while read -r v; do xhost $D 8 $v; done; el; done ) ;;
  ab)  # before / after: BASE (main's code: the streaming build of call 1 with EPCOMM_GPU_PROXY_STREAM_STORES=0, its
       # libepcomm and epcomm-bench only) against DIR, in turn, ROUNDS (2) rounds at -n 4, N8 (1) at -n 8
    ( mps_start; B=${BASE:-.gpupack/base}; cp -n $D/epcomm-run $B/ 2>/dev/null
      for n in 4 8; do for i in $(seq $([ $n = 4 ] && echo ${ROUNDS:-2} || echo ${N8:-1})); do
        xhost $B $n EPCOMM_GPU_PROXY_STREAM_STORES=0; xhost $D $n; el; done; done ) ;;
  tests)
    ( mps_start
      for t in ht ll; do LD_LIBRARY_PATH=$D EPCOMM_GPU_TEST_RANKS=4 EPCOMM_GPU_TEST_HOSTS=2 timeout ${TT:-200} \
        $D/test_gpu_$t > $OUT/$t-r4-h2.log 2>&1; echo "### test_gpu_$t R=4 hosts=2 rc $?"
        grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" $OUT/$t-r4-h2.log | tail -6; el; done ) ;;
esac
