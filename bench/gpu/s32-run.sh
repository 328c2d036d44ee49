#!/bin/bash
# s32's device calls (issue 12), on builds made here and carried (carry [".gpupack"]):
#   .gpupack/new:   scripts/gpu_stage.sh of build-gpu, plus bench/net/proxy_bench and bench/host-path-probe
#   .gpupack/probe: libepcomm and epcomm-bench of a build with -DEPCOMM_LL_PROBE (kernels/ll_probe.cuh; the CUDA
#                   runtime and epcomm-run come from .gpupack/new)
#   bash bench/gpu/s32-run.sh PART
# probe:  bench/gpu/host_path_probe.cu, all parts ((f) first run here).
# phases: the LL rows across 2 virtual hosts at -n 4 and -n 8 with the dispatch's phase stamps (PROBE lines: per
#         phase the earliest / latest block, ns after the operation's first send stamp) of rank 0 and of the first
#         rank of the other host.
# pbx:    proxy_bench (the proxy alone on the CPU): at R = 2 and 4 the raw stream with 4 and with 1 message in flight,
#         then the proxy under VARIANTS (environments, as s31-run.sh's), each once; per-thread CPU of one run (top).
cd "$(dirname "$0")/../.."
part=${1:-probe}; D=.gpupack/new; P=.gpupack/probe
source bench/gpu/common.sh
gpu_log s32 $part
nproc; free -g | head -2
variants() { for v in ${VARIANTS:--}; do [ "$v" = - ] && echo "" || echo "${v//,/ }"; done; }
pb() {  # pb "VAR=VALUE ..." R MB WRITERS [proxy_bench args]: one line of results
  local v=$1 r=$2 mb=$3 w=$4; shift 4
  env $v LD_LIBRARY_PATH=$D EPCOMM_NET=socket timeout 90 $D/proxy_bench --ranks $r --mb $mb --writers $w "$@" 2>&1 \
    | grep -E "^[0-9]+ +[0-9.]+ |rror" | tail -1; }
case $part in
  probe) $D/host-path-probe --mb ${MB:-512}; el ;;
  phases)
    ( mps_start
      for n in 4 8; do echo "### probe build -n $n --hosts 2 (ll)"
        LD_LIBRARY_PATH=$P:$D EPCOMM_NET=socket timeout 150 $D/epcomm-run -n $n --hosts 2 -- $P/epcomm-bench --ops ll \
          --iters 10 2>&1 | grep -E "^(dispatch|combine|net raw|LL op)|^PROBE [a-z ]+ r(0|$((n / 2))) |rror"; el; done ) ;;
  pbx)
    for a in "2 256 2" "4 128 1"; do set -- $a
      echo "R=$1 raw window 4 / 1 (1 MiB messages), then 4 MiB messages window 4:"
      pb "" $1 $2 $3 --reps 1; pb "" $1 $2 $3 --reps 1 --raw-window 1; pb "" $1 $2 $3 --reps 1 --raw-msg-kb 4096
      variants | while read -r v; do echo -n "R=$1 ${v:-default}: "; pb "$v" $1 $2 $3; done
    done
    echo "### per-thread CPU at R=4 (top -H, 2 s into the run)"
    LD_LIBRARY_PATH=$D EPCOMM_NET=socket timeout 90 $D/proxy_bench --ranks 4 --mb 2048 --writers 1 --reps 5 2>&1 \
      | grep -E "^[0-9]+ +[0-9.]+ |rror" &
    # wait for that pipeline only: a bare `wait` also waits for gpu_log's tee, which never ends (call 1 hung there)
    sleep 3; top -H -b -n 2 -d 2 | awk '/^top -/{n++} n==2' | head -40; wait $!; el ;;
