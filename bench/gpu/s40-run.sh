#!/bin/bash
# s40's device calls (issue 12), on a pack built here and carried as .gpupack/m.tar.xz (scripts/gpu_stage.sh of
# build-gpu plus bench/net/proxy_bench and idle_pass_bench; unpacked here when its folder is missing):
#   bash bench/gpu/s40-run.sh PART
# one:   test_gpu_ht R = 4 across 2 hosts (HEAD owes it); the engine at -n 4 across 2 hosts, 2 alternating rounds of:
#        main; the ranks' own threads sleeping in CUDA's waits instead of spinning (epcomm-bench --blocking-sync: is
#        the engine short of CPU?); HT queue rounds of half a queue (EPCOMM_GPU_QUEUE_ROUND=32: under MPS a round is
#        one row per warp, 8 at -n 4, each a FLAG record, a system fence and a poll of host memory across hosts) and
#        128-row queues in rounds of 64; device waits across hosts sleeping up to 2 us between polls
#        (EPCOMM_GPU_FAR_POLL_NS=2048, reverted since: fewer reads of host memory beside the bulk ones); top's view of
#        the threads in the first round; the readiness threshold: LL at -n 8 on 8 hosts (7 peers, poll on) against
#        EPCOMM_NET_READINESS=0 and at -n 4 on 4 hosts (3 peers, poll off) against =1; NCCL through the plugin
#        (world 2); test_gpu_ll R = 4 across 2 hosts
# two:   HT alone at -n 4 across 2 hosts, while BUDGET lasts: a trace (outbox occupancy and payloads in flight: is the
#        stream credit-bound, waiting for the transport, or producer-bound?); main; 32 MiB rings with 4 MiB messages;
#        lone messages up to 512 KiB moved by the proxy's own thread (EPCOMM_NET_ASSIST_MAX: no helper wake-up
#        between a payload's frame and its receive); the raw reference in 256 KiB messages (the proxy's size) beside
#        main's 1 MiB; 128-row queues with every line of output (call one's second round of them printed no row);
#        the big rings and main again
# ab:    AB_ROUNDS (2) alternating rounds of the engine at -n 4 across 2 hosts (OPS), one run per variant in AB
#        (variants separated by '|', each VAR=VALUE ... for the run's environment; BA=1 in a variant passes
#        --blocking-sync), with top's view of the threads in the first round; then test_gpu_ht R = 4 across 2 hosts
#        with what BUDGET leaves
# The plugin is built there by the scripts: do not carry build-nccl-net (its build.ninja holds absolute paths).
cd "$(dirname "$0")/../.."
part=${1:-one}
T0=$(date +%s); source bench/gpu/common.sh; gpu_log s40 $part
unpack_packs
D=${D:-.gpupack/m}
# seen NAME: the busiest seconds of a threads log (the 6 with the highest total)
seen() { echo "--- top -H $1, CPU% by thread name (threads, busiest), 6 busiest seconds"; sort -t' ' -k3 -n -r $OUT/top-$1.txt | head -6; }
BS=--blocking-sync; k=0
case $part in
  one)
    ( mps_start; suite1 ht 4 2 70
      for i in 1 2; do for v in "" "BA=1" "EPCOMM_GPU_QUEUE_ROUND=32" "EPCOMM_GPU_QUEUE_ROWS=128 EPCOMM_GPU_QUEUE_ROUND=64" "EPCOMM_GPU_FAR_POLL_NS=2048"; do
        [ $(left) -gt 270 ] || continue
        a=""; [ "${v#BA=1}" != "$v" ] && { a=$BS; v=""; }
        [ $i = 1 ] && { threads > $OUT/top-r$i-$k.txt & tp=$!; }
        XT=45 BENCH_ARGS=$a xhost $D 4 $v
        [ $i = 1 ] && { kill $tp; pkill -x top; seen r$i-$k; }
        k=$((k + 1))
      done; done; el
      [ $(left) -gt 220 ] && { OPS=ll XH=8 XT=40 xhost $D 8; OPS=ll XH=8 XT=40 xhost $D 8 $R0; }
      [ $(left) -gt 200 ] && { OPS=ll XH=4 XT=40 xhost $D 4; OPS=ll XH=4 XT=40 xhost $D 4 EPCOMM_NET_READINESS=1; }
      el )
    echo "### NCCL through the plugin, world 2, $(left) s left"
    WORLDS=2 timeout 120 bash scripts/nccl_plugin_gpu.sh 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -14; el
    ( mps_start; [ $(left) -gt 60 ] && suite1 ll 4 2 $(( $(left) - 10 )) ) ;;
  two)
    ( mps_start
      trace ht; el
      OPS=ht XT=40 xhost $D 4
      OPS=ht XT=40 xhost $D 4 $BIG
      [ $(left) -gt 40 ] && OPS=ht XT=40 xhost $D 4 EPCOMM_NET_ASSIST_MAX=524288
      [ $(left) -gt 40 ] && OPS=ht XT=40 BENCH_ARGS="--net-raw-msg-kb 256" xhost $D 4
      [ $(left) -gt 70 ] && { echo "### HT -n 4 --hosts 2 EPCOMM_GPU_QUEUE_ROWS=128, every line"
        EPCOMM_GPU_QUEUE_ROWS=128 LD_LIBRARY_PATH=$D EPCOMM_NET=socket timeout 60 $D/epcomm-run -n 4 --hosts 2 -- \
          $D/epcomm-bench --ops ht --iters 10 > $OUT/q128.log 2>&1; echo "rc $?"; grep -v "^net raw:" $OUT/q128.log | tail -30; el; }
      [ $(left) -gt 40 ] && OPS=ht XT=40 xhost $D 4 $BIG
      [ $(left) -gt 40 ] && OPS=ht XT=40 xhost $D 4; el ) ;;
  ab)
    ( mps_start; IFS='|' read -ra vs <<< "$AB"
      for i in $(seq ${AB_ROUNDS:-2}); do for k in "${!vs[@]}"; do
        [ $(left) -gt 80 ] || continue
        v=${vs[$k]}; a=""; [ "${v#*BA=1}" != "$v" ] && a=$BS; v=${v//BA=1/}
        [ $i = 1 ] && { threads > $OUT/top-v$k.txt & tp=$!; }
        XT=45 BENCH_ARGS=$a xhost $D 4 $v
        [ $i = 1 ] && { kill $tp; pkill -x top; seen v$k; }
      done; done; el
      [ $(left) -gt 60 ] && suite1 ht 4 2 60 ) ;;
esac
