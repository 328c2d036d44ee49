#!/bin/bash
# s37's device calls (issue 12), on a pack built here and carried as .gpupack/m.tar.xz (scripts/gpu_stage.sh of
# build-gpu plus bench/net/proxy_bench; unpacked here when its folder is missing):
#   bash bench/gpu/s37-run.sh PART
# perf:  where the proxy's gap to the raw stream goes, one knob at a time against main, alternating while BUDGET
#        (560 s) lasts: proxy_bench and the engine at -n 4 across 2 virtual hosts with 2 helper threads per
#        connection (64 threads of 4 ranks on 16 cores now), 4 MiB messages with 32 MiB rings, a proxy thread that
#        never sleeps (EPCOMM_BACKOFF_YIELDS), --blocking-sync; proxy_bench with 4 and 8 writer threads instead of 2
#        (are 2 host writers, standing in for the kernels, what bounds it?); a raw stream with 1 message in flight;
#        the trace.
#        (s37's A/B of helper spin and timer slack, bench/results/h200-s37.log, removed both knobs.)
# check: what main owes on the GPU: test_gpu_ht and test_gpu_ll at R = 4 across 2 hosts, NCCL through the plugin
#        (world 2)
# sweep: NCCL through the plugin against NCCL's own Socket transport, world 2, 8 KiB .. 8 MiB, 3 rounds
# The plugin is built there by the scripts: do not carry build-nccl-net (its build.ninja holds absolute paths).
cd "$(dirname "$0")/../.."
part=${1:-perf}
T0=$(date +%s); source bench/gpu/common.sh; gpu_log s37 $part
unpack_packs
D=${D:-.gpupack/m}
case $part in
  perf)
    echo "## proxy_bench R=2, columns: raw_GB/s proxy_GB/s proxy/raw raw_cpu_ns/B proxy_cpu_ns/B"
    for i in 1 2; do pb $D; pb $D $N2; pb $D $BIG; pb $D $NOSLEEP; pb $D --writers 4; done; pb $D --raw-window 1; pb $D --writers 8; el
    echo "## proxy trace (once a second: busy share by part, outbox free bytes)"
    EPCOMM_GPU_PROXY_TRACE=1 EPCOMM_NET=socket LD_LIBRARY_PATH=$D timeout 20 $D/proxy_bench --ranks 2 --mb 2048 \
      --writers 2 --reps 3 2>&1 | grep -E "busy|outbox|^2 +[0-9.]+ " | head -16; el
    ( mps_start
      for i in 1 2; do for v in "" "$N2" "$BIG" "$NOSLEEP"; do [ $(left) -gt 45 ] && XT=45 xhost $D 4 $v; done; done
      [ $(left) -gt 45 ] && XT=45 BENCH_ARGS=--blocking-sync xhost $D 4
      el ) ;;
  check)
    ( mps_start; suite1 ht 4 2 70 )
    echo "### NCCL through the plugin, world 2, $(left) s left"
    WORLDS=2 timeout 170 bash scripts/nccl_plugin_gpu.sh 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -14; el
    ( mps_start; [ $(left) -gt 60 ] && suite1 ll 4 2 $(( $(left) < 200 ? $(left) - 10 : 190 )) ) ;;
  sweep)
    ROUNDS=3 REPS=3 ITERS_SCALE=3 WORLDS=2 OPS=broadcast,all_gather,all_reduce,all_to_all SIZES=8K,32K,128K,512K,2M,8M \
      timeout 560 bash scripts/nccl_bench_gpu.sh 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -45; el ;;
esac
