#!/bin/bash
# s34's device calls (issue 12), on a build made here and carried (carry [".gpupack"]; .gpupack/new: scripts/gpu_stage.sh
# of build-gpu plus bench/net/proxy_bench):
#   bash bench/gpu/s34-run.sh PART
# suite: s33-run.sh's suite (the GPU suite under MPS, then NCCL through the plugin with what is left of 585 s)
# where: where the time of the cross-host streams goes. The GPU engine at -n 4 across 2 virtual hosts (HT, then LL)
#        and proxy_bench (the proxy alone, R = 2 and 4) with EPCOMM_GPU_PROXY_TRACE=1 (each proxy thread's busy share
#        by part, once a second), while top samples every thread's CPU share (the proxy, the socket helpers
#        epcomm-sock, the bridge thread): a thread near 100% is what limits the stream.
cd "$(dirname "$0")/../.."
part=${1:-where}; D=.gpupack/new
[ "$part" = suite ] && exec bash bench/gpu/s33-run.sh suite
[ "$part" = one ] && { T0=$(date +%s); source bench/gpu/common.sh; gpu_log s34 one
  ( mps_start
    for t in "ll 4 2 150" "ht 4 2 120"; do set -- $t
      LD_LIBRARY_PATH=$D EPCOMM_GPU_TEST_RANKS=$2 EPCOMM_GPU_TEST_HOSTS=$3 timeout $4 $D/test_gpu_$1 > $OUT/$1.log 2>&1
      echo "### test_gpu_$1 R=$2 hosts=$3 rc $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|WARN" $OUT/$1.log | tail -8; el
    done )
  WHERE_PB=${WHERE_PB:-1} bash bench/gpu/s34-run.sh where
  left=$(( 585 - ($(date +%s) - T0) )); echo "### NCCL through the plugin, world 2, $left s left"
  [ $left -gt 50 ] && WORLDS=2 timeout $left bash scripts/nccl_plugin_gpu.sh 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -14
  el; exit 0; }
# knobs: see below
# one: what one call can hold: test_gpu_ll and test_gpu_ht at R = 4 across 2 virtual hosts, where (its proxy_bench at
#      R = 2 only), NCCL through the plugin at 2 ranks with what is left
source bench/gpu/common.sh
gpu_log s34 $part
# threads (top's view, CPU% by thread name) comes from common.sh
case $part in
  knobs)  # where's answer (net calls are most of the proxy thread's busy time): the socket backend's message shape
    # A/B, ROUNDS (2) rounds, alternating: main's build (.gpupack/new) and the one with a helper woken once per
    # message (.gpupack/dedup: its libepcomm, proxy_bench), each by default and with EPCOMM_NET_MIN_CHUNK=512 KiB (a
    # 1 MiB message in 2 chunks, not 8: fewer wake-ups and syscalls per message on the proxy's thread); main's with
    # 4 MiB proxy messages (32 MiB rings); main's with the ranks sleeping in CUDA's waits (epcomm-bench --blocking-sync,
    # proxy_bench as the default). proxy_bench at R = 2, then the engine at -n 4 across 2 hosts (HT and LL)
    ( mps_start
      for i in $(seq ${ROUNDS:-2}); do
        for c in "new" "dedup" "new EPCOMM_NET_MIN_CHUNK=524288" "dedup EPCOMM_NET_MIN_CHUNK=524288" \
                 "new EPCOMM_GPU_PROXY_MSG_BYTES=4194304 EPCOMM_GPU_PROXY_RING_BYTES=33554432" "new BLOCKING"; do
          set -- $c; d=.gpupack/$1; shift; bargs=""  # BLOCKING: the ranks sleep in CUDA's waits (--blocking-sync)
          [ "$1" = BLOCKING ] && { bargs=--blocking-sync; shift; }
          echo -n "round $i proxy_bench R=2 [$d $*]: "
          env "$@" EPCOMM_NET=socket LD_LIBRARY_PATH=$d timeout 60 $d/proxy_bench --ranks 2 --mb 2048 --writers 2 \
            --reps 5 2>&1 | grep -E "^2 +[0-9.]+ |rror" | tail -1
          BENCH_ARGS=$bargs xhost $d 4 "$@"
        done; el
      done ) ;;
  where)
    ( mps_start
      for ops in ht ll; do
        echo "### epcomm-bench --ops $ops -n 4 --hosts 2, EPCOMM_GPU_PROXY_TRACE=1"
        threads > $OUT/top-$ops.txt & tp=$!
        EPCOMM_GPU_PROXY_TRACE=1 LD_LIBRARY_PATH=$D EPCOMM_NET=socket timeout 120 $D/epcomm-run -n 4 --hosts 2 -- \
          $D/epcomm-bench --ops $ops --iters 40 > $OUT/where-$ops.log 2>&1
        echo "rc $?"; grep -E "^(HT|LL|dispatch|combine|net raw)|rror" $OUT/where-$ops.log
        grep "busy" $OUT/where-$ops.log | awk '$6+0 > 10' | tail -24
        kill $tp; pkill -x top; echo "--- top -H, CPU% by thread name (threads, busiest)"; tail -20 $OUT/top-$ops.txt; el
      done )
    for a in "2 4096 2" "4 2048 1"; do set -- $a; [ "$1" = 4 ] && [ "${WHERE_PB:-2}" = 1 ] && continue
      echo "### proxy_bench --ranks $1 --mb $2 --writers $3, EPCOMM_GPU_PROXY_TRACE=1"
      threads > $OUT/top-pb$1.txt & tp=$!
      EPCOMM_GPU_PROXY_TRACE=1 EPCOMM_NET=socket LD_LIBRARY_PATH=$D timeout 90 $D/proxy_bench --ranks $1 --mb $2 \
        --writers $3 --reps 10 > $OUT/pb$1.log 2>&1; echo "rc $?"
      grep -vE "^epcomm proxy rank [0-9]+ ->" $OUT/pb$1.log | tail -16
      kill $tp; pkill -x top; echo "--- top -H"; tail -14 $OUT/top-pb$1.txt; el
    done ;;
esac
