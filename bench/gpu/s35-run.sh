#!/bin/bash
# s35's device calls (issue 12), on a build made here and carried (carry [".gpupack"]; each pack: scripts/gpu_stage.sh
# of build-gpu plus bench/net/proxy_bench):
#   bash bench/gpu/s35-run.sh PART
# first: what main (.gpupack/new) owes since s34's call: test_gpu_ht at R = 4 across 2 virtual hosts; then which
#        message shape the proxy's stream wants (proxy_bench R = 2: default, EPCOMM_NET_MIN_CHUNK=512 KiB, 4 MiB proxy
#        messages with 32 MiB rings; the raw stream with 1 and 2 messages in flight instead of 4, which says how much
#        of the raw rate is pipelining), the engine at -n 4 across 2 hosts by default, with those two knobs and with
#        --blocking-sync; NCCL through the plugin at 2 ranks with what is left of 585 s
# ab:    A/B of .gpupack/new (main) against .gpupack/b (a change; c, where carried: proxy_bench of another), 2 rounds alternating: proxy_bench R = 2, the
#        engine at -n 4 across 2 hosts; between the rounds b with the knobs of `first`; then test_gpu_ht at R = 4
#        across 2 hosts on b, and NCCL through the plugin (built there from this tree) with what is left of 585 s
# micro: proxy_bench alone, main / b / c twice, about 70 s
# mini: one round of ab and the HT suite on b, about 220 s
# short: ab within about 400 s (for a session with little device time left)
# A pack may travel as PACK.tar.xz (carry limit 64 MiB): unpacked here when its folder is missing.
cd "$(dirname "$0")/../.."
part=${1:-first}
T0=$(date +%s); source bench/gpu/common.sh; gpu_log s35 $part
unpack_packs
case $part in
  first) D=.gpupack/new
    ( mps_start
      LD_LIBRARY_PATH=$D EPCOMM_GPU_TEST_RANKS=4 EPCOMM_GPU_TEST_HOSTS=2 timeout 120 $D/test_gpu_ht > $OUT/ht.log 2>&1
      echo "### test_gpu_ht R=4 hosts=2 rc $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|WARN" $OUT/ht.log | tail -8; el
      echo "## columns: raw_GB/s proxy_GB/s proxy/raw raw_cpu_ns/B proxy_cpu_ns/B"
      pb $D; pb $D EPCOMM_NET_MIN_CHUNK=524288
      pb $D EPCOMM_GPU_PROXY_MSG_BYTES=4194304 EPCOMM_GPU_PROXY_RING_BYTES=33554432
      pb $D --raw-window 1; pb $D --raw-window 2; pb $D --raw-window 8; el
      XT=80 xhost $D 4; XT=80 xhost $D 4 EPCOMM_NET_MIN_CHUNK=524288
      XT=80 xhost $D 4 EPCOMM_GPU_PROXY_MSG_BYTES=4194304 EPCOMM_GPU_PROXY_RING_BYTES=33554432
      XT=80 BENCH_ARGS=--blocking-sync xhost $D 4; el )
    left=$(( ${BUDGET:-585} - ($(date +%s) - T0) )); echo "### NCCL through the plugin, world 2, $left s left"
    [ $left -gt 60 ] && WORLDS=2 timeout $left bash scripts/nccl_plugin_gpu.sh 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -14
    el ;;
  ab) B=.gpupack/b
    ( mps_start
      echo "## columns: raw_GB/s proxy_GB/s proxy/raw raw_cpu_ns/B proxy_cpu_ns/B"
      for i in 1 2; do
        for d in .gpupack/new $B $(ls -d .gpupack/c 2>/dev/null); do pb $d; done  # c: proxy_bench only
        for d in .gpupack/new $B; do XT=80 xhost $d 4; done; el
        [ $i = 2 ] && break
        echo "## knobs on b"
        pb $B EPCOMM_NET_MIN_CHUNK=524288; pb $B EPCOMM_GPU_PROXY_RING_BYTES=33554432
        pb $B EPCOMM_GPU_PROXY_MSG_BYTES=4194304 EPCOMM_GPU_PROXY_RING_BYTES=33554432; pb $B --raw-window 8; pb $B --raw-window 32
        XT=80 BENCH_ARGS=--blocking-sync xhost $B 4
        XT=80 BENCH_ARGS="--net-raw-window 16" xhost $B 4; el  # the raw stream from 16 MiB per peer, not 4
      done
      LD_LIBRARY_PATH=$B EPCOMM_GPU_TEST_RANKS=4 EPCOMM_GPU_TEST_HOSTS=2 timeout 100 $B/test_gpu_ht > $OUT/ht.log 2>&1
      echo "### b test_gpu_ht R=4 hosts=2 rc $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|WARN" $OUT/ht.log | tail -8; el )
    left=$(( ${BUDGET:-585} - ($(date +%s) - T0) )); echo "### NCCL through the plugin, world 2, $left s left"
    [ $left -gt 60 ] && WORLDS=2 timeout $left bash scripts/nccl_plugin_gpu.sh 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -14
    el ;;
  short) B=.gpupack/b  # ab within about 400 s: both rounds, the window knobs only, HT suite on b, no NCCL
    ( mps_start
      echo "## columns: raw_GB/s proxy_GB/s proxy/raw raw_cpu_ns/B proxy_cpu_ns/B"
      for i in 1 2; do
        for d in .gpupack/new $B $(ls -d .gpupack/c 2>/dev/null); do pb $d; done
        for d in .gpupack/new $B; do XT=70 xhost $d 4; done; el
        [ $i = 2 ] && break
        pb $B EPCOMM_GPU_PROXY_RING_BYTES=33554432; pb $B --raw-window 32; el
      done
      LD_LIBRARY_PATH=$B EPCOMM_GPU_TEST_RANKS=4 EPCOMM_GPU_TEST_HOSTS=2 timeout 90 $B/test_gpu_ht > $OUT/ht.log 2>&1
      echo "### b test_gpu_ht R=4 hosts=2 rc $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|WARN" $OUT/ht.log | tail -8; el ) ;;
  mini) B=.gpupack/b  # one round of ab, the HT suite on b: about 220 s
    ( mps_start
      echo "## columns: raw_GB/s proxy_GB/s proxy/raw raw_cpu_ns/B proxy_cpu_ns/B"
      for d in .gpupack/new $B $(ls -d .gpupack/c 2>/dev/null) .gpupack/new $B; do pb $d; done
      for d in .gpupack/new $B; do XT=60 xhost $d 4; done; el
      LD_LIBRARY_PATH=$B EPCOMM_GPU_TEST_RANKS=4 EPCOMM_GPU_TEST_HOSTS=2 timeout 80 $B/test_gpu_ht > $OUT/ht.log 2>&1
      echo "### b test_gpu_ht R=4 hosts=2 rc $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|WARN" $OUT/ht.log | tail -8; el ) ;;
  micro)  # proxy_bench only, main / b / c / main / b: about 70 s
    for d in .gpupack/new .gpupack/b .gpupack/c .gpupack/new .gpupack/b; do pb $d; done; el ;;
esac
