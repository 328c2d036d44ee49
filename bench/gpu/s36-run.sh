#!/bin/bash
# s36's device calls (issue 12), on a pack built here and carried as .gpupack/m.tar.xz (scripts/gpu_stage.sh of
# build-gpu plus bench/net/proxy_bench; unpacked here when its folder is missing):
#   bash bench/gpu/s36-run.sh PART
# one:  the owed checks and the main diagnostics in one call, most needed first, each part only while BUDGET (570 s)
#       lasts: test_gpu_ht at R = 4 across 2 hosts, NCCL through the plugin at world 2, test_gpu_ll at R = 4 across
#       2 hosts, proxy_bench (default, 2 helper threads) and the proxy's trace, the engine at -n 4 across 2 hosts by
#       default / --blocking-sync / 2 helper threads, proxy_bench with 64 KiB records and with 4 MiB messages)
# sweep: the small-message sweep alone (below)
# diag: what main owes on the GPU (test_gpu_ht at R = 4 across 2 virtual hosts); where the proxy's
#       gap to the raw stream comes from (proxy_bench R = 2 with one knob at a time: 64 KiB records instead of 14,
#       2 and 8 helper threads per connection instead of 4, a bridge thread of its own, 512 KiB chunks, 4 MiB proxy
#       messages with 32 MiB rings, a raw stream with 1 message in flight); the engine at -n 4 across 2 hosts with
#       and without --blocking-sync, alternating (the bench's raw reference is now before + after the operations)
# nccl: NCCL through the plugin, worlds 2 and 4, test_gpu_ll at R = 4 across 2 hosts, then the small-message sweep
#       against NCCL's own Socket transport (world 2, 8 KiB .. 8 MiB, 3 interleaved rounds)
# The plugin is built there by the scripts: do not carry build-nccl-net (its build.ninja holds absolute paths).
cd "$(dirname "$0")/../.."
part=${1:-diag}
T0=$(date +%s); source bench/gpu/common.sh; gpu_log s36 $part
unpack_packs
D=${D:-.gpupack/m}
case $part in
  one)  # everything owed in one call, most needed first, each part only while BUDGET (default 570 s) lasts
    left() { echo $(( ${BUDGET:-570} - ($(date +%s) - T0) )); }
    ( mps_start
      suite1 ht 4 2 60 )
    echo "### NCCL through the plugin, world 2, $(left) s left"
    [ $(left) -gt 60 ] && WORLDS=2 timeout $(( $(left) < 150 ? $(left) : 150 )) bash scripts/nccl_plugin_gpu.sh 2>&1 \
      | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -14; el
    ( mps_start
      [ $(left) -gt 100 ] && suite1 ll 4 2 $(( $(left) < 170 ? $(left) - 10 : 160 ))
      echo "## columns: raw_GB/s proxy_GB/s proxy/raw raw_cpu_ns/B proxy_cpu_ns/B"
      [ $(left) -gt 40 ] && { pb $D; pb $D EPCOMM_NET_NTHREADS=2; }
      [ $(left) -gt 40 ] && { echo "## proxy trace (once a second: busy share by part, outbox free bytes)"
        EPCOMM_GPU_PROXY_TRACE=1 EPCOMM_NET=socket LD_LIBRARY_PATH=$D timeout 30 $D/proxy_bench --ranks 2 --mb 2048 \
          --writers 2 --reps 2 2>&1 | grep -E "busy|outbox|^2 +[0-9.]+ " | head -12; el; }
      [ $(left) -gt 80 ] && { XT=60 xhost $D 4; XT=60 BENCH_ARGS=--blocking-sync xhost $D 4; }
      [ $(left) -gt 70 ] && XT=60 xhost $D 4 EPCOMM_NET_NTHREADS=2
      [ $(left) -gt 30 ] && { pb $D --record-kb 64; pb $D EPCOMM_GPU_PROXY_MSG_BYTES=4194304 EPCOMM_GPU_PROXY_RING_BYTES=33554432; }
      el ) ;;
  sweep)
    ROUNDS=3 REPS=3 ITERS_SCALE=3 WORLDS=2 OPS=broadcast,all_gather,all_reduce,all_to_all SIZES=8K,32K,128K,512K,2M,8M \
      timeout 560 bash scripts/nccl_bench_gpu.sh 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -45; el ;;
  diag)
    ( mps_start
      suite1 ht 4 2 60
      echo "## columns: raw_GB/s proxy_GB/s proxy/raw raw_cpu_ns/B proxy_cpu_ns/B"
      pb $D; pb $D --record-kb 64; pb $D EPCOMM_NET_NTHREADS=2; pb $D EPCOMM_NET_NTHREADS=8
      pb $D EPCOMM_GPU_PROXY_NET_THREAD=1; pb $D EPCOMM_NET_MIN_CHUNK=524288
      pb $D EPCOMM_GPU_PROXY_MSG_BYTES=4194304 EPCOMM_GPU_PROXY_RING_BYTES=33554432; pb $D --raw-window 1; pb $D; el
      echo "## proxy trace (once a second: busy share by part, outbox free bytes)"
      EPCOMM_GPU_PROXY_TRACE=1 EPCOMM_NET=socket LD_LIBRARY_PATH=$D timeout 60 $D/proxy_bench --ranks 2 --mb 2048 \
        --writers 2 --reps 3 2>&1 | grep -E "busy|outbox|^2 +[0-9.]+ " | head -24; el
      for i in 1 2; do XT=70 xhost $D 4; XT=70 BENCH_ARGS=--blocking-sync xhost $D 4; done; XT=70 xhost $D 4 EPCOMM_NET_NTHREADS=2; el ) ;;
  nccl)
    WORLDS="2 4" timeout 200 bash scripts/nccl_plugin_gpu.sh 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -24; el
    ( mps_start; suite1 ll 4 2 170 )
    left=$(( 580 - ($(date +%s) - T0) )); echo "### small-message sweep, $left s left"
    [ $left -gt 60 ] && ROUNDS=3 REPS=3 ITERS_SCALE=3 WORLDS=2 OPS=broadcast,all_gather,all_reduce,all_to_all \
      SIZES=8K,32K,128K,512K,2M,8M timeout $left bash scripts/nccl_bench_gpu.sh 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -45
    el ;;
esac