esac
# place (prepared in s32, not run: the session's device time was spent): NetBridge placement
# (EPCOMM_GPU_PROXY_PLACE=4096: every run holding a DATA payload of 2 KiB or more goes as one message the receiver's
# socket backend scatters, payloads straight into the far copy), first the cross-host tests with it and 1 MiB rings
# (test_gpu_ht whole, test_gpu_ll filtered to LLF), then against 0 and 262144 (only runs of 256 KiB or more), in
# turn: proxy_bench ROUNDS (1) rounds at R = 2 and 4, then the GPU engine across 2 virtual hosts at -n 4 (4096, 0).
if [ "$part" = place ]; then
  LLF=${LLF:-*BitExactAgainstHostEngine*:*GraphReplayMatchesEager*:*RanksOnTwoHosts*:*LateBlocksManyOperations*:*AlltoallvBitExact*}
  ( mps_start
    for t in ht ll; do EPCOMM_GPU_PROXY_PLACE=4096 EPCOMM_GPU_PROXY_RING_BYTES=1048576 LD_LIBRARY_PATH=$D \
      EPCOMM_GPU_TEST_RANKS=4 EPCOMM_GPU_TEST_HOSTS=2 timeout 100 $D/test_gpu_$t \
      $([ $t = ll ] && echo "--gtest_filter=$LLF") > $OUT/$t-r4-h2.log 2>&1
      echo "### test_gpu_$t R=4 hosts=2 rc $? (placement, 1 MiB rings)"
      grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" $OUT/$t-r4-h2.log | tail -6; el; done )
  PV=("EPCOMM_GPU_PROXY_PLACE=4096" "EPCOMM_GPU_PROXY_PLACE=0" "EPCOMM_GPU_PROXY_PLACE=262144")
  for i in $(seq ${ROUNDS:-1}); do for a in "2 256 2" "4 128 1"; do set -- $a; for v in "${PV[@]}"; do
    echo -n "round $i R=$1 $v: "; pb "$v" $1 $2 $3; done; done; done; el
  ( mps_start
    for v in "${PV[@]:0:2}"; do xhost $D 4 $v; done; el )
fi
# store (call 3; the knob is a patch that did not land, .dbg/s32-store-thread.patch on the dev VM; on main both
# variants run main's code): EPCOMM_GPU_PROXY_STORE_THREAD 1 against 0, in turn: proxy_bench ROUNDS (3) rounds at R = 2, 4, 8,
# then the GPU engine across 2 virtual hosts, XR (2) rounds at -n 4 and N8 (1) at -n 8.
if [ "$part" = store ]; then
  for i in $(seq ${ROUNDS:-3}); do for a in "2 256 2" "4 128 1" "8 64 1"; do set -- $a; for v in 1 0; do
    echo -n "round $i R=$1 store thread $v: "; pb EPCOMM_GPU_PROXY_STORE_THREAD=$v $1 $2 $3; done; done; done; el
  ( mps_start
    for n in 4 8; do for i in $(seq $([ $n = 4 ] && echo ${XR:-2} || echo ${N8:-1})); do for v in 1 0; do
      xhost $D $n EPCOMM_GPU_PROXY_STORE_THREAD=$v; done; el; done; done )
fi
# llc (call 4): whether the last-level cache decides the rates: the raw stream with 4 MiB messages, 16 in flight (64 MiB
# of distinct buffers per peer and direction) against the default (4 x 1 MiB), and the proxy with 2 MiB rings and
# inboxes (256 KiB messages) against the default 8 MiB (1 MiB), ROUNDS (2) rounds at R = 2 and 4; then the GPU engine
# across 2 virtual hosts at -n 4 with the small rings and with the default, XR (1) rounds.
if [ "$part" = llc ]; then
  SMALL="EPCOMM_GPU_PROXY_RING_BYTES=2097152 EPCOMM_GPU_PROXY_MSG_BYTES=262144"
  for i in $(seq ${ROUNDS:-2}); do for a in "2 256 2" "4 128 1"; do set -- $a
    echo -n "round $i R=$1 default: "; pb "" $1 $2 $3
    echo -n "round $i R=$1 raw 16 x 4 MiB: "; pb "" $1 $2 $3 --reps 1 --raw-window 16 --raw-msg-kb 4096
    echo -n "round $i R=$1 2 MiB rings: "; pb "$SMALL" $1 $2 $3
  done; done; el
  ( mps_start
    for i in $(seq ${XR:-1}); do xhost $D 4 $SMALL; xhost $D 4; el; done )
fi
# scratch (call 2): proxy_bench_scratch, a proxy_bench built with two scratch knobs that did not land:
# EPCOMM_SCRATCH_NOSTORE=1 (storeIn skips DATA's copy into the far copy), EPCOMM_SCRATCH_NOWRITE=1 (the CPU writers
# standing in for the kernels write the record headers only); ROUNDS rounds at R = 2 and 4.
if [ "$part" = scratch ]; then
  for i in $(seq ${ROUNDS:-3}); do for a in "2 256 2" "4 128 1"; do set -- $a
    for v in "" EPCOMM_SCRATCH_NOSTORE=1 EPCOMM_SCRATCH_NOWRITE=1 "EPCOMM_SCRATCH_NOSTORE=1 EPCOMM_SCRATCH_NOWRITE=1"; do
      echo -n "round $i R=$1 ${v:-copies}: "
      env $v LD_LIBRARY_PATH=$D EPCOMM_NET=socket timeout 60 $D/proxy_bench_scratch --ranks $1 --mb $2 --writers $3 \
        2>&1 | grep -E "^[0-9]+ +[0-9.]+ |rror" | tail -1
    done; done; done; el
fi
