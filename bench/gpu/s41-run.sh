#!/bin/bash
# s41's device calls (issue 12), on a pack built here and carried as .gpupack/m.tar.xz (scripts/gpu_stage.sh of
# build-gpu plus bench/net/proxy_bench and idle_pass_bench; unpacked here when its folder is missing):
#   bash bench/gpu/s41-run.sh PART
# one:   what HEAD owes (test_gpu_ht and test_gpu_ll at R = 4 across 2 virtual hosts, NCCL through the plugin at
#        world 2), between them s40's traced HT run at -n 4 across 2 hosts (outbox occupancy and payloads in flight:
#        credit-bound or producer-bound?) and main's HT and LL rows with xhost/raw
# hier:  hierarchical HT dispatch across hosts (a token crosses to a host once, to a forwarder there): test_gpu_ht
#        at R = 4, 8 and 6 over 2 virtual hosts (2 x 2, 2 x 4, 2 x 3), the flat path's cross-host case
#        (EPCOMM_HT_HIERARCHICAL=0); HT at -n 4 and -n 8 across 2 hosts, hierarchical and flat alternating (GB/s per
#        rank is what a user feels; xhost MB/op says how many bytes crossed); test_gpu_ll R = 4 over 2 hosts; NCCL
#        through the plugin at world 2 with what is left
# two:   test_gpu_ht R = 4 over 2 hosts (with the flat-dispatch case added after call 1), the traced HT and LL runs
#        at -n 4 across 2 hosts (where the time of the cross-host stream goes: outbox occupancy, payloads in flight),
#        test_gpu_ll R = 4 over 2 hosts with the time it needs (call 1's 90 s was too short)
# spread: the forwarder of a source's channel moving along the ranks of the host (EPCOMM_GPU_HT_FWD_SPREAD=1, every
#        remote rank gets part of each source's stream) against one forwarder per source (=0) and flat: HT at -n 4
#        and -n 8 across 2 hosts; test_gpu_ht R = 4 and 8 over 2 hosts first
# The plugin is built there by the scripts: do not carry build-nccl-net (its build.ninja holds absolute paths).
cd "$(dirname "$0")/../.."
part=${1:-one}
T0=$(date +%s); source bench/gpu/common.sh; gpu_log s41 $part
unpack_packs
D=${D:-.gpupack/m}
case $part in
  one)
    ( mps_start; suite1 ht 4 2 70; trace ht; el
      XT=60 xhost $D 4; el
      [ $(left) -gt 150 ] && suite1 ll 4 2 90 )
    echo "### NCCL through the plugin, world 2, $(left) s left"
    WORLDS=2 timeout $(( $(left) > 150 ? 150 : $(left) )) bash scripts/nccl_plugin_gpu.sh 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -14; el ;;
  two)
    ( mps_start; suite1 ht 4 2 60; trace ht; el; trace ll; el
      suite1 ll 4 2 $(( $(left) - 5 )) ) ;;
  spread)
    F="EPCOMM_HT_HIERARCHICAL=0"; S0="EPCOMM_GPU_HT_FWD_SPREAD=0"
    ( mps_start; suite1 ht 4 2 60; suite1 ht 8 2 100
      for i in 1 2; do for n in 4 8; do [ $(left) -gt 120 ] || continue
        OPS=ht XT=60 xhost $D $n; OPS=ht XT=60 xhost $D $n $S0; [ $i = 1 ] && OPS=ht XT=60 xhost $D $n $F; done; done; el ) ;;
  hier)
    F="EPCOMM_HT_HIERARCHICAL=0"
    ( mps_start; suite1 ht 4 2 60
      grep -q "^\[  PASSED  \] 8 tests" $OUT/ht_r4_h2.log || { grep -E "Failure|rror|FAILED|rank" $OUT/ht_r4_h2.log | head -30; }
      suite1 ht 8 2 100
      for i in 1 2; do for n in 4 8; do [ $(left) -gt 200 ] || continue
        OPS=ht XT=60 xhost $D $n; OPS=ht XT=60 xhost $D $n $F; done; done; el
      [ $(left) -gt 150 ] && suite1 ht 6 2 70
      [ $(left) -gt 120 ] && { echo "### flat: $F"; env LD_LIBRARY_PATH=$D EPCOMM_GPU_TEST_RANKS=4 $F timeout 40 $D/test_gpu_ht \
        --gtest_filter='*TwoHosts*' 2>&1 | grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" | tail -4; el; }
      [ $(left) -gt 100 ] && suite1 ll 4 2 90 )
    [ $(left) -gt 60 ] && { echo "### NCCL through the plugin, world 2, $(left) s left"
      WORLDS=2 timeout $(( $(left) - 10 )) bash scripts/nccl_plugin_gpu.sh 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]" | tail -14; el; } ;;
esac
