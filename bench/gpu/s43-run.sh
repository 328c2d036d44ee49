#!/bin/bash
# s43's device calls (issue 12), on packs built here and carried as .gpupack/NAME.tar.xz (scripts/gpu_stage.sh of
# build-gpu; unpacked here when its folder is missing):
#   bash bench/gpu/s43-run.sh PART
# owed:  what s42's last commits owe, on pack D (default .gpupack/m, HEAD): test_gpu_ht at R = 4 and 8 over 2 hosts,
#        at R = 4 with EPCOMM_GPU_HT_COMBINE_HIER=1 for every test, test_gpu_ll at R = 4 over 2 hosts; then which
#        tests took 10 s or more and what the destroy's flush said when it ran out of time (the ~21 s tests of s42),
#        then test_gpu_ht at R = 6 over 3 hosts (never run) and HT across 2 hosts at -n 4 and -n 8, as time allows
# min:   owed's test_gpu_ht runs only (R = 4 and 8 over 2 hosts, then R = 4 with the knob as time allows)
# hosts: never run before: 3 hosts (R = 6, 2 ranks each) and hosts of unequal size (R = 5 on 2 hosts: 3 + 2), HT
#        (default and EPCOMM_GPU_HT_COMBINE_HIER=1) and LL; then memcheck on the hierarchical combine's test (R = 4,
#        2 hosts), after the proof that it sees every rank
cd "$(dirname "$0")/../.."
part=${1:-owed}
T0=$(date +%s); source bench/gpu/common.sh; gpu_log s43 $part
unpack_packs
D=${D:-.gpupack/m}
# Tests of the suites run so far that took 10 s or more, and the destroy's deadline warnings (proxy and bridge).
slow() { echo "### tests of 10 s or more, and flush warnings"
  grep -HE "^\[ +(OK|FAILED) +\] .*\(([0-9]{5,}) ms\)" $OUT/*_h[0-9].log
  grep -hE "destroys its communicator with records|has not acknowledged its goodbye" $OUT/*_h[0-9].log | cut -c1-400 | head -12; }
case $part in
  owed)
    ( mps_start; suite1 ht 4 2 90; mv $OUT/ht_r4_h2.log $OUT/ht_r4_flat_h2.log; suite1 ht 8 2 150
      EPCOMM_GPU_HT_COMBINE_HIER=1 suite1 ht 4 2 90
      suite1 ll 4 2 120; slow
      [ $(left) -gt 130 ] && { suite1 ht 6 3 $(( $(left) - 10 )); slow; }
      for n in 4 8; do [ $(left) -gt 60 ] && OPS=ht XT=45 xhost $D $n; done; el ) ;;
  min)  # owed's first suites only, for a short call
    ( mps_start; suite1 ht 4 2 90; mv $OUT/ht_r4_h2.log $OUT/ht_r4_flat_h2.log; suite1 ht 8 2 150
      [ $(left) -gt 80 ] && EPCOMM_GPU_HT_COMBINE_HIER=1 suite1 ht 4 2 $(( $(left) - 5 )); slow; el ) ;;
  hosts)
    ( mps_start; suite1 ht 6 3 120; mv $OUT/ht_r6_h3.log $OUT/ht_r6_flat_h3.log; suite1 ht 5 2 120
      EPCOMM_GPU_HT_COMBINE_HIER=1 suite1 ht 6 3 120
      suite1 ll 6 3 100; [ $(left) -gt 100 ] && suite1 ll 5 2 100; slow )
    [ $(left) -gt 120 ] && EPCOMM_GPU_TEST_HOSTS=2 SAN_TESTS=test_gpu_ht SAN_TOOLS=memcheck FILTER='*HierarchicalCombine*' \
      SAN_TIMEOUT=$(( $(left) - 40 )) OUT=$OUT bash scripts/gpu_sanitize.sh $D 4; el ;;
esac
