#!/bin/bash
# s39's device calls (issue 12), on a pack built here and carried as .gpupack/m.tar.xz (scripts/gpu_stage.sh of
# build-gpu plus bench/net/proxy_bench and idle_pass_bench; unpacked here when its folder is missing):
#   bash bench/gpu/s39-run.sh PART
# one:   test_gpu_ht R = 4 across 2 hosts (HEAD owes it), where an HT and an LL run's proxy time goes and how its
#        records went out (EPCOMM_GPU_PROXY_TRACE=1: busy shares, message kinds and sizes), the engine at -n 4 across
#        2 hosts with the socket backend's inline size at 64 KiB (main), 16 KiB and 4 KiB alternating, then
#        test_gpu_ll R = 4 across 2 hosts with what BUDGET leaves
# two:   where the net calls' time goes (EPCOMM_GPU_PROXY_TRACE=1 now times each kind of backend call) in HT at -n 4,
#        main and with 256 KiB smallest chunks; then the engine at -n 4 across 2 hosts alternating main, smallest
#        chunk 256 KiB and 1 MiB (a message of the proxy's on fewer sockets: fewer helpers woken per message), and 2
#        helper threads per connection
# three: after the bridge's 256 KiB chunks (StreamHints): test_gpu_ht R = 4 across 2 hosts, a trace of HT, the engine
#        at -n 4 across 2 hosts alternating main, the old 64 KiB chunks and main with the readiness poll at 2 peers,
#        NCCL through the plugin (world 2), test_gpu_ll R = 4 across 2 hosts with what BUDGET leaves
# The plugin is built there by the scripts: do not carry build-nccl-net (its build.ninja holds absolute paths).
cd "$(dirname "$0")/../.."
part=${1:-one}
T0=$(date +%s); source bench/gpu/common.sh; gpu_log s39 $part
unpack_packs
D=${D:-.gpupack/m}
# trace DIR OPS [VAR=VALUE ...]: the bench at -n 4 across 2 hosts with the proxy's trace, its last lines per rank
trace() { local d=$1 ops=$2; shift 2; echo "### trace $ops $*"
  env "$@" EPCOMM_GPU_PROXY_TRACE=1 LD_LIBRARY_PATH=$d EPCOMM_NET=socket timeout 60 $d/epcomm-run -n 4 --hosts 2 -- \
    $d/epcomm-bench --ops $ops --iters ${TITERS:-40} > $OUT/trace_$ops.log 2>&1
  grep -E "^(HT|LL|dispatch|combine|net raw)|rror" $OUT/trace_$ops.log
  for r in 0 1 2 3; do grep -E "proxy rank $r(:| sent:| net calls:)" $OUT/trace_$ops.log | grep -v "busy 0%" | tail -6; done; }
C256="EPCOMM_NET_MIN_CHUNK=262144"; C1M="EPCOMM_NET_MIN_CHUNK=1048576"
case $part in
  one)
    ( mps_start; suite1 ht 4 2 70
      trace $D ht; el; TITERS=200 trace $D ll; el
      for i in 1 2; do for v in "" "EPCOMM_NET_INLINE=16384" "EPCOMM_NET_INLINE=4096"; do
        [ $(left) -gt 200 ] && XT=45 xhost $D 4 $v; done; done; el
      [ $(left) -gt 60 ] && suite1 ll 4 2 $(( $(left) - 10 )) ) ;;
  two)
    ( mps_start; TITERS=20 trace $D ht; el; TITERS=20 trace $D ht $C256; el
      for i in 1 2; do for v in "" "$C256" "$C1M" "$N2"; do [ $(left) -gt 30 ] && XT=45 xhost $D 4 $v; done; done; el ) ;;
  three)
    ( mps_start; suite1 ht 4 2 70; TITERS=20 trace $D ht; el
      for i in 1 2; do for v in "" "EPCOMM_NET_MIN_CHUNK=65536" "EPCOMM_NET_READINESS=1"; do
        [ $(left) -gt 200 ] && XT=45 xhost $D 4 $v; done; done; el )
    echo "### NCCL through the plugin, world 2, $(left) s left"
    WORLDS=2 timeout 120 bash scripts/nccl_plugin_gpu.sh 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -14; el
    ( mps_start; [ $(left) -gt 60 ] && suite1 ll 4 2 $(( $(left) - 10 )) ) ;;
esac
