#!/bin/bash
# s42's device calls (issue 12), on packs built here and carried as .gpupack/NAME.tar.xz (scripts/gpu_stage.sh of
# build-gpu; unpacked here when its folder is missing):
#   bash bench/gpu/s42-run.sh PART
# head:  what s41's last commits owe (test_gpu_ht at R = 4, 8, 6 over 2 virtual hosts), then HT at -n 4 across 2
#        hosts, hierarchical against flat (EPCOMM_HT_HIERARCHICAL=0) (never ran: no machine came)
# (what s42's last commits owe on the GPU: bench/gpu/s43-run.sh owed)
# hcomb: the hierarchical combine (pack n) against s41's HEAD (pack m, flat combine): test_gpu_ht of n at R = 4 and 8
#        over 2 virtual hosts, then HT at -n 4 and -n 8 across 2 hosts, m and n alternating
# team:  the same with pack n2 (the combine's warps of one far host as one team; the forwarder's cached head)
# deep:  the same with pack n3 (a partial stream runs through the queues of every rank of the combiner's host), one
#        round of the bench: m, n3, n (per-peer groups, one queue) at -n 4 and -n 8
cd "$(dirname "$0")/../.."
part=${1:-head}
T0=$(date +%s); source bench/gpu/common.sh; gpu_log s42 $part
unpack_packs
D=${D:-.gpupack/m}
# The failures of the last test_gpu_ht R = 4 run over 2 hosts, unless all 9 tests passed.
r4_failures() {
  grep -q "^\[  PASSED  \] 9 tests" $OUT/ht_r4_h2.log ||
    grep -E "Failure|rror|FAILED|differ| = " $OUT/ht_r4_h2.log | head -30
}
case $part in
  head)
    F="EPCOMM_HT_HIERARCHICAL=0"
    ( mps_start; suite1 ht 4 2 60; suite1 ht 8 2 100; [ $(left) -gt 150 ] && suite1 ht 6 2 70
      [ $(left) -gt 90 ] && { OPS=ht XT=40 xhost $D 4; OPS=ht XT=40 xhost $D 4 $F; }; el ) ;;
  hcomb|team)
    N=.gpupack/n; [ $part = team ] && N=.gpupack/n2
    ( mps_start; D=$N suite1 ht 4 2 90; r4_failures
      [ $(left) -gt 250 ] && D=$N suite1 ht 8 2 130
      for i in 1 2; do for n in 4 8; do [ $(left) -gt 100 ] || continue
        OPS=ht XT=45 xhost $D $n; OPS=ht XT=45 xhost $N $n; done; done; el ) ;;
  deep)
    N=.gpupack/n3
    ( mps_start; D=$N suite1 ht 4 2 90; r4_failures
      for n in 4 8; do OPS=ht XT=45 xhost $D $n; OPS=ht XT=45 xhost $N $n; OPS=ht XT=45 xhost .gpupack/n $n; done; el
      [ $(left) -gt 150 ] && D=$N suite1 ht 8 2 130 ) ;;
esac
