#!/bin/bash
# s38's device calls (issue 12), on a pack built here and carried as .gpupack/m.tar.xz (scripts/gpu_stage.sh of
# build-gpu plus bench/net/proxy_bench and idle_pass_bench; unpacked here when its folder is missing):
#   bash bench/gpu/s38-run.sh PART
# check: what main owes on the GPU: test_gpu_ht at R = 4 across 2 hosts, NCCL through the plugin (world 2), the
#        idle pass (readiness against a recv() per idle peer, 8 / 64 / 248 connections), test_gpu_ll at R = 4
#        across 2 hosts
# perf:  readiness on (main) against EPCOMM_NET_READINESS=0, and s37's unmeasured knobs one at a time, alternating
#        while BUDGET (560 s) lasts: proxy_bench R = 2, then the engine at -n 4 across 2 virtual hosts
# final: test_gpu_ht R = 4 across 2 hosts, readiness on/off at -n 4 (2 pairs), small messages against NCCL Socket
#        with 1 helper thread as a third config, test_gpu_ll R = 4 across 2 hosts with what BUDGET leaves
# sweep: NCCL through the plugin against NCCL's own Socket transport, world 2, 8 KiB .. 8 MiB, 3 rounds
# The plugin is built there by the scripts: do not carry build-nccl-net (its build.ninja holds absolute paths).
cd "$(dirname "$0")/../.."
part=${1:-check}
T0=$(date +%s); source bench/gpu/common.sh; gpu_log s38 $part
unpack_packs
D=${D:-.gpupack/m}
case $part in
  check)
    ( mps_start; suite1 ht 4 2 70 )
    echo "### NCCL through the plugin, world 2, $(left) s left"
    WORLDS=2 timeout 170 bash scripts/nccl_plugin_gpu.sh 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -14; el
    echo "### idle pass"; LD_LIBRARY_PATH=$D timeout 60 $D/idle_pass_bench 2>&1 | tail -5; el
    ( mps_start; [ $(left) -gt 60 ] && suite1 ll 4 2 $(( $(left) < 200 ? $(left) - 10 : 190 )) ) ;;
  perf)
    echo "## proxy_bench R=2, columns: raw_GB/s proxy_GB/s proxy/raw raw_cpu_ns/B proxy_cpu_ns/B"
    for i in 1 2; do pb $D; pb $D $R0; pb $D $N2; pb $D $BIG; pb $D --writers 4; done
    pb $D $NOSLEEP; pb $D --raw-window 1; pb $D --writers 8; el
    ( mps_start
      for i in 1 2; do for v in "" "$R0" "$N2" "$BIG"; do [ $(left) -gt 45 ] && XT=45 xhost $D 4 $v; done; done
      el ) ;;
  final)  # after the level-triggered fix: the GPU suites across hosts, readiness A/B, small messages with 1 helper
    ( mps_start; suite1 ht 4 2 70
      for i in 1 2; do for v in "" "$R0"; do [ $(left) -gt 60 ] && XT=45 xhost $D 4 $v; done; done; el )
    echo "### small messages, $(left) s left"
    ROUNDS=4 REPS=3 ITERS_SCALE=2 WORLDS=2 OPS=broadcast,all_gather,all_to_all SIZES=8K,32K,128K \
      EXTRA_CONFIGS="epcomm-socket+EPCOMM_NET_NTHREADS=1" timeout 150 bash scripts/nccl_bench_gpu.sh 2>&1 \
      | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -22; el
    ( mps_start; [ $(left) -gt 60 ] && suite1 ll 4 2 $(( $(left) - 10 )) ) ;;
  sweep)
    ROUNDS=3 REPS=3 ITERS_SCALE=3 WORLDS=2 OPS=broadcast,all_gather,all_reduce,all_to_all SIZES=8K,32K,128K,512K,2M,8M \
      timeout 560 bash scripts/nccl_bench_gpu.sh 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -45; el ;;
esac
